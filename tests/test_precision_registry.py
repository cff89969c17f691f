"""The precision registry: a new rung is one module and one line. A toy family, registered from a temporary
module, goes through params.yaml's check, a training step, the census, the roofline count, the verdict and the
report, with no other file touched."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from ampbench import config, precision, report, results
from ampbench.measure import flops, opcount, roofline
from tests.conftest import verdict_of

TOY = '''
"""toy: Linear layers whose GEMMs run in bfloat16, the rest in fp32 (a family written outside ampbench)."""
from dataclasses import dataclass

from ampbench.precision import Rung


def _convert(model):
    import torch
    from torch import nn
    import torch.nn.functional as F

    class ToyLinear(nn.Linear):
        def forward(self, x):
            b = None if self.bias is None else self.bias.to(torch.bfloat16)
            return F.linear(x.to(torch.bfloat16), self.weight.to(torch.bfloat16), b).float()

    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = ToyLinear
    return model


@dataclass(frozen=True)
class Toy(Rung):
    def prepare(self, model, recipe=None, ends=False):
        return _convert(model)

    def census(self, model, recipe, image_size, ends=False):
        import copy
        converted = _convert(copy.deepcopy(model))
        names = [n for n, m in converted.named_modules() if type(m).__name__ == "ToyLinear"]
        return {"recipe": recipe, "converted": len(names), "called": names, "flop_share": 0.5, "widest": None}

    def census_lines(self, census):
        return ["", f"toy halves {len(census['called'])} Linear layers ({census['recipe']})."]

    def runs_note(self, runs):
        return "toy runs: " + ", ".join(f"`{n}` ({r.get('fp8_recipe')})" for n, r in runs) + "."


RUNGS = [Toy("toy", "TOY-HALF", datasheet="bf16", recipes=("plain", "fancy"))]
'''


@pytest.fixture
def toy(tmp_path, monkeypatch):
    (tmp_path / "toyfam.py").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(precision, "FAMILIES", [*precision.FAMILIES, "toyfam"])  # the one line
    precision.register("toyfam")
    yield precision.rung("toy")
    precision.unregister("toyfam")


def _model():
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 32), nn.ReLU(), nn.Linear(32, 10))


def test_a_toy_family_is_one_module_and_one_line(toy, tmp_path):
    from ampbench.train import step
    from ampbench.train.policy import PrecisionPolicy

    assert precision.names()[-1] == "toy" and precision.label("toy") == "TOY-HALF" and toy.converts
    # params.yaml takes it, and its recipes
    cfg = config.from_dict({"variants": {"fp32": {"precision": "fp32"},
                                         "toy": {"precision": "toy", "recipe": "fancy"}}})
    from ampbench import runplan
    plan = runplan.make_plan(cfg, "toy", "cpu")
    assert plan.recipe == "fancy" and runplan.make_plan(cfg, "fp32", "cpu").recipe is None
    # a training step through the engine's step
    policy = PrecisionPolicy("toy", "cpu", None, plan.recipe)
    model = policy.prepare(_model())
    assert sum(type(m).__name__ == "ToyLinear" for m in model.modules()) == 2
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    loss = step.train_step(model, opt, policy.scaler(), policy, x, y, 4)
    assert torch.isfinite(torch.as_tensor(loss))
    # the census, and the roofline count: its GEMMs counted in bf16, at the bf16 column's rate
    census = toy.census(_model(), "fancy", 8)
    assert census["converted"] == 2
    ops = opcount.count(_model(), torch.empty(4, 3, 8, 8), torch.zeros(4, dtype=torch.long), "toy",
                         lambda p: torch.optim.SGD(p, lr=0.1), "fancy")
    mms = [op for op in ops if op.flops and op.phase == "forward"]
    assert mms and {op.dtype for op in mms} == {"bfloat16"}
    row = roofline.find_gpu("H100 SXM")
    table = roofline.table({"fp32": opcount.count(_model(), torch.empty(4, 3, 8, 8),
                                                   torch.zeros(4, dtype=torch.long), "fp32",
                                                   lambda p: torch.optim.SGD(p, lr=0.1)), "toy": ops}, row, 4)
    assert table["toy"]["vs_fp32"] > 0 and flops.datasheet_peak("NVIDIA H100 80GB HBM3", toy.datasheet) == 989.4
    # the verdict and the report, from run folders
    runs = tmp_path / "runs"
    for name, prec, step_ms in (("fp32", "fp32", 300.0), ("toy", "toy", 100.0)):
        metrics = {"variant": name, "precision": prec, "accum_steps": 1, "batch_size": 256, "epochs": 1,
                   "imgs_per_s": 256 / step_ms * 1000, "epoch_time_s": 10.0,
                   "step_time_ms": {"median": step_ms, "p10": step_ms * 0.9, "p90": step_ms * 1.1, "n": 5},
                   "imgs_per_s_p10_p90": [256 / (step_ms * 1.1) * 1000, 256 / (step_ms * 0.9) * 1000],
                   "peak_mem_bytes": 1000, "activation_bytes": 400, "final_acc": 0.9, "best_acc": 0.9,
                   "skipped_steps": 0, "arch": "toy_mlp", "fp8_recipe": "fancy" if prec == "toy" else None}
        results.write_run(runs / name, metrics, {"history": [{"epoch": 1, "train_loss": 1.0, "eval_loss": 1.0,
                                                              "eval_acc": 0.9, "epoch_time_s": 10.0}]}, [step_ms] * 5)
    found = {"model": "toy_mlp", "batch": 4, "input_size": 8, "flops": 1e6, "bytes": 1e6, "conv_flop_share": 0.0,
             "closest_default": "fp32", "gpu": None, "toy": census}
    env = {"torch": "2.x", "cuda_runtime": None, "cudnn": None, "python": "3.11", "cpu_model": "Test CPU",
           "cpu_count": 2, "gpu": None}
    s = report.build(runs, env, tmp_path / "r.md", tmp_path / "s.json", tmp_path / "fig", ["fp32", "toy"],
                     roofline=found)
    md = (tmp_path / "r.md").read_text()
    assert "toy (TOY-HALF)" in verdict_of(md)  # the verdict's headline names it by its label
    assert "toy halves 2 Linear layers (fancy)." in md and "toy runs: `toy` (fancy)." in md
    assert json.loads((tmp_path / "s.json").read_text())["variants"]["toy"]["speedup"] == pytest.approx(3.0)
    assert s["variants"]["toy"]["precision"] == "toy"


def test_a_rung_not_registered_is_refused_with_the_names_that_are():
    from ampbench.errors import ConfigError
    with pytest.raises(ConfigError) as err:
        config.from_dict({"variants": {"x": {"precision": "toy"}}})
    assert "variants.x.precision = 'toy' is not allowed" in str(err.value) and "fp8" in str(err.value)


def test_only_the_registry_names_a_rung():
    """No module outside precision/ branches on a rung's name: it asks the registry."""
    import re
    from pathlib import Path

    import ampbench
    pkg = Path(ampbench.__file__).parent
    hits = [f"{f.relative_to(pkg)}:{i}" for f in pkg.rglob("*.py") if "precision" not in f.relative_to(pkg).parts
            for i, line in enumerate(f.read_text().splitlines(), 1)
            if re.search(r'"fp8"|"mxfp8"|Float8Linear', line)]
    assert not hits, hits


def test_torchao_s_deprecation_note_to_its_authors_is_not_printed_on_every_stage():
    """torchao 0.18 under torch 2.14 logs "<enum 'KernelPreference'> is an Enum subclass ..." at its import, on
    every stage that converts a model; ampbench drops that one message and keeps the logger's others."""
    import subprocess
    import sys
    code = ("import ampbench, torchao, logging; "
            "logging.getLogger('torch.utils._pytree').warning('another pytree warning')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "KernelPreference" not in proc.stderr and "another pytree warning" in proc.stderr
