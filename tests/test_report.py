"""The report: ratios from known run files, missing values shown as missing, only listed variants."""

from __future__ import annotations

import json

import pytest

from ampbench import report, results
from tests.conftest import verdict_of

ENV = {"torch": "2.x", "cuda_runtime": None, "cudnn": None, "python": "3.11", "cpu_model": "Test CPU",
       "cpu_count": 2, "gpu": None}


def _write(runs, name, precision, accum, step_ms, mem, act, acc):
    metrics = {"variant": name, "precision": precision, "accum_steps": accum, "batch_size": 256, "epochs": 1,
               "imgs_per_s": 256 / step_ms * 1000, "epoch_time_s": 10.0,
               "step_time_ms": {"median": step_ms, "p10": step_ms * 0.9, "p90": step_ms * 1.1, "n": 5},
               "imgs_per_s_p10_p90": [256 / (step_ms * 1.1) * 1000, 256 / (step_ms * 0.9) * 1000],
               "peak_mem_bytes": mem, "activation_bytes": act, "final_acc": acc, "best_acc": acc,
               "skipped_steps": 0, "tf32": {"matmul_fp32_precision": "ieee"}, "arch": "resnet18"}
    history = [{"epoch": 1, "train_loss": 1.0, "eval_loss": 1.0, "eval_acc": acc, "epoch_time_s": 10.0}]
    results.write_run(runs / name, metrics, {"history": history}, [step_ms] * 5)


@pytest.fixture
def runs(tmp_path):
    runs = tmp_path / "runs"
    _write(runs, "fp32", "fp32", 1, 300.0, 1000, 400, 0.90)
    _write(runs, "amp", "fp16", 1, 100.0, 600, 200, 0.89)
    _write(runs, "removed", "fp16", 1, 1.0, 1, 1, 0.1)  # a variant no longer in params.yaml
    return runs


def test_summary_ratios(runs, tmp_path):
    s = report.build(runs, ENV, tmp_path / "report.md", tmp_path / "summary.json", tmp_path / "fig",
                     ["fp32", "amp"])
    assert list(s["variants"]) == ["fp32", "amp"] and s["baseline"] == "fp32"
    amp = s["variants"]["amp"]
    assert amp["speedup"] == pytest.approx(3.0) and amp["speedup_ci95"] == [pytest.approx(3.0)] * 2
    assert amp["mem_ratio"] == pytest.approx(0.6) and amp["activation_ratio"] == pytest.approx(0.5)
    assert amp["acc_diff"] == pytest.approx(-0.01)
    assert json.loads((tmp_path / "summary.json").read_text()) == json.loads(json.dumps(s))
    md = (tmp_path / "report.md").read_text()
    assert "| amp | fp16 | 1 | 2,560 (2,327 to 2,844) | 3.00x (3.00 to 3.00) |" in md
    assert "bootstrap over one run's step times" in md
    assert "-40%" in md and "-1.00 pts" in md and "removed" not in md
    assert "quoted, not measured here" in md and "3.2x" in md
    assert (tmp_path / "fig" / "throughput.png").stat().st_size > 1000
    assert "figures" not in md or "](fig/throughput.png)" in md


def test_every_variant_is_set_against_strict_fp32_and_tf32(runs, tmp_path):
    _write(runs, "tf32", "tf32", 1, 200.0, 1000, 400, 0.90)
    s = report.build(runs, ENV, tmp_path / "r.md", tmp_path / "s.json", tmp_path / "fig", ["fp32", "tf32", "amp"])
    assert s["tf32_baseline"] == "tf32" and "vs_tf32" not in s["variants"]["tf32"]
    assert s["variants"]["amp"]["vs_tf32"] == pytest.approx(2.0) and s["variants"]["fp32"]["vs_tf32"] == pytest.approx(
        2 / 3)
    md = (tmp_path / "r.md").read_text()
    verdict = verdict_of(md)
    assert "tf32 1.50x faster than strict fp32; amp (fp16) 3.00x faster than strict fp32, 2.00x faster than " \
           "TF32" in verdict
    assert "on a CPU tf32 is fp32" in verdict
    assert "| amp | fp16 | 1 | 2,560 (2,327 to 2,844) | 3.00x (3.00 to 3.00) | 2.00x |" in md
    gpu_env = {**ENV, "gpu": {"name": "NVIDIA H200", "capability": "9.0", "tensor_cores": True,
                              "bf16_supported": True}}
    report.build(runs, gpu_env, tmp_path / "g.md", tmp_path / "g.json", tmp_path / "fig", ["fp32", "tf32", "amp"])
    assert "on a CPU" not in verdict_of((tmp_path / "g.md").read_text())


