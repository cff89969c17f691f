"""A variant that compiles while strict fp32 runs eager (fp8 under train.compile: auto on CUDA) is compared like with
like: the paired check times strict fp32 and bf16 compiled the same way, in the same turns, and the verdict states
its ratios against them, both compiled, with the eager figure beside."""

from __future__ import annotations

import pytest
import torch

from ampbench import config, data, precision, runplan
from ampbench.report import sections, verdict
from ampbench.sandbox import merge
from ampbench.sweep import paired
from tests.conftest import SHRINK


@pytest.fixture
def prepared(tmp_path):
    data.prepare(config.DataConfig(source="synthetic", train_size=64, test_size=32), 0, tmp_path, tmp_path / "raw")
    return data.load_prepared(tmp_path, "cpu")


def test_a_compiled_variant_gets_compiled_fp32_and_bf16_controls(prepared, monkeypatch):
    # what train.compile: auto does on CUDA (fp8 compiled, the rest eager), here on the CPU; dynamo with the eager
    # backend: the same capture, no Inductor build
    monkeypatch.setattr(runplan, "resolve_compile", lambda value, p, device: precision.rung(p).fast_compiled)
    compiled = []
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: (compiled.append(model), real(model, backend="eager"))[1])
    params = merge(config.to_dict(config.Config()), SHRINK)
    params["variants"] = {"fp32": {"precision": "fp32"}, "fp8": {"precision": "fp8"}}
    params["paired"] = {"enabled": True, "rounds": 2, "steps": 1}
    cfg = config.from_dict(params)
    out = paired.run_paired(cfg, prepared, torch.device("cpu"))
    assert out["controls"] == ["compiled fp32", "compiled bf16"] and len(compiled) == 3  # fp8 and the two controls
    assert set(out["imgs_per_s"]) == {"fp32", "fp8", "compiled fp32", "compiled bf16"}
    assert all(len(v) == 2 for v in out["imgs_per_s"].values())
    both = out["vs_compiled"]["fp8"]
    assert set(both) == {"fp32", "bf16"} and len(both["fp32"]["rounds"]) == 2
    assert set(out["vs_compiled"]) == {"fp8"} and out["vs_fp32"]["compiled fp32"]["precision"] == "fp32"
    rows = {"fp32": {"speedup": 1.0}, "fp8": {"speedup": 1.4, "paired": out["vs_fp32"]["fp8"],
                                              "paired_compiled": both, "precision": "fp8"}}
    summary = {"baseline": "fp32", "variants": rows, "paired": out}
    text, _ = verdict.speed(rows["fp8"], summary, "fp8")
    assert "strict FP32, both compiled, in the paired check" in text and "bf16 compiled" in text
    assert "against eager FP32 (the compilation's fusion counted in)" in text
    lines = "\n".join(sections.steadiness(summary, {}, {}))
    assert "| variant | vs fp32, both compiled |" in lines and "compiled fp32, compiled bf16" in lines


def test_no_controls_when_nothing_compiles_or_the_baseline_compiles_too():
    cfg = config.from_dict({"variants": {"fp32": {"precision": "fp32"}, "fp8": {"precision": "fp8"}}})
    plans = {n: runplan.make_plan(cfg, n, "cuda") for n in cfg.variants}  # auto on CUDA: fp8 compiles
    assert plans["fp8"].train.compile and list(paired.controls(cfg, plans, "cuda")) == ["compiled fp32",
                                                                                        "compiled bf16"]
    assert paired.controls(cfg, {n: runplan.make_plan(cfg, n, "cpu") for n in cfg.variants}, "cpu") == {}
    everything = config.from_dict({"variants": {"fp32": {"precision": "fp32"}, "fp8": {"precision": "fp8"}},
                                   "train": {"compile": True}})
    assert paired.controls(everything, {n: runplan.make_plan(everything, n, "cuda") for n in everything.variants},
                           "cuda") == {}
