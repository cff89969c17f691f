"""The CUDA paths: event timers, CUDA memory meters, each precision on the GPU. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from ampbench import config, data, runplan
from ampbench.measure import clock
from ampbench.train import runner

pytestmark = pytest.mark.requires_cuda


@pytest.mark.parametrize("variant", ["fp32", "amp", "amp_accum", "bf16"])
def test_one_epoch_on_cuda(tiny_params, variant):
    tiny_params["device"] = "cuda"
    tiny_params["variants"]["bf16"] = {"precision": "bf16", "accum_steps": 1}
    plan = runplan.make_plan(config.from_dict(tiny_params), variant, "cuda")
    prepared = data.synthetic_in_memory(128, 64, seed=0, device="cuda")
    m = runner.train(plan, prepared, progress=False).metrics
    assert m["mem_meter"] == "cuda_max_memory_allocated"
    assert m["peak_reserved_bytes"] >= m["peak_mem_bytes"] > m["activation_bytes"] > 0
    assert m["imgs_per_s"] > 0 and torch.isfinite(torch.tensor(m["final_loss"]))
    assert m["tf32"] == {"matmul_fp32_precision": "ieee", "cudnn_conv_fp32_precision": "ieee"}


def test_cuda_event_timer_sees_queued_work():
    timer = clock.StepTimer("cuda")
    a = torch.randn(2048, 2048, device="cuda")
    timer.start()
    for _ in range(20):
        a = a @ a / 2048
    timer.stop()
    (ms,) = timer.read_ms()
    assert ms > 0.1  # the matmuls ran inside the interval although the host never waited for them