def test_missing_values_are_shown_as_missing(runs, tmp_path):
    m = json.loads((runs / "amp" / "metrics.json").read_text())
    m["peak_mem_bytes"] = None
    results.write_json(runs / "amp" / "metrics.json", m)
    s = report.build(runs, ENV, tmp_path / "r.md", tmp_path / "s.json", tmp_path / "fig", ["fp32", "amp"])
    assert s["variants"]["amp"]["mem_ratio"] is None
    assert "| missing | n/a |" in (tmp_path / "r.md").read_text()


def test_a_variant_without_a_run_is_named_as_missing(runs, tmp_path):
    s = report.build(runs, ENV, tmp_path / "r.md", tmp_path / "s.json", tmp_path / "fig", ["fp32", "amp", "bf16"])
    assert s["missing"] == ["bf16"] and "bf16" not in s["variants"]
    assert "No finished run for: bf16 (missing, not estimated)." in (tmp_path / "r.md").read_text()


def test_no_fp32_variant_means_no_ratios(runs, tmp_path):
    s = report.build(runs, ENV, tmp_path / "r.md", tmp_path / "s.json", tmp_path / "fig", ["amp"])
    assert s["baseline"] is None and "speedup" not in s["variants"]["amp"]
    assert "no fp32 variant" in (tmp_path / "r.md").read_text().lower()


def test_speedup_interval_from_repeats(runs, tmp_path):
    for name, ips in (("fp32", [1000.0, 1100.0, 900.0]), ("amp", [3000.0, 3100.0, 2900.0])):
        m = json.loads((runs / name / "metrics.json").read_text())
        m["imgs_per_s_runs"], m["repeats"] = ips, 3
        results.write_json(runs / name / "metrics.json", m)
    s = report.build(runs, ENV, tmp_path / "r.md", tmp_path / "s.json", tmp_path / "fig", ["fp32", "amp"])
    amp = s["variants"]["amp"]
    assert amp["speedup"] == pytest.approx(3.0) and "repeats (3 vs 3)" in amp["speedup_ci_method"]
    lo, hi = amp["speedup_ci95"]
    assert 2.0 < lo < 3.0 < hi < 4.0


ROOFLINE = {"model": "resnet18", "batch": 256, "input_size": 32, "flops": 852.2e9, "bytes": 11.77e9,
            "conv_flop_share": 0.9999, "closest_default": "tf32", "gpu": None,
            "article": {"gpu": "RTX 5090", "model": "resnet18", "batch": 256, "fp16_vs_fp32": 1.92}}


