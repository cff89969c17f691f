"""Statistics, the activation meter and the timers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampbench import measure


def test_percentiles_match_numpy_linear():
    v = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert measure.percentile(v, 50) == 3.0
    assert measure.percentile(v, 10) == pytest.approx(1.4)
    assert measure.percentile(v, 90) == pytest.approx(4.6)
    assert measure.summarize_ms(v) == {"median": 3.0, "p10": pytest.approx(1.4), "p90": pytest.approx(4.6), "n": 5}


def test_mean_std():
    assert measure.mean_std([2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]) == (5.0, pytest.approx(2.138, abs=1e-3))
    assert measure.mean_std([3.0]) == (3.0, 0.0)


def test_bootstrap_interval_brackets_the_true_ratio():
    g = torch.Generator().manual_seed(1)
    base = (10 + torch.randn(400, generator=g)).tolist()
    fast = (5 + 0.5 * torch.randn(400, generator=g)).tolist()
    lo, hi = measure.bootstrap_ratio_ci(base, fast)
    assert lo < 2.0 < hi and hi - lo < 0.2


def test_saved_tensor_meter_counts_a_linear_layers_input_exactly():
    lin = nn.Linear(256, 8, bias=False)
    x = torch.randn(32, 256, requires_grad=False)
    meter = measure.SavedTensorMeter()
    with meter.measure():
        lin(x)
    assert meter.bytes == 32 * 256 * 4  # linear saves its input for the weight gradient; the weight is a parameter
    half = measure.SavedTensorMeter()
    with half.measure(), torch.autocast("cpu", dtype=torch.float16):
        lin(x)
    # under fp16 autocast it saves the fp16 copy of the input: exactly half the bytes
    assert half.bytes == 32 * 256 * 2


def test_cpu_timer_and_peak_memory():
    timer = measure.StepTimer("cpu")
    for _ in range(3):
        timer.start()
        torch.randn(100, 100) @ torch.randn(100, 100)
        timer.stop()
    times = timer.read_ms()
    assert len(times) == 3 and all(t > 0 for t in times) and timer.read_ms() == []
    mem = measure.peak_memory("cpu")
    assert mem["mem_meter"] == "process_peak_rss" and mem["peak_mem_bytes"] > 10 * 2**20


def test_optimizer_state_bytes():
    p = nn.Parameter(torch.zeros(10))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(10)
    opt.step()
    assert measure.optimizer_state_bytes(opt) == 40
