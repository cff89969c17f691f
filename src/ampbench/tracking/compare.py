"""What each precision bought on each machine, from a tracking store that several machines log to.

    ampbench compare                        # the params.yaml experiment, from $MLFLOW_TRACKING_URI or params.yaml's
    ampbench compare --experiment ampbench --out reports/compare

Reads the training runs of an experiment (tag ``stage = train``) and the ratios the report stage put on them
(``Compare/...``). Runs are grouped first by configuration (model, batch, epochs, optimizer, the prepared data
set's digest): machines are compared only within one, and the table says what differs between configurations.
Within a configuration, one row per machine (the GPU or CPU, its driver, torch), one column per variant: its
speedup against strict fp32 on that machine, with a 95% interval (a t-interval over the machine's pipelines
where it ran several times, else the run's own bootstrap interval), and the strict fp32 baseline's img/s.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections import defaultdict
from pathlib import Path

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from ampbench import results
from ampbench.config import MlflowConfig, tracking_uri
from ampbench.measure.stats import mean_ci
from ampbench.tracking import _experiment_id, _metric_value, complete_run, file_key
from ampbench.tracking.runkeys import RETIRED_TAG

# The report's ratios, logged onto each variant's training run. MLflow gives a client no say in the order of
# columns or chart sections: its UI sorts metric names by character code, so an upper-case section comes before
# every lower-case one (eval/, train/, system/, the run's own figures), and the numbers keep the order within it.
COMPARE = {"speedup": "Compare/1_speedup_vs_strict_fp32", "speedup_ci95": "Compare/6_speedup_vs_strict_fp32_ci95",
           "vs_tf32": "Compare/2_speedup_vs_tf32", "mem_ratio": "Compare/3_peak_memory_vs_strict_fp32",
           "activation_ratio": "Compare/4_activation_memory_vs_strict_fp32",
           "acc_diff": "Compare/5_accuracy_diff_vs_strict_fp32_points"}


def comparison_metrics(row: dict) -> dict[str, float]:
    """One variant's ratios from summary.json's row, under ``COMPARE``'s names (the interval as _lo and _hi)."""
    out = {}
    for field, name in COMPARE.items():
        value = row.get(field)
        if field == "speedup_ci95":
            if value and None not in value:
                out[name + "_lo"], out[name + "_hi"] = float(value[0]), float(value[1])
        elif (v := _metric_value(value)) is not None and math.isfinite(v):
            out[name] = v * 100 if field == "acc_diff" else v
    return out


def log_comparison(cfg: MlflowConfig, repo_root: Path, summary_json: Path, runs_dir: Path) -> tuple[str, bool]:
    """Put each variant's ratios (against strict fp32, against tf32) on its own training run, found by its
    metrics file's key. A run not whole in the store yet gets none, and the call then fails naming it (its marker
    stays, and the `ampbench mlflow-sync` that logs the run puts its ratios on it)."""
    summary = json.loads(Path(summary_json).read_text())
    uri = tracking_uri(cfg, repo_root)
    client = MlflowClient(uri)
    exp_id = _experiment_id(client, cfg, uri, repo_root)
    done, missing, now = [], [], int(time.time() * 1000)
    for name, row in summary["variants"].items():
        metrics_file = Path(runs_dir) / name / results.METRICS
        if not metrics_file.is_file():
            continue
        rid = complete_run(client, exp_id, file_key(metrics_file))  # a partial run gets none: the sync redoes it
        wanted = comparison_metrics(row)
        if rid is None and wanted:
            missing.append(f"train@{name}")
        if rid is None or not wanted:
            continue
        have = client.get_run(rid).data.metrics
        new = [Metric(k, v, now, 0) for k, v in wanted.items() if have.get(k) != v]
        if new:
            client.log_batch(rid, metrics=new)
            done.append(name)
    if missing:
        raise LookupError(f"{', '.join(missing)} not in MLflow yet (partial or absent), so without ratios; "
                          f"logged on {', '.join(done) or 'no run'}")
    return (", ".join(done) or "nothing new"), bool(done)
SPEEDUP, LO, HI = COMPARE["speedup"], COMPARE["speedup_ci95"] + "_lo", COMPARE["speedup_ci95"] + "_hi"
CONFIG = ("model.arch", "model.factory", "model.input_size", "train.batch_size", "train.epochs", "train.optimizer",
          "train.lr", "seed")  # with the dataset (name and digest): what must match for machines to be compared


def _machine(tags: dict) -> tuple[str, str, str]:
    """(GPU or CPU, driver, torch) of a run; older runs carry only the environment fingerprint."""
    if "ampbench.machine" in tags:
        return tags["ampbench.machine"], tags.get("ampbench.driver") or "-", tags.get("ampbench.torch") or "-"
    parts = [p.strip() for p in tags.get("env_fingerprint", "unknown").split("|")]
    return parts[0], "-", parts[1].removeprefix("torch ") if len(parts) > 1 else "-"


def _dataset(run) -> str:
    for d in run.inputs.dataset_inputs if run.inputs else []:
        if d.dataset.name.endswith("-train"):
            return f"{d.dataset.name.removesuffix('-train')} ({d.dataset.digest[:8]})"
    return "-"