def test_the_roofline_sits_beside_the_measured_speedups(runs, tmp_path):
    _write(runs, "tf32", "tf32", 1, 200.0, 1000, 400, 0.90)
    def bound(step_ms, vs_fp32, share):
        return {"step_ms": step_ms, "imgs_per_s": 256 / step_ms * 1000, "vs_fp32": vs_fp32, "vs_tf32": vs_fp32 / 4,
                "memory_bound_share": share}
    table = {"fp32": bound(50.0, 1.0, 0.1), "tf32": bound(12.5, 4.0, 0.4), "fp16": bound(6.25, 8.0, 0.5), "bf16": None}
    found = {**ROOFLINE, "gpu": {"name": "A100 80GB SXM", "source": "NVIDIA A100 datasheet", "bandwidth_gbps": 2039,
                                 "table": table}}
    gpu_env = {**ENV, "gpu": {"name": "NVIDIA A100-SXM4-80GB", "capability": "8.0", "tensor_cores": True,
                              "bf16_supported": True}}
    s = report.build(runs, gpu_env, tmp_path / "r.md", tmp_path / "s.json", tmp_path / "fig", ["fp32", "tf32", "amp"],
                     roofline=found)
    assert s["roofline"]["measured"]["amp"]["of_roofline"] == pytest.approx(2560 / 40960)
    md = (tmp_path / "r.md").read_text()
    assert "| fp16 | 6.25 ms | 40,960 | 8.00x | 2.00x | 50% | n/a | amp: 3.00x measured, 6% of the roofline's img/s |" \
        in md  # a roofline.json counted before kernels were: their launches n/a
    assert "| bf16 | n/a: no bf16 tensor cores |" in md and "closest to tf32" in md
    assert "gives fp16 1.92x strict fp32" in md and "The article's 3.2x is 1.67x that ratio" in md
    assert "not a bound on a measured ratio" in md and "bound's" not in md and "that bound" not in md
    # the first screen on a GPU: the answer in the title, each bullet short, the headroom from the roofline
    first = md.split("\n|", 1)[0].splitlines()
    assert first[0] == "# FP16-AMP: 3.00x faster than strict FP32 here, -40% memory, -1.00 pts accuracy (not yet " \
                       "a claim)"
    bullets = [line for line in first if line.startswith("- ")]
    assert len(bullets) == 5 and all(len(b.split()) <= 30 for b in bullets)  # no profile here: no "Why"
    assert "- **Headroom**: the roofline allows fp16 8.00x strict FP32 on A100 80GB SXM; `amp` reached 6% of its " \
           "roofline img/s." in bullets
    assert "**Next**: set `paired.rounds: 8` (or `train.repeats: 3`)" in md  # one run each: no claim yet
    # a step whose launches outlast its kernels: launch-bound, in the table and the verdict
    table["fp16"].update(step_ms=8.0, kernels_ms=6.25, launch_ms=8.0, kernels=2000, launch_bound=True)
    amp = json.loads((runs / "amp" / "metrics.json").read_text())
    (runs / "amp" / "metrics.json").write_text(json.dumps({**amp, "profile": {"host_ms_per_step": 9.5}}))
    report.build(runs, gpu_env, tmp_path / "r.md", tmp_path / "s.json", tmp_path / "fig", ["fp32", "tf32", "amp"],
                 roofline={**found, "launch_us": 4.0})
    md = (tmp_path / "r.md").read_text()
    assert "`amp` is launch-bound here: launching its 2,000 kernels one by one takes at least 8 ms a step. Its step " \
           "profile measured the host's work in a step" in md and "at 9.5 ms, 1.19x that floor." in md
    assert "| fp16 | 8 ms **launch-bound** |" in md and "| 2,000, 8 ms |" in md and "(4 us each" in md
    assert "its step is launch-bound: 2,000 kernels launched one by one take 8 ms, longer than the 6.25 ms" \
        in verdict_of(md)


