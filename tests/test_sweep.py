"""The batch-size sweep: the bisection's exact answer, out-of-memory handling, a CPU sweep end to end."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
import yaml

from ampbench import results, sweep
from ampbench.sandbox import REPO_ROOT


@pytest.mark.parametrize(("start", "limit"), [(32, 700), (1, 1), (1024, 700), (64, 64), (8, 1023), (5, 0)])
def test_largest_batch_is_exact_against_a_fake_allocator(start, limit):
    freed = []

    def attempt(batch):  # an allocator that runs out above ``limit`` images
        if batch > limit:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory: tried {batch}")

    largest, tries, capped = sweep.largest_batch(sweep.fits(attempt, lambda: freed.append(1)), start)
    assert largest == limit and not capped
    assert len(freed) == len(tries)  # memory freed after every attempt, fitting or not
    assert len(tries) <= 2 * (limit.bit_length() + start.bit_length()) + 2  # doubling then bisection, not a scan


def test_only_out_of_memory_means_it_does_not_fit():
    def attempt(batch):
        raise ValueError("a real bug")

    with pytest.raises(ValueError):
        sweep.fits(attempt, lambda: None)(8)


def test_largest_batch_respects_the_ceiling():
    largest, _, capped = sweep.largest_batch(lambda b: True, 16, ceiling=100)
    assert largest == 64 and capped  # a lower bound, not the largest batch


def test_an_edge_error_means_does_not_run_and_a_broken_context_stops_the_search():
    """cuDNN finding no engine or an int32 index limit at a large batch: that batch does not run (the message is
    kept) and the search goes on; an illegal address breaks the CUDA context: the search stops with what it had."""
    notes, freed = [], []

    def attempt(batch):
        if batch > 700:
            raise RuntimeError("cuDNN error: CUDNN_BACKEND_API_FAILED: unable to find an engine to execute this "
                               "computation\nmore detail")
    largest, _, _ = sweep.largest_batch(sweep.fits(attempt, lambda: freed.append(1), notes), 32)
    assert largest == 700 and notes and notes[0].startswith("batch 1024 does not run: cuDNN error")
    assert "more detail" not in notes[0]

    def broken(batch):
        if batch >= 256:
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(sweep.SearchStopped) as stop:
        sweep.largest_batch(sweep.fits(broken, lambda: None), 32)
    assert stop.value.found == 128 and stop.value.batch == 256 and "illegal memory access" in stop.value.message

    def alloc(batch):  # a library's own out-of-memory means "does not fit"
        if batch > 500:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
    assert sweep.largest_batch(sweep.fits(alloc, lambda: None), 32)[0] == 500

    def execution(batch):  # its other errors may leave the context broken: the search stops
        if batch >= 300:
            raise RuntimeError("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED")
    with pytest.raises(sweep.SearchStopped) as stop:
        sweep.largest_batch(sweep.fits(execution, lambda: None), 32)
    assert stop.value.found == 256


def test_the_cuda_search_labels_what_it_found(monkeypatch):
    """measured, a lower bound at the ceiling, or stopped by a CUDA error: never a ceiling called measured."""
    from types import SimpleNamespace

    def bench(limit=None, broken_at=None):
        def try_step(batch):
            if broken_at and batch >= broken_at:
                raise torch.AcceleratorError("CUDA error: unspecified launch failure")
            if limit and batch > limit:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return SimpleNamespace(precision="fp16", try_step=try_step, free=lambda: None, multiple=1)

    found = sweep.search_max(bench(limit=3000), 256, 2**34, "limit")
    assert (found["largest_batch"], found["method"]) == (3000, "measured") and "cuDNN autotuning on" in found["how"]
    capped = sweep.search_max(bench(), 256, 2**34, "limit", ceiling=4096)
    assert (capped["largest_batch"], capped["method"]) == (4096, "lower bound") and "at least" in capped["how"]
    stopped = sweep.search_max(bench(broken_at=2048), 256, 2**34, "limit")
    assert (stopped["largest_batch"], stopped["method"]) == (1024, "stopped")
    assert "unspecified launch failure" in stopped["how"]


def test_the_search_for_a_rung_with_a_micro_batch_rule_tries_only_batches_it_can_run():
    """fp8 on vit_tiny (65 tokens) runs only micro-batches of 16k images on CUDA: a try at another batch raises what
    CUDA's _scaled_mm raises, which is no out-of-memory; the search stays on multiples and finds the largest."""
    from types import SimpleNamespace

    tried = []

    def try_step(batch):
        tried.append(batch)
        if batch % 16:
            raise RuntimeError("Expected trailing dimension of mat1 to be divisible by 16 but got mat1 shape: 192x520")
        if batch > 3000:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    bench = SimpleNamespace(precision="fp8", try_step=try_step, free=lambda: None, multiple=16)
    found = sweep.search_max(bench, 256, 2**34, "limit")
    assert (found["largest_batch"], found["method"]) == (2992, "measured") and found["tries"] == tried
    assert all(b % 16 == 0 for b in tried) and "in multiples of 16 images" in found["how"]
    broken = SimpleNamespace(precision="fp8", try_step=lambda b: (_ for _ in ()).throw(
        torch.AcceleratorError("CUDA error: unspecified launch failure")) if b >= 2048 else None,
        free=lambda: None, multiple=16)
    assert sweep.search_max(broken, 256, 2**34, "limit")["largest_batch"] == 1024  # in images, not units