def collect(client: MlflowClient, experiment_id: str) -> dict:
    """{configuration: {machine: {variant: [run facts]}}} over the experiment's training runs."""
    out: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    token = None
    while True:
        page = client.search_runs([experiment_id], filter_string="tags.stage = 'train'", max_results=1000,
                                  page_token=token)
        for run in page:
            tags, params, m = run.data.tags, run.data.params, run.data.metrics
            if run.info.status != "FINISHED" or "imgs_per_s" not in m or RETIRED_TAG in tags:  # (a duplicate)
                continue
            config = tuple((k, params.get(k, "")) for k in CONFIG) + (("data", _dataset(run)),)
            out[config][_machine(tags)][tags.get("variant", "?")].append({
                "precision": tags.get("precision"), "accum": tags.get("accum_steps"), "speedup": m.get(SPEEDUP),
                "lo": m.get(LO), "hi": m.get(HI), "imgs_per_s": m["imgs_per_s"], "final_acc": m.get("final_acc"),
                "pipeline": tags.get("ampbench.pipeline")})
        token = page.token
        if not token:
            return out


def summarise(runs: list[dict]) -> dict:
    """A variant on one machine: mean speedup, its interval, img/s, how many runs."""
    values = [r["speedup"] for r in runs if r["speedup"] is not None]
    rate = statistics.fmean(r["imgs_per_s"] for r in runs)
    if not values:
        return {"speedup": None, "ci": None, "imgs_per_s": rate, "n": len(runs)}
    mean = statistics.fmean(values)
    if len(values) > 1:
        ci = mean_ci(values)
    else:
        r = runs[0]
        ci = (r["lo"], r["hi"]) if r["lo"] is not None and r["hi"] is not None else None
    return {"speedup": mean, "ci": ci, "imgs_per_s": rate, "n": len(values)}


def differences(configs: list[tuple]) -> list[str]:
    """The settings that differ between configurations (what keeps their machines apart)."""
    keys = [k for k, _ in configs[0]]
    return [k for i, k in enumerate(keys) if len({c[i][1] for c in configs}) > 1]


def table(config: tuple, machines: dict) -> list[str]:
    variants = sorted({v for by_variant in machines.values() for v in by_variant},
                      key=lambda v: (v != "fp32", v))
    head = ["| machine | driver | torch | strict fp32 img/s |"] + [f" {v} |" for v in variants if v != "fp32"]
    lines = ["".join(head), "|---|---|---|---|" + "---|" * (len(variants) - ("fp32" in variants))]
    for (name, driver, torch_version), by_variant in sorted(machines.items()):
        base = summarise(by_variant["fp32"]) if by_variant.get("fp32") else None
        cells = [name, driver, torch_version, f"{base['imgs_per_s']:,.0f}" if base else "-"]
        for v in variants:
            if v == "fp32":
                continue
            s = summarise(by_variant[v]) if by_variant.get(v) else None
            if not s or s["speedup"] is None:
                cells.append("-")
                continue
            ci = f" ({s['ci'][0]:.2f} to {s['ci'][1]:.2f})" if s["ci"] else ""
            cells.append(f"{s['speedup']:.2f}x{ci}" + (f", {s['n']} runs" if s["n"] > 1 else ""))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def figure(groups: dict, path: Path) -> None:
    """Speedup against strict fp32 per variant, a bar per machine with its interval, one panel per configuration."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(groups), 1, figsize=(8, 3.2 * len(groups)), squeeze=False)
    for ax, (config, machines) in zip(axes[:, 0], groups.items(), strict=True):
        variants = sorted({v for by_variant in machines.values() for v in by_variant if v != "fp32"})
        width = 0.8 / max(1, len(machines))
        for i, (machine, by_variant) in enumerate(sorted(machines.items())):
            xs, ys, errs = [], [], [[], []]
            for j, v in enumerate(variants):
                s = summarise(by_variant[v]) if by_variant.get(v) else None
                if not s or s["speedup"] is None:
                    continue
                xs.append(j + i * width)
                ys.append(s["speedup"])
                lo, hi = s["ci"] or (s["speedup"], s["speedup"])
                errs[0].append(max(0.0, s["speedup"] - lo))
                errs[1].append(max(0.0, hi - s["speedup"]))
            ax.bar(xs, ys, width, yerr=errs, capsize=3, label=f"{machine[0]} (driver {machine[1]})")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks([j + width * (len(machines) - 1) / 2 for j in range(len(variants))], variants)
        ax.set_ylabel("speedup vs strict fp32")
        ax.set_title(_config_title(config), fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _config_title(config: tuple) -> str:
    c = dict(config)
    model = c.get("model.factory") or c.get("model.arch")
    return (f"{model}, batch {c.get('train.batch_size')}, {c.get('train.epochs')} epochs, {c.get('train.optimizer')} "
            f"lr {c.get('train.lr')}, seed {c.get('seed')}, data {c.get('data')}")


def report(client: MlflowClient, experiment: str) -> tuple[str, dict]:
    """The markdown page (a table per configuration, what differs between them) and the grouped runs."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return f"No experiment {experiment!r} in this tracking store.\n", {}
    groups = collect(client, exp.experiment_id)
    lines = [f"# What each precision bought, by machine (MLflow experiment {experiment!r})", ""]
    if not groups:
        lines.append("No finished training runs yet.")
        return "\n".join(lines) + "\n", {}
    if len(groups) > 1:
        lines += [f"{len(groups)} configurations, kept apart: they differ in "
                  f"{', '.join(differences(list(groups)))}.", ""]
    for config, machines in groups.items():
        lines += [f"## {_config_title(config)}", "",
                  "Speedup against strict fp32 on the same machine (95% interval; over pipelines where a machine ran "
                  "several, else from the run's step times).", "", *table(config, machines), ""]
    return "\n".join(lines), groups