def _every_section_fixture(runs):
    """Runs that give every section something to say: a profile, an fp16 audit, DDP with a one-process twin."""
    for name, casts_ms in (("fp32", 1.0), ("amp", 2.0)):
        m = json.loads((runs / name / "metrics.json").read_text())
        m.update(gpu_sm_clock_mhz_median=1980.0 if name == "fp32" else 1800.0, gpu_temperature_c_median=60.0,
                 gpu_power_w_median=600.0, energy_per_image_j=600.0 / m["imgs_per_s"],
                 started_at="2026-12-03T10:00:00+00:00" if name == "amp" else "2026-12-03T11:00:00+00:00")
        m["profile"] = {"steps": 3, "basis": "CPU time of each op", "wall_ms_per_step": 10.0, "cost_s": 1.0,
                        "categories": {"conv/matmul": {"ms_per_step": 6.0, "share": 0.6, "dtypes": "fp32 100%"},
                                       "casts": {"ms_per_step": casts_ms, "share": 0.1, "dtypes": None}},
                        "category_order": ["conv/matmul", "casts"],
                        "category_roles": {"conv/matmul": "tensor_core", "casts": "precision_overhead"}}
        results.write_json(runs / name / "metrics.json", m)
    audit = [{"layer": "conv1", "type": "Conv2d", "autocast_dtype": "fp16", "grad_underflow": 0.1,
              "grad_scaled_underflow": 0.0, "grad_subnormal": 0.2, "grad_scaled_overflow": 0.0, "act_overflow": 0.0}]
    run = results.read_run(runs / "amp")
    run["metrics"]["final_loss_scale"] = 8192.0
    results.write_run(runs / "amp", run["metrics"], {"history": run["history"], "numerics": audit,
                                                     "scale": [{"step": 0, "scale": 8192.0, "skipped": False}]},
                      run["step_times_ms"])
    _write(runs, "fp32_ddp", "fp32", 1, 200.0, 1000, 400, 0.90)
    m = json.loads((runs / "fp32_ddp" / "metrics.json").read_text())
    m.update(world_size=2, backend="gloo", grad_comm="none")  # 1,280 img/s against fp32's 853
    results.write_json(runs / "fp32_ddp" / "metrics.json", m)
    points = [{"variant": p, "batch_size": b, "imgs_per_s": 100.0 * b, "imgs_per_s_p10": 90.0 * b,
               "imgs_per_s_p90": 110.0 * b, "activation_bytes": (2 if p == "fp32" else 1) * 1000 * b}
              for p in ("fp32", "fp16") for b in (32, 64)]
    largest = {p: {"largest_batch": n, "method": "estimate", "how": "bytes per image", "limit_bytes": 2 ** 30,
                   "limit": "device memory"} for p, n in (("fp32", 512), ("fp16", 1024))}
    return {"enabled": True, "device": "cpu", "steps": 3, "warmup": 2, "points": points, "precisions": ["fp32", "fp16"],
            "largest": largest, "reused_points": 0, "measured_points": 4}


def test_every_section_is_rendered_from_run_folders(runs, tmp_path):
    from ampbench.report import sections
    sweep = _every_section_fixture(runs)
    variants = ["fp32", "amp", "fp32_ddp"]
    s = report.build(runs, ENV, tmp_path / "r.md", tmp_path / "s.json", tmp_path / "fig", variants,
                     {"train.epochs": 1}, target_acc=0.5, sweep=sweep, roofline=ROOFLINE)
    md = (tmp_path / "r.md").read_text()
    read = results.read_runs(runs)
    for section in sections.SECTIONS:  # every section writes something from these runs
        lines = section(s, ENV, {n: read[n] for n in variants})
        assert lines and "\n".join(lines) in md, section.__name__
    headings = [line for line in md.splitlines() if line.startswith("#")]
    assert headings == ["# FP16-AMP: 3.00x faster than strict FP32 here (not yet a claim; CPU: fp16 emulated)",
                        "## The verdict in full", "## Results (measured in this run)",
                        "## Steadiness and the paired check", "## What the datasheet allows: the roofline",
                        "## Why: the step profile", "## Ours beside the article's", "## Memory, meter by meter",
                        "## Batch-size sweep", "## Past one process: data-parallel training (DDP)",
                        "## GPU clock, temperature and energy", "## Numerical safety", "## Figures",
                        "## Environment", "## Reproduce"]
    verdict = verdict_of(md)
    assert "In the batch-size sweep, fp16 fits 2.00x the batch of fp32" in verdict
    assert "fp32_ddp ran 1.50x as fast as in one process, 75% scaling efficiency" in verdict
    assert "amp added 1 ms of casts per step" in verdict and md.count("amp added 1 ms of casts") == 1  # once
    assert "Training time to 50.0% evaluation accuracy" in md and "`train.epochs: 1`" in md
    assert "| amp | 1 of 2 | 1,800 MHz | -9% | 60 C | 600 W | 0.234 J | 0.33x |" in md  # amp ran first
    assert "The median SM clock of `amp` differs by more than 5%" in md and "SM clock -9% against fp32's" in verdict
    assert "fp16 numerics audit of `amp`" in md and "`conv1` (Conv2d, runs in fp16): 10.00%" in md
    figs = {"throughput", "memory", "curves", "loss_scale", "numerics_audit", "profile", "sweep_throughput",
            "sweep_memory"}
    assert s["figures"] == [f"fig/{f}.png" for f in ("throughput", "memory", "curves", "loss_scale",
                                                     "numerics_audit", "profile", "sweep_throughput", "sweep_memory")]
    assert {p.stem for p in (tmp_path / "fig").iterdir()} == figs
    assert all(f"]({f})" in md for f in s["figures"])


