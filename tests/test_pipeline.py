"""End to end: the real `dvc repro` of the shrunk pipeline in a temporary git + DVC repository."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml
from mlflow.tracking import MlflowClient

from ampbench import results, sandbox, tracking
from tests.conftest import verdict_of

pytestmark = pytest.mark.slow
VARIANTS = ["fp32", "tf32", "amp", "amp_accum"]


def _dvc(repo, *args):
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, env=sandbox.env_with_venv(),
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """Run the shrunk pipeline once for the module's tests; MLflow goes to the repo's own store."""
    import copy

    from tests.conftest import SHRINK
    params = sandbox.merge(copy.deepcopy(yaml.safe_load((sandbox.REPO_ROOT / "params.yaml").read_text())), SHRINK)
    params["mlflow"]["log_model"] = True  # each variant's LoggedModel, checked below
    params["paired"] = {"enabled": True, "rounds": 1, "steps": 1}  # the paired stage, shrunk
    repo = sandbox.create(tmp_path_factory.mktemp("repo"), params)
    mp = pytest.MonkeyPatch()
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)  # use the default: sqlite:///<repo>/mlflow.db
    proc = _dvc(repo, "repro")
    mp.undo()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return repo, proc


def test_every_declared_output_exists(pipeline):
    repo, _ = pipeline
    r = repo / "reports"
    assert json.loads((r / "env.json").read_text())["torch"]
    assert sorted(p.name for p in (r / "plans").iterdir()) == sorted(f"{v}.json" for v in VARIANTS)
    for f in ("train.pt", "test.pt", "meta.json"):
        assert (repo / "data" / "prepared" / f).is_file()
    for v in VARIANTS:
        m = json.loads((r / "runs" / v / "metrics.json").read_text())
        for key in ("variant", "precision", "accum_steps", "epochs", "batch_size", "imgs_per_s", "epoch_time_s",
                    "peak_mem_bytes", "mem_meter", "final_acc", "best_acc", "final_loss", "final_loss_scale",
                    "skipped_steps", "device", "git_commit"):
            assert key in m, key
        assert (r / "runs" / v / "history.csv").read_text().startswith("epoch,")
        undeclared = set(m) - set(results.Metrics.__annotations__)  # the writers keep to the one schema
        assert not undeclared, undeclared
    assert not set(json.loads((r / "env.json").read_text())) - set(results.Env.__annotations__)
    from ampbench.report.summary import COPIED
    assert not set(COPIED) - set(results.Metrics.__annotations__)  # and the report reads what it declares
    md = (r / "report.md").read_text()
    assert all(f"| {v} |" in md for v in VARIANTS)
    summary = json.loads((r / "summary.json").read_text())
    assert set(summary["variants"]) == set(VARIANTS) and summary["variants"]["fp32"]["speedup"] == 1.0
    for fig in ("throughput", "memory", "curves", "loss_scale", "numerics_audit", "profile"):
        assert (r / "figures" / f"{fig}.png").is_file(), fig
    verdict = verdict_of(md)
    assert verdict.startswith("On this CPU") and "FP16-AMP" in verdict
    _first_screen_answers(md)
    assert "## Numerical safety" in md and "fp16 numerics audit of `amp`" in md
    tf32 = json.loads((r / "runs" / "tf32" / "metrics.json").read_text())
    assert tf32["tf32"]["matmul_fp32_precision"] == "tf32" and "on a CPU tf32 is fp32" in md
    assert "Against each rung of the ladder: tf32 " in verdict and "; amp (fp16) " in verdict
    assert "## Why: the step profile" in md and "| conv/matmul |" in md and "The step profile (amp against fp32" in md
    for v in VARIANTS:  # the profile: in metrics.json, and its trace as a run file
        assert json.loads((r / "runs" / v / "metrics.json").read_text())["profile"]["categories"]["conv/matmul"]
        assert json.loads((r / "runs" / v / "profile_trace.json").read_text())["traceEvents"]
    curves = (r / "curves.csv").read_text().splitlines()
    assert curves[0] == "variant,epoch,eval_acc,train_loss,eval_loss" and len(curves) == 1 + len(VARIANTS)
    # the paired check: fp32, tf32 and amp in turns (amp_accum's accumulation is not in it), beside the stages
    found = json.loads((r / "paired.json").read_text())
    assert set(found["imgs_per_s"]) == {"fp32", "tf32", "amp"} and set(found["vs_fp32"]) == {"tf32", "amp"}
    assert all(len(v) == 1 for v in found["imgs_per_s"].values()) and found["baseline"] == "fp32"
    assert "## Steadiness and the paired check" in md and "| amp | fp16 |" in md
    assert summary["variants"]["amp"]["paired"]["rounds"] == found["vs_fp32"]["amp"]["rounds"]
    assert "8 rounds agreeing are needed" in verdict  # 1 round: measured, no claim
    _headline_metrics(json.loads((r / "metrics.json").read_text()), summary)
    _self_contained_page((r / "report.html").read_text(), len(list((r / "figures").glob("*.png"))))


def _first_screen_answers(md: str) -> None:
    """The title carries the answer; the text before the first table is at most 25 lines, 6 bullets of at most
    30 words, no sentence over 40 words; the summary table has at most 7 columns."""
    import re
    lines = md.splitlines()
    first_table = next(i for i, line in enumerate(lines) if line.startswith("|"))
    assert first_table <= 25, first_table
    assert lines[0].startswith("# FP16-AMP: ") and "than strict FP32" in lines[0] and "CPU: fp16 emulated)" in lines[0]
    bullets = [line for line in lines[:first_table] if line.startswith("- ")]
    assert 4 <= len(bullets) <= 6 and all(len(b.split()) <= 31 for b in bullets), bullets
    text = " ".join(lines[:first_table])
    sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z*`#-])", text)
    assert max(len(x.split()) for x in sentences) <= 40, max(sentences, key=lambda x: len(x.split()))
    assert "estimated" not in text and not re.search(r"\b0\.\d+x", text)  # a ratio below 1 reads "N x slower"
    assert lines[first_table].count("|") - 1 <= 7 and lines[first_table].startswith("| variant |")


def _headline_metrics(metrics: dict, summary: dict) -> None:
    """metrics.json: about ten flat figures per variant, each the summary's own."""
    assert set(metrics) == set(VARIANTS) and all(len(m) <= 11 for m in metrics.values())
    amp = metrics["amp"]
    assert amp["speedup"] == pytest.approx(summary["variants"]["amp"]["speedup"], rel=1e-3)
    assert amp["speedup_lo"] <= amp["speedup"] <= amp["speedup_hi"]
    assert ("steady" in amp) == (summary["variants"]["amp"]["steadiness"] is not None)  # too few steps: not said
    assert amp["paired"] == pytest.approx(summary["variants"]["amp"]["paired"]["median"], rel=1e-3)
    assert "paired" not in metrics["amp_accum"]  # not in the paired check: left out, not 0
    assert set(metrics["fp32"]) <= {"imgs_per_s", "speedup", "vs_tf32", "final_acc", "steady"}  # no ratio to itself
    assert all(not isinstance(v, dict | list) for m in metrics.values() for v in m.values())


