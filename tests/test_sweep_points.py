"""A sweep point measures what training at that batch would: compiled afresh for its batch, its peak memory over
the steps after the warm-up, and an activation probe whose failure is the probe's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ampbench import config, data, runplan
from ampbench.measure import memory
from ampbench.sandbox import merge
from ampbench.sweep import bench as bench_module
from ampbench.train import probes, step
from tests.conftest import SHRINK


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared")
    data.prepare(config.DataConfig(source="synthetic", train_size=64, test_size=32), 0, out, out / "raw")
    return data.load_prepared(out, "cpu")


def _bench(prepared, compile_: bool = False):
    cfg = config.from_dict(merge(config.to_dict(config.Config()), SHRINK))
    plan = runplan.for_precision(cfg, "fp32", "cpu")
    plan = dataclasses.replace(plan, train=dataclasses.replace(plan.train, compile=compile_))
    return bench_module.Bench(cfg, prepared, torch.device("cpu"), "fp32", plan=plan)


def test_each_point_compiles_its_own_static_graph(prepared, monkeypatch):
    """Without a reset dynamo compiles the first batch static and the second with a symbolic batch, which every
    later batch then runs: not the graph a training run at that batch compiles."""
    seen = []

    def recording(gm, example_inputs):
        x = next(t for t in example_inputs if isinstance(t, torch.Tensor) and t.dim() == 4
                 and t.shape[1] == 3 and t.shape[-1] != 3)  # the images (16 px), not the first conv's weight
        seen.append(x.shape[0] if isinstance(x.shape[0], int) else "symbolic")
        return gm.forward
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: real(model, backend=recording))
    b = _bench(prepared, compile_=True)
    for batch in (8, 16, 32, 8):
        b.point(batch, 1)
    b.try_step(64)  # the largest-batch search's tries too
    assert seen == [8, 16, 32, 8, 64]


def test_a_point_peaks_after_its_warm_up_and_its_probe_fails_alone(prepared, monkeypatch):
    b = _bench(prepared)
    steps, opened = [], []
    real_step = step.train_step
    monkeypatch.setattr(step, "train_step", lambda *a, **k: (steps.append(1), real_step(*a, **k))[1])

    class Windows(memory.PeakWindows):
        def open(self, phase):
            opened.append((phase, len(steps)))
    monkeypatch.setattr(memory, "PeakWindows", Windows)

    def probe(model, x, policy):
        assert all(p.grad is None for p in model.parameters())  # the last step's gradients freed first
        raise torch.OutOfMemoryError("out of memory (the probe)")
    monkeypatch.setattr(probes, "activation_bytes", probe)
    point = b.point(16, 3)
    assert opened == [("train", bench_module.WARMUP)]  # the peak window opens after the warm-up steps
    assert point["imgs_per_s"] > 0 and point["activation_bytes"] is None and "oom" not in point