def test_the_report_imports_no_training_code():
    import subprocess
    import sys
    code = ("import sys, ampbench.report, ampbench.report.figures; "
            "print(sorted(m for m in sys.modules if m.startswith(('ampbench.train', 'ampbench.measure.clock', "
            "'ampbench.measure.memory', 'ampbench.models', 'ampbench.data', 'torch'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_new_run_table_is_one_registry_line_its_rows_and_a_section(runs, tmp_path, monkeypatch):
    """The change-walk of a report section over a new per-run file: a line in ``results.TABLES``, the rows in a
    run result (``RunResult.extra``), and a section function in ``SECTIONS``; nothing else is touched."""
    from ampbench.report import sections
    from ampbench.train.metrics import RunResult
    monkeypatch.setitem(results.TABLES, "lr_probe", results.Table("lr_probe.csv", ("step", "lr")))
    result = RunResult(metrics=results.read_run(runs / "amp")["metrics"], history=[{"epoch": 1}],
                       extra={"lr_probe": [{"step": 1, "lr": 0.1}, {"step": 2, "lr": 0.05}]})
    results.write_run(runs / "amp", result.metrics, result.tables(), [100.0] * 5)
    assert (runs / "amp" / "lr_probe.csv").read_text() == "step,lr\n1,0.1\n2,0.05\n"
    assert (runs / "fp32" / "lr_probe.csv").exists() is False  # written before the table existed: read as []

    def lr_probe(summary, env, runs_read):
        rows = runs_read["amp"]["lr_probe"]
        return ["## LR probe", "", f"amp: {len(rows)} steps, last lr {rows[-1]['lr']}", ""]
    monkeypatch.setattr(sections, "SECTIONS", (*sections.SECTIONS, lr_probe))
    report.build(runs, ENV, tmp_path / "r.md", tmp_path / "s.json", tmp_path / "fig", ["fp32", "amp"])
    assert "## LR probe\n\namp: 2 steps, last lr 0.05" in (tmp_path / "r.md").read_text()
    assert results.read_run(runs / "fp32")["lr_probe"] == []
    with pytest.raises(ValueError, match=r"no run table is called \['lr_probes'\]; add it to results.TABLES"):
        results.write_run(tmp_path / "x", {}, {"lr_probes": []})


def test_the_report_page_embeds_its_figures_and_shows_text_as_written(tmp_path):
    """report.html: a figure beside report.md becomes a data URI; one that is missing is said, not linked; text
    such as an error's ``<lambda>`` or ``a<b`` is shown as written, never read as a tag or a script."""
    from ampbench.report import page
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "throughput.png").write_bytes(b"\x89PNG\r\n")
    md = ("# T\n\nfailed in <lambda>: a<b and c>d <script>x()</script>\n\n![throughput](figures/throughput.png)\n\n"
          "![curves](figures/curves.png)\n\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    html = page.render(md, tmp_path)
    assert "failed in &lt;lambda&gt;: a&lt;b and c&gt;d &lt;script&gt;" in html and "<script" not in html
    assert '<img alt="throughput" src="data:image/png;base64,iVBORw0K">' in html
    assert "[curves: not found]" in html and "figures/curves.png" not in html and "<table>" in html
