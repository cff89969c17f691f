"""fp8's GEMMs as CUDA takes them, checked on a CPU: each ``torch._scaled_mm`` call of training, the profile, the
sweep and the roofline first runs on meta copies of its operands, and meta tensors apply CUDA's shape and layout
rules (``torch/_meta_registrations.py``: every inner dimension a multiple of 16, row-major by column-major), which a
CPU's own fp8 path does not. The weight's gradient GEMM multiplies over the micro-batch's rows (images x tokens):
env_check refuses a micro-batch CUDA would, naming the fix, and the sweep's search tries only batches fp8 runs."""

from __future__ import annotations

import pytest
import torch

from ampbench import config, data, models, precision, runplan, sweep
from ampbench.config import optim
from ampbench.env import check
from ampbench.errors import ConfigError
from ampbench.measure import opcount
from ampbench.train import runner

FP8 = precision.rung("fp8")


@pytest.fixture
def cuda_rules(monkeypatch):
    """``torch._scaled_mm`` that refuses what CUDA refuses; the shapes of the calls it let through."""
    real = torch._scaled_mm
    calls = []

    def meta(t):
        return t.to("meta") if isinstance(t, torch.Tensor) else t  # strides kept: the layout rule applies too

    def checked(a, b, *args, **kwargs):
        torch.ops.aten._scaled_mm(meta(a), meta(b), *map(meta, args), **{k: meta(v) for k, v in kwargs.items()})
        calls.append((tuple(a.shape), tuple(b.shape)))
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", checked)
    return calls


def _cfg(batch: int, accum: int = 1, recipe: str = "tensorwise", swept: tuple = (), **train) -> config.Config:
    # vit_tiny at 16x16: 16 patches and the class token, 17 rows per image in every converted layer
    return config.from_dict({"device": "cpu", "data": {"source": "synthetic", "train_size": 32, "test_size": 16},
                             "model": {"arch": "vit_tiny", "input_size": 16}, "mlflow": {"enabled": False},
                             "train": {"epochs": 1, "batch_size": batch, "warmup_steps": 1, "eval_batch_size": 24,
                                       **train},
                             "profile": {"steps": 1}, "amp": {"audit_batches": 0},
                             "sweep": {"batch_sizes": list(swept or [batch]), "steps": 1},
                             "variants": {"f": {"precision": "fp8", "recipe": recipe, "accum_steps": accum}}})


def _census(cfg):
    return FP8.census(models.build_meta(cfg.model, num_classes=10, image_size=16), runplan.recipe(cfg, "fp8"), 16)


def test_env_check_refuses_an_fp8_micro_batch_cuda_cannot_run_and_says_so_on_a_cpu():
    found = _census(_cfg(32))
    assert found["rows_per_image"] == [17] and FP8.images_multiple(found, "cuda") == 16
    assert FP8.images_multiple(found, "cpu") == 1  # a CPU's _scaled_mm has no such rule
    cfg = _cfg(48, accum=2)  # micro-batches of 24 images: 24 x 17 = 408 rows
    with pytest.raises(ConfigError) as err:
        FP8.check_batches(found, check.micro_batches(cfg, "fp8"), "cuda")
    said = str(err.value)
    assert "train.batch_size = 48 over variants.f.accum_steps = 2" in said and "24 x 17 = 408 rows" in said
    assert "make that micro-batch a multiple of 16 images" in said and "\n" not in said
    warned = FP8.check_batches(found, check.micro_batches(cfg, "fp8"), "cpu")
    assert len(warned) == 1 and "on a GPU, which would refuse it" in warned[0]
    assert FP8.check_batches(found, check.micro_batches(_cfg(64, accum=2), "fp8"), "cuda") == []
    # the sweep's batch sizes are micro-batches too; rowwise_with_gw_hp runs the weight's gradient in bf16: no rule
    with pytest.raises(ConfigError, match=r"sweep.batch_sizes \(24\)"):
        FP8.check_batches(found, check.micro_batches(_cfg(32, swept=(32, 24)), "fp8"), "cuda")
    hp = _census(_cfg(24, recipe="rowwise_with_gw_hp"))
    assert FP8.check_batches(hp, check.micro_batches(_cfg(24, recipe="rowwise_with_gw_hp"), "fp8"), "cuda") == []


def test_every_fp8_gemm_of_training_the_profile_the_sweep_and_the_roofline_is_one_cuda_runs(tmp_path, cuda_rules):
    cfg = _cfg(32, accum=2)  # tensorwise, micro-batches of 16: 272 rows
    data.prepare(cfg.data, 0, tmp_path, tmp_path / "raw")
    prepared = data.load_prepared(tmp_path, "cpu")
    m = runner.train(runplan.make_plan(cfg, "f", "cpu"), prepared, progress=False).metrics
    trained = len(cuda_rules)
    assert trained and m["profile"]["steps"] == 1 and m["fp8_layers"] == 12
    # the sweep's points at a legal batch, and the roofline's count at the training batch
    bench = sweep.Bench(cfg, prepared, torch.device("cpu"), "fp8")
    bench.run(16, 1)
    assert len(cuda_rules) > trained
    counted = opcount.for_config(cfg, optim.for_count, 32, ("fp8",))
    assert [op for op in counted["ops"]["fp8"] if op.dtype.startswith("float8")]
    # what CUDA refuses, the wrapper refuses: the micro-batch env_check turns away fails in training here
    with pytest.raises(RuntimeError, match="divisible by 16"):
        bench.run(24, 1)
    rowwise = sweep.Bench(_cfg(32, recipe="rowwise"), prepared, torch.device("cpu"), "fp8")  # its scales per row
    before = len(cuda_rules)
    rowwise.run(16, 1)
    assert len(cuda_rules) > before
    with pytest.raises(RuntimeError, match="divisible by 16"):
        rowwise.run(24, 1)