def _stage(repo, *extra, package=None):
    """The sweep stage in ``repo``; with ``package`` (a copy of the stages and the ampbench source), that copy's
    stage, which runs that copy's code (stages/_here.py)."""
    return subprocess.run([sys.executable, str((package or REPO_ROOT) / "stages" / "sweep.py"), "--params",
                           "params.yaml",
                           "--data", "data/prepared", "--env", "reports/env.json",
                           "--model-source", "reports/model_source.json", "--out", "reports/sweep", *extra],
                          cwd=repo, capture_output=True, text=True, timeout=300)


def _prepare(repo, params):
    """env_check and data in ``repo``, as dvc repro runs them before the sweep."""
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    for script, args in (("env_check.py", ["--env", "reports/env.json", "--plans", "reports/plans",
                                           "--data-source", "reports/data_source.json",
                                           "--model-source", "reports/model_source.json",
                                           "--roofline", "reports/roofline.json"]),
                         ("data.py", ["--out", "data/prepared", "--raw", "data/raw"])):
        proc = subprocess.run([sys.executable, str(REPO_ROOT / "stages" / script), "--params", "params.yaml", *args],
                              cwd=repo, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr


def test_cpu_sweep_writes_points_estimate_and_plots(tmp_path, tiny_params):
    tiny_params["sweep"] = {"batch_sizes": [4, 8, 16], "steps": 2, "precisions": ["fp32", "fp16"]}
    tiny_params["model"]["input_size"] = 0  # the data's 32 px: activations that dwarf the fixed bytes
    _prepare(tmp_path, tiny_params)
    proc = _stage(tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = tmp_path / "reports" / "sweep"
    result = json.loads((out / "sweep.json").read_text())
    assert result["measured_points"] == 6 and result["reused_points"] == 0
    points = {(p["variant"], p["batch_size"]): p for p in result["points"]}
    assert set(points) == {(p, b) for p in ("fp32", "fp16") for b in (4, 8, 16)}
    for p in points.values():
        assert p["imgs_per_s"] > 0 and p["imgs_per_s_p10"] <= p["imgs_per_s"] <= p["imgs_per_s_p90"]
        assert p["activation_bytes"] > 0
    for prec in ("fp32", "fp16"):  # activations grow with the batch: twice the batch, about twice the bytes
        ratio = points[(prec, 16)]["activation_bytes"] / points[(prec, 8)]["activation_bytes"]
        assert 1.9 < ratio < 2.1
    assert points[("fp16", 16)]["activation_bytes"] < 0.75 * points[("fp32", 16)]["activation_bytes"]
    largest = result["largest"]
    assert largest["fp32"]["method"] == largest["fp16"]["method"] == "estimate"  # a CPU does not run out
    assert largest["fp16"]["largest_batch"] > largest["fp32"]["largest_batch"] > 0
    assert (out / "sweep.csv").read_text().splitlines()[0].startswith("variant,batch_size,imgs_per_s")
    before = {p.name: p.read_bytes() for p in (out / "points").iterdir()}

    tiny_params["sweep"]["batch_sizes"] = [4, 8, 12]  # 16 out, 12 in: only 12 is measured again
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny_params))
    proc = _stage(tmp_path)
    assert proc.returncode == 0 and "2 point(s) measured, 4 reused" in proc.stdout, proc.stdout
    after = {p.name: p.read_bytes() for p in (out / "points").iterdir()}
    assert set(after) == {f"{p}-{b}.json" for p in ("fp32", "fp16") for b in (4, 8, 12)}
    assert all(after[n] == before[n] for n in after if n in before)  # reused points are untouched
    assert "as measured before" not in proc.stdout  # new points: the largest batch is found again

    tiny_params["train"]["epochs"] = 3  # the sweep depends on the train section, but not on this
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny_params))
    proc = _stage(tmp_path)
    assert proc.returncode == 0 and "0 point(s) measured, 6 reused" in proc.stdout, proc.stdout
    assert proc.stdout.count("as measured before: its inputs are unchanged") == 2  # no new largest-batch search