def _self_contained_page(page: str, figures: int) -> None:
    """report.html loads nothing: no script, no stylesheet link, every figure a data URI."""
    import re
    assert "<script" not in page and "<link" not in page
    sources = re.findall(r'<img[^>]*src="([^"]*)"', page)
    assert len(sources) == figures >= 6 and all(src.startswith("data:image/png;base64,") for src in sources)
    assert "<table>" in page and page.count("<h2>") >= 10


def test_dvc_metrics_plots_and_lock(pipeline):
    repo, _ = pipeline
    plots = _dvc(repo, "plots", "show", "--json", "accuracy")
    assert plots.returncode == 0, plots.stderr[-2000:]
    assert all(f'"variant": "{v}"' in plots.stdout for v in VARIANTS)
    shown = _dvc(repo, "metrics", "show", "--json")
    assert shown.returncode == 0 and "speedup" in shown.stdout and "final_acc" in shown.stdout
    declared = json.loads(shown.stdout)  # the headline file alone: summary.json's profile and sweep are not metrics
    (files,) = [rev["data"] for rev in declared.values()]
    assert set(files) == {"reports/metrics.json"} and "profile" not in shown.stdout
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    assert {"env_check", "data", "paired", "report", *(f"train@{v}" for v in VARIANTS)} <= set(lock["stages"])
    assert _dvc(repo, "config", "core.analytics").stdout.strip() == "false"  # the sandbox sends DVC nothing