def test_disabled_sweep_writes_an_empty_result(tmp_path, tiny_params):
    tiny_params["sweep"] = {"enabled": False}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny_params))
    proc = _stage(tmp_path)
    assert proc.returncode == 0 and "disabled" in proc.stdout
    assert json.loads((tmp_path / "reports" / "sweep" / "sweep.json").read_text()) == {"enabled": False}


def test_the_sweep_cache_follows_the_code_and_the_model_that_ran(tmp_path, tiny_params):
    """A point is reused only while the code that measured it is unchanged: editing the model's source (or any
    module the sweep reaches) remeasures every point; editing the report, or nothing, reuses them all."""
    tiny_params["sweep"] = {"batch_sizes": [4, 8], "steps": 1, "precisions": ["fp32"], "find_max": False}
    _prepare(tmp_path, tiny_params)

    def copy_with(rel: str, package: str):  # the stages and the ampbench source, with one file edited
        root = tmp_path / package
        for part in ("stages", "src/ampbench"):
            shutil.copytree(REPO_ROOT / part, root / part, ignore=shutil.ignore_patterns("__pycache__"))
        with open(root / "src" / "ampbench" / rel, "a") as f:
            f.write("\n# edited\n")
        return root

    def counts(proc):
        assert proc.returncode == 0, proc.stderr[-2000:]
        result = json.loads((tmp_path / "reports" / "sweep" / "sweep.json").read_text())
        return result["measured_points"], result["reused_points"]

    assert counts(_stage(tmp_path)) == (2, 0)
    assert counts(_stage(tmp_path, package=copy_with("report/sections.py", "report_edited"))) == (0, 2)
    model_edited = copy_with("models/cifar.py", "model_edited")
    assert counts(_stage(tmp_path, package=model_edited)) == (2, 0)
    assert counts(_stage(tmp_path, package=model_edited)) == (0, 2)  # nothing changed since


def test_the_sweep_key_covers_what_the_sweep_runs_and_the_users_model():
    from ampbench import config
    src = REPO_ROOT / "src"
    reached = {p.relative_to(src).as_posix() for p in results.source_files(src / "ampbench" / "sweep" / "__init__.py")}
    assert {"ampbench/models/cifar.py", "ampbench/models/vit.py", "ampbench/train/step.py", "ampbench/train/policy.py",
            "ampbench/precision/float8.py", "ampbench/data/batches.py", "ampbench/measure/clock.py"} <= reached
    assert not {p for p in reached if p.startswith(("ampbench/report", "ampbench/tracking"))}
    cfg = config.from_dict({"device": "cpu"})
    args = (cfg, "fp32", 8, {"n": 1}, "cpu", {"model": "small_cnn", "factory_source": ""}, "code1")
    key = sweep.point_key(*args)
    assert sweep.point_key(*args) == key
    assert sweep.point_key(*args[:5], {"model": "small_cnn", "factory_source": "abc"}, "code1") != key  # a factory
    assert sweep.point_key(*args[:6], "code2") != key  # ampbench's code
    no_momentum = config.from_dict({"device": "cpu", "train": {"momentum": 0.0}})  # no buffer: less memory
    assert sweep.point_key(no_momentum, *args[1:]) != key
    scaled = config.from_dict({"device": "cpu", "amp": {"init_scale": 1024}})  # the loss scale: fp16's points alone
    assert sweep.point_key(scaled, *args[1:]) == key
    fp16 = (cfg, "fp16", *args[2:])
    assert sweep.point_key(scaled, *fp16[1:]) != sweep.point_key(*fp16)


def test_a_memory_cap_on_cuda_names_the_device_index(monkeypatch):
    """sweep.memory_limit_gib: torch's set_per_process_memory_fraction (run for real up to the driver call) takes
    a device index, and the stage's device is plain "cuda"."""
    from types import SimpleNamespace

    from ampbench import config
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_lazy_init", lambda: None)
    monkeypatch.setattr(torch._C, "_cuda_setMemoryFraction", lambda frac, index: calls.append((frac, index)),
                        raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=96 * 2**30))
    cfg = config.from_dict({"sweep": {"memory_limit_gib": 24}})
    sweep.cap_memory(cfg, torch.device("cuda"))
    assert calls == [(0.25, 0)]


def test_the_sweep_builds_its_model_as_training_does_with_cudnn_autotuning_on_a_gpu(monkeypatch, tmp_path):
    """The sweep's points are built by the trainer's own builder (train.setup.build), which turns cuDNN's
    autotuner on for a CUDA device, so a sweep point at the training batch measures what training runs."""
    from ampbench import config, data, models
    from ampbench.train import setup
    out = tmp_path / "prepared"
    data.prepare(config.DataConfig(source="synthetic", train_size=32, test_size=8), 0, out, out / "raw")
    prepared = data.load_prepared(out, "cpu")
    built = []
    real_build = setup.build
    monkeypatch.setattr(setup, "build", lambda plan, *a, **kw: built.append(plan) or real_build(plan, *a, **kw))
    cfg = config.from_dict({"device": "cpu", "model": {"arch": "small_cnn"}, "train": {"compile": True}})
    bench = sweep.Bench(cfg, prepared, torch.device("cpu"), "fp16")
    assert [p.precision for p in built] == ["fp16"] and built[0].amp == cfg.amp  # a plan, with the loss scale
    assert built[0].train.compile is False  # each swept batch would compile anew
    assert bench.scaler.is_enabled()

    real_models_build = models.build
    monkeypatch.setattr(models, "build", lambda mcfg, num_classes, image_size, device: real_models_build(
        mcfg, num_classes=num_classes, image_size=image_size, device="cpu"))  # a "cuda" model, built on the CPU
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    real_build(built[0], prepared["meta"], torch.device("cuda"))
    assert torch.backends.cudnn.benchmark is True


def test_a_cpu_sweep_leaves_out_the_points_over_its_budget_and_says_why(tmp_path, tiny_params, capsys):
    """sweep.cpu_point_budget_s: after a point, a larger batch whose expected time (the last point's time per image)
    is over the budget is left out with every larger one of its precision, named in sweep.json and the report; a
    GPU measures every point, and 0 is no limit."""
    from ampbench import config, data
    from ampbench.report import scale, summary

    tiny_params["sweep"] = {"batch_sizes": [16, 8, 4, 32], "steps": 1, "precisions": ["fp32"], "find_max": False,
                            "cpu_point_budget_s": 1e-6}
    prepared = data.synthetic_in_memory(64, 16, 0, "cpu")
    result = sweep.run_sweep(config.from_dict(tiny_params), prepared, torch.device("cpu"), tmp_path, "env", {})
    assert [p["batch_size"] for p in result["points"]] == [4]  # the smallest first, then no more
    assert [(p["precision"], p["batch_size"]) for p in result["left_out"]] == [("fp32", b) for b in (8, 16, 32)]
    assert all("over sweep.cpu_point_budget_s = 1e-06 s on a CPU (batch 4 took" in p["why"]
               for p in result["left_out"])
    assert "[sweep fp32] batch 8: left out, over sweep.cpu_point_budget_s" in capsys.readouterr().out
    lines = scale.sweep(summary.summarize({}, sweep_json=json.loads((tmp_path / "sweep.json").read_text())), {}, {})
    assert sum(line.startswith("Left out: fp32 at batch ") for line in lines) == 3, lines

    budget = sweep.PointBudget(config.from_dict(tiny_params), torch.device("cuda"))
    budget.took({"batch_size": 4, "seconds": 100.0})
    assert budget.over(1024) is None  # a GPU runs every point
    tiny_params["sweep"]["cpu_point_budget_s"] = 20
    budget = sweep.PointBudget(config.from_dict(tiny_params), torch.device("cpu"))
    assert budget.over(32) is None  # nothing measured yet
    budget.took({"batch_size": 32, "seconds": 4.0})
    assert budget.over(64) is None and budget.over(128) is None  # about 8 and 16 s
    assert "batch 256 would take about 32 s" in budget.over(256) and budget.over(512) == budget.over(256)
    tiny_params["sweep"]["cpu_point_budget_s"] = 0
    budget = sweep.PointBudget(config.from_dict(tiny_params), torch.device("cpu"))
    budget.took({"batch_size": 4, "seconds": 100.0})
    assert budget.over(1024) is None  # no limit