def test_plots_open_offline(pipeline, tmp_path):
    """`dvc plots show` fills the page of report/dvc_template.py: vega inline, nothing from a CDN, every plot."""
    import re

    repo, _ = pipeline
    shown = _dvc(repo, "plots", "show", "-o", str(tmp_path))
    assert shown.returncode == 0, shown.stderr[-2000:]
    page = (tmp_path / "index.html").read_text()
    fetched = re.findall(r"""<(?:script|link)\b[^>]*\b(?:src|href)\s*=\s*["']?(?:https?:)?//[^"'\s>]*""", page, re.I)
    assert not fetched, fetched  # DVC's own page loads vega, vega-lite and vega-embed from cdn.jsdelivr.net
    assert "window.vegaEmbed=" in page and "window.vegaLite=" in page  # the bundle, inline
    plots = [next(iter(p)) for p in yaml.safe_load((repo / "dvc.yaml").read_text())["plots"]]
    plots += [f"reports_runs_{v}_history_csv" for v in VARIANTS]  # each train stage's own plot
    for plot in plots:
        assert f'<div id = "{plot}">' in page, plot


def test_mlflow_has_a_run_per_stage(pipeline):
    repo, _ = pipeline
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    exp = client.get_experiment_by_name("ampbench")
    runs = client.search_runs([exp.experiment_id])
    by_name = {r.info.run_name: r for r in runs}
    assert set(by_name) == {"train@fp32", "train@tf32", "train@amp", "train@amp_accum", "report"}
    amp = by_name["train@amp"]
    assert amp.data.tags["precision"] == "fp16" and amp.data.tags["variant"] == "amp"
    assert amp.data.params["amp.init_scale"] == "8192.0" and "final_acc" in amp.data.metrics
    assert len(client.get_metric_history(amp.info.run_id, "eval/acc")) == 1
    assert {a.path for a in client.list_artifacts(amp.info.run_id)} >= {"metrics.json", "history.csv"}
    assert {"report.md", "report.html", "metrics.json"} <= {a.path for a in client.list_artifacts(
        by_name["report"].info.run_id)}
    for name in ("train@fp32", "train@amp"):  # each variant's trained model: a LoggedModel of its run
        (out,) = by_name[name].outputs.model_outputs
        assert client.get_logged_model(out.model_id).name == name.split("@")[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(base: str, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(base + path, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as response:
        return json.loads(response.read())


def test_mlflow_server_serves_the_runs(pipeline):
    """`mlflow server` on the pipeline's store: the runs, their metrics, tags and artifacts, over the REST API."""
    repo, _ = pipeline
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                               f"sqlite:///{repo / 'mlflow.db'}", "--host", "127.0.0.1", "--port", str(port),
                               "--workers", "1"], cwd=repo, env={**sandbox.env_with_venv(), tracking.JOBS_ENV: "false"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2):
                    break
            except OSError:
                assert server.poll() is None and time.time() < deadline, "mlflow server did not start"
                time.sleep(0.5)
        exp = _api(base, "/api/2.0/mlflow/experiments/get-by-name?experiment_name=ampbench")["experiment"]
        # what MLflow 3's UI reads to show a training experiment (runs, charts), not the GenAI trace overview
        assert {"key": "mlflow.experimentKind", "value": "custom_model_development"} in exp["tags"]
        runs = _api(base, "/api/2.0/mlflow/runs/search", {"experiment_ids": [exp["experiment_id"]]})["runs"]
        by_name = {r["info"]["run_name"]: r for r in runs}
        assert set(by_name) == {"train@fp32", "train@tf32", "train@amp", "train@amp_accum", "report"}
        tags = {name: {t["key"]: t["value"] for t in r["data"]["tags"]} for name, r in by_name.items()}
        assert len({t["ampbench.pipeline"] for t in tags.values()}) == 1  # one pipeline, one shared tag
        metrics = {m["key"] for m in by_name["train@amp"]["data"]["metrics"]}
        assert {"final_acc", "imgs_per_s", "eval/acc", "train/loss", "train/loss_scale_by_step",
                "system/process_rss_bytes"} <= metrics
        # the comparison a user came for, on the training run itself, first in the UI's (character-code) order
        compare = {"Compare/1_speedup_vs_strict_fp32", "Compare/6_speedup_vs_strict_fp32_ci95_lo",
                   "Compare/6_speedup_vs_strict_fp32_ci95_hi", "Compare/2_speedup_vs_tf32",
                   "Compare/3_peak_memory_vs_strict_fp32", "Compare/4_activation_memory_vs_strict_fp32",
                   "Compare/5_accuracy_diff_vs_strict_fp32_points"}
        assert set(sorted(metrics)[:len(compare)]) == compare, sorted(metrics)[:10]
        values = {m["key"]: m["value"] for m in by_name["train@amp"]["data"]["metrics"]}
        row = json.loads((repo / "reports" / "summary.json").read_text())["variants"]["amp"]
        assert values["Compare/1_speedup_vs_strict_fp32"] == pytest.approx(row["speedup"])
        assert values["Compare/5_accuracy_diff_vs_strict_fp32_points"] == pytest.approx(100 * row["acc_diff"])
        fp32 = {m["key"]: m["value"] for m in by_name["train@fp32"]["data"]["metrics"]}
        assert fp32["Compare/1_speedup_vs_strict_fp32"] == 1.0
        for name, wanted in (("train@amp", {"metrics.json", "history.csv", "profile_trace.json"}),
                             ("report", {"report.md", "summary.json", "figures"})):
            rid = by_name[name]["info"]["run_id"]
            files = _api(base, f"/api/2.0/mlflow/artifacts/list?run_id={rid}")["files"]
            assert wanted <= {f["path"] for f in files}, files
        figs = _api(base, f"/api/2.0/mlflow/artifacts/list?run_id={by_name['report']['info']['run_id']}"
                          "&path=figures")["files"]
        drawn = json.loads((repo / "reports" / "summary.json").read_text())["figures"]  # what the report wrote
        assert {"figures/throughput.png", "figures/curves.png"} <= set(drawn)
        assert {f["path"] for f in figs} == set(drawn)  # those very files, logged, not drawn again
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_editing_the_loss_scale_and_the_batch_list_reruns_only_what_reads_them(pipeline):
    """One edit of each: the loss scale reruns the fp16 stages alone (fp32 and tf32 keep their results) and the
    sweep's fp16 points; the new batch size adds its points; every other point is reused, byte for byte."""
    repo, first = pipeline
    assert "Running stage 'sweep'" in first.stdout
    sweep_dir = repo / "reports" / "sweep"
    assert "## Batch-size sweep" in (repo / "reports" / "report.md").read_text()
    assert (repo / "reports" / "figures" / "sweep_throughput.png").is_file()
    before = {p.name: p.read_bytes() for p in (sweep_dir / "points").iterdir()}
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["amp"]["init_scale"] = 1024
    params["sweep"]["batch_sizes"] = [8, 16, 24]
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    fp32_before = (repo / "reports" / "runs" / "fp32" / "metrics.json").read_text()
    proc = _dvc(repo, "repro")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Running stage 'train@amp'" in proc.stdout and "Running stage 'train@amp_accum'" in proc.stdout
    assert "Running stage 'train@fp32'" not in proc.stdout and "Running stage 'data'" not in proc.stdout
    assert "Running stage 'train@tf32'" not in proc.stdout
    assert (repo / "reports" / "runs" / "fp32" / "metrics.json").read_text() == fp32_before
    assert json.loads((repo / "reports" / "runs" / "amp" / "metrics.json").read_text())["final_loss_scale"] == 1024
    # the sweep: fp16's two points again (the loss scale is theirs), batch 24 for each precision, fp32's and
    # tf32's points reused as they were
    assert "Running stage 'sweep'" in proc.stdout and "5 point(s) measured, 4 reused" in proc.stdout
    after = {p.name: p.read_bytes() for p in (sweep_dir / "points").iterdir()}
    kept = {n for n in before if not n.startswith("fp16-")}
    assert {n: after[n] for n in kept} == {n: before[n] for n in kept} and len(kept) == 4
    assert {"fp32-24.json", "tf32-24.json", "fp16-24.json"} <= set(after)
    plots = _dvc(repo, "plots", "show", "--json", "sweep_throughput")
    assert plots.returncode == 0 and '"imgs_per_s"' in plots.stdout and '"variant": "fp16"' in plots.stdout


def test_bad_params_stop_dvc_repro_and_change_nothing(pipeline):
    repo, _ = pipeline
    good = (repo / "params.yaml").read_text()
    snapshot = {p: p.read_bytes() for p in (repo / "reports").rglob("*") if p.is_file()}
    (repo / "params.yaml").write_text(good.replace("batch_size: 32", "batch_size: 30"))
    try:
        proc = _dvc(repo, "repro")
    finally:
        (repo / "params.yaml").write_text(good)
    assert proc.returncode != 0
    assert "does not divide train.batch_size = 30" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr + proc.stdout
    assert {p: p.read_bytes() for p in (repo / "reports").rglob("*") if p.is_file()} == snapshot


FACTORY = """
from torch import nn

WIDTH = {width}


def build(num_classes):
    return nn.Sequential(nn.Conv2d(3, WIDTH, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(WIDTH, num_classes))
"""


def test_a_custom_factory_reruns_the_train_stages_when_its_file_changes(tmp_path_factory):
    import copy

    from tests.conftest import SHRINK
    params = sandbox.merge(copy.deepcopy(yaml.safe_load((sandbox.REPO_ROOT / "params.yaml").read_text())), SHRINK)
    params["model"]["factory"] = "mymodels.net:build"
    params["variants"] = {"fp32": {"precision": "fp32", "accum_steps": 1}}  # every train@ stage has the same deps
    params["mlflow"]["enabled"] = False
    params["amp"]["audit_batches"] = 0
    params["profile"]["steps"] = 0  # lean: the rerun is the subject
    params["sweep"]["batch_sizes"] = [8]
    repo = tmp_path_factory.mktemp("factory")
    (repo / "mymodels").mkdir()
    (repo / "mymodels" / "__init__.py").write_text("")
    (repo / "mymodels" / "net.py").write_text(FACTORY.format(width=8))
    sandbox.create(repo, params)

    first = _dvc(repo, "repro")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "Running stage 'train@fp32'" in first.stdout
    m = json.loads((repo / "reports" / "runs" / "fp32" / "metrics.json").read_text())
    assert m["model"] == "mymodels.net:build" and m["param_count"] == 3 * 8 * 9 + 8 + 8 * 10 + 10
    assert "mymodels.net:build" in (repo / "reports" / "report.md").read_text()

    again = _dvc(repo, "repro")
    assert again.returncode == 0 and "Running stage 'train@" not in again.stdout  # nothing changed: nothing reruns
    assert "Running stage 'sweep'" not in again.stdout

    (repo / "mymodels" / "net.py").write_text(FACTORY.format(width=12))
    edited = _dvc(repo, "repro")
    assert edited.returncode == 0, edited.stderr[-2000:]
    assert "Running stage 'train@fp32'" in edited.stdout
    assert "Running stage 'data'" not in edited.stdout
    # the sweep measured the old model: it reruns, and none of its points is reused
    assert "Running stage 'sweep'" in edited.stdout and "1 point(s) measured, 0 reused" in edited.stdout
    m = json.loads((repo / "reports" / "runs" / "fp32" / "metrics.json").read_text())
    assert m["param_count"] == 3 * 12 * 9 + 12 + 12 * 10 + 10
