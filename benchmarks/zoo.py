"""The torchvision zoo as a conformance suite: `ampbench check-model` over every classification model.

    python benchmarks/zoo.py                         # all of torchvision.models.list_models(): zoo.md and zoo.csv
    python benchmarks/zoo.py --models resnet50,vit_b_16 --out /tmp/zoo

Each model is checked as a user's `model.arch: tv:<name>` would be, with the committed params.yaml (CIFAR-10,
32x32, batch 256), at every precision: built (on meta tensors), the input size it takes found, its training step
counted for the roofline (ratios of fp16 and bf16 against strict fp32 and tf32 on an RTX 5090 and an H100 SXM),
what fp8 and mxfp8 convert listed and each checked against the unconverted model (conformance: logits within its
tolerance, every gradient there, the dtypes its casts take), and one optimizer step per precision run on the CPU
at a batch of two images, at the data's size or the smallest the model takes. A model's CPU steps are skipped when
it has more than ``--max-params`` parameters, and the precisions after fp32 when fp32's step took longer than
``--step-budget`` seconds; each skip is named in its row. Models run one after another, each in a process forked
for it: one that fails (or runs out of memory) is a row, never a stopped run.
"""

from __future__ import annotations

import argparse
import csv
import io
import multiprocessing
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import torch
import torchvision

from ampbench import config, models
from ampbench.errors import first_line
from ampbench.sandbox import REPO_ROOT
from ampbench.train import conformance

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")
FINE_TUNE = ("fp32", "fp16")  # stepped again with the backbone frozen: the fine-tune column
CONVERTING = ("fp8", "mxfp8")  # checked against the unconverted model where they convert a layer: conformance
RATIO_KEYS = [(gpu, f"{p}_vs_{ref}") for gpu in conformance.ZOO_GPUS for p in ("fp16", "bf16")
              for ref in ("fp32", "tf32")]
COLUMNS = (["model", "params_m", "input_size", "input_fix", "gflop_per_image", "fp8_layers", "fp8_flop_share",
            "activation_meter"]
           + [f"{gpu.replace(' ', '_')}_{key}" for gpu, key in RATIO_KEYS]
           + [f"{gpu.replace(' ', '_')}_launch_bound" for gpu in conformance.ZOO_GPUS] + list(PRECISIONS)
           + [f"{p}_why" for p in PRECISIONS] + [f"finetune_{p}" for p in FINE_TUNE]
           + [f"finetune_{p}_why" for p in FINE_TUNE] + [f"conformance_{p}" for p in CONVERTING]
           + [f"conformance_{p}_why" for p in CONVERTING] + ["roofline_why", "seconds"])


def check_one(name: str, params: dict, max_params: float, step_budget: float) -> dict:
    """One model's row: what check_model found, flattened for the table."""
    raw = {**params, "model": {**(params.get("model") or {}), "arch": f"tv:{name}", "factory": ""}}
    cfg = config.from_dict(raw)
    t0 = time.perf_counter()
    result = conformance.check_model(cfg, precisions=PRECISIONS, device="cpu", step_budget_s=step_budget,
                                     max_params=max_params, fine_tune=FINE_TUNE)
    rows = {r["check"]: r for r in result["rows"]}
    out = {"model": name, "params_m": result["params"] / 1e6, "input_size": result["input_size"],
           "input_fix": "" if rows["input size"]["ok"] else rows["input size"]["detail"],
           "gflop_per_image": (rows["roofline"].get("flops_per_image") or 0) / 1e9 or None,
           "fp8_layers": rows["fp8 converts"].get("layers"), "fp8_flop_share": rows["fp8 converts"].get("flop_share"),
           "seconds": time.perf_counter() - t0}
    ratios = rows["roofline"].get("ratios") or {}
    for gpu, key in RATIO_KEYS:
        out[f"{gpu.replace(' ', '_')}_{key}"] = (ratios.get(gpu) or {}).get(key)
    for gpu in conformance.ZOO_GPUS:  # the precisions whose step its kernel launches bound there
        out[f"{gpu.replace(' ', '_')}_launch_bound"] = " ".join((ratios.get(gpu) or {}).get("launch_bound") or [])
    if "flops_per_image" not in rows["roofline"]:
        out["roofline_why"] = rows["roofline"]["detail"]
    for p in PRECISIONS:
        r = rows[f"step {p}"]
        out[p] = {True: "pass", False: "FAIL", None: "skipped"}[r["ok"]]
        out[f"{p}_why"] = "" if r["ok"] else r["detail"]
    for p in FINE_TUNE:
        r = rows[f"fine-tune {p}"]
        out[f"finetune_{p}"] = {True: "pass", False: "FAIL", None: "skipped"}[r["ok"]]
        out[f"finetune_{p}_why"] = "" if r["ok"] else r["detail"]
    for p in CONVERTING:  # no row: the rung converts no layer of this model
        r = rows.get(f"{p} conformance") or {"ok": None, "detail": "converts no layer"}
        out[f"conformance_{p}"] = {True: "pass", False: "FAIL", None: "-"}[r["ok"]]
        out[f"conformance_{p}_why"] = r["detail"] if r["ok"] is not True else ""
    stepped = [rows[f"step {p}"] for p in PRECISIONS if rows[f"step {p}"]["ok"]]
    # the activation meter after each step that ran (at two images the fp16 casts of the weights outweigh the
    # activations, so its bytes say nothing of fp16's saving here: only that the meter follows the model)
    out["activation_meter"] = ("not stepped" if not stepped else "measured" if all(
        r.get("activation_bytes") for r in stepped) else "FAIL")
    return out


def _num(v, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def page(rows: list[dict], took_s: float, argv: list[str]) -> str:
    """zoo.md: the summary (how many pass each column, and which do not), then a row per model."""
    n = len(rows)
    cpu = platform.processor() or platform.machine()
    lines = ["# The torchvision zoo through ampbench", "",
             f"`python benchmarks/{' '.join(['zoo.py', *argv])}`: {n} models of torchvision {torchvision.__version__} "
             f"(`torchvision.models.list_models(module=torchvision.models)`), torch {torch.__version__}, on a CPU "
             f"({cpu}, {torch.get_num_threads()} threads), in {took_s / 60:.1f} minutes. Data: CIFAR-10's shape "
             "(32x32, 10 classes) with the committed params.yaml; steps at a batch of 2 on the CPU (fp16 and fp8 "
             "emulated there: they show that the step runs, not its speed). Roofline ratios at batch 256, counted "
             "on meta tensors: each precision's step (the longer of its kernels at their datasheet peaks and their "
             "launches, one by one; L: launch-bound), against strict "
             "fp32 and against tf32.", "", "## Summary", ""]
    unchecked = [r for r in rows if r.get("not_checked")]
    needs_size = [r for r in rows if r["input_fix"] and not r.get("not_checked")]
    counted = [r for r in rows if r["gflop_per_image"]]
    lines.append(f"- built and sized: {n - len(unchecked)} of {n}"
                 + "".join(f"; not {r['model']}: {r['not_checked']}" for r in unchecked)
                 + f"; {n - len(unchecked) - len(needs_size)} take 32x32 as they are, {len(needs_size)} need "
                 "`model.input_size` (env_check names the size): "
                 + ", ".join(f"{r['model']} ({r['input_fix'].split(' (')[0]})" for r in needs_size))
    lines.append(f"- roofline counted: {len(counted)} of {n}"
                 + "".join(f"; not {r['model']}: {r.get('roofline_why')}" for r in rows if not r["gflop_per_image"]))
    lines.append(f"- fp8 converts at least one layer in {sum(bool(r['fp8_layers']) for r in rows)} of {n} "
                 "(the rest would measure bf16)")
    metered = [r["model"] for r in rows if r.get("activation_meter") == "measured"]
    unmetered = [r["model"] for r in rows if r.get("activation_meter") == "FAIL"]
    lines.append(f"- activation meter (bytes saved for backward, after every step that ran): {len(metered)} of {n}"
                 + (f"; not measured: {', '.join(unmetered)}" if unmetered else ", the rest not stepped"
                    if len(metered) < n else ""))
    for p in PRECISIONS:
        passed = sum(r[p] == "pass" for r in rows)
        skipped = [r["model"] for r in rows if r[p] == "skipped"]
        failed = [f"{r['model']} ({r[f'{p}_why']})" for r in rows if r[p] == "FAIL"]
        lines.append(f"- {p} step: {passed} pass" + (f", {len(skipped)} not stepped ({', '.join(skipped)})"
                                                     if skipped else "")
                     + (f", {len(failed)} fail: {'; '.join(failed)}" if failed else ", none fails"))
    for p in FINE_TUNE:
        key = f"finetune_{p}"
        failed = [f"{r['model']} ({r.get(f'{key}_why')})" for r in rows if r.get(key) == "FAIL"]
        lines.append(f"- fine-tune {p} step (backbone frozen: every parameter but the final classification layer's "
                     f"unchanged, that layer moved): {sum(r.get(key) == 'pass' for r in rows)} pass, "
                     f"{sum(r.get(key) == 'skipped' for r in rows)} not stepped"
                     + (f", {len(failed)} fail: {'; '.join(failed)}" if failed else ", none fails"))
    for p in CONVERTING:
        key = f"conformance_{p}"
        failed = [f"{r['model']} ({r.get(f'{key}_why')})" for r in rows if r.get(key) == "FAIL"]
        lines.append(f"- {p} conformance (the converted model's logits within {p}'s tolerance of the unconverted "
                     "one's, every trainable parameter with a gradient, the casts' dtypes those of its CUDA kernels): "
                     f"{sum(r.get(key) == 'pass' for r in rows)} pass of the models it converts a layer of"
                     + (f", {len(failed)} fail: {'; '.join(failed)}" if failed else ", none fails"))
    skips = {r["model"]: r["fp32_why"] or r["tf32_why"] for r in rows if "skipped" in (r["fp32"], r["tf32"])}
    if skips:
        lines += ["", "Not stepped on the CPU: " + "; ".join(f"{m}: {why.removeprefix('not stepped: ')}"
                                                            for m, why in skips.items()) + "."]
    lines += ["", "## Every model", "",
              "| model | params | input | GFLOP/img | fp8 converts | RTX 5090 fp16 / bf16 vs fp32 (vs tf32) "
              "| H100 SXM fp16 / bf16 vs fp32 (vs tf32) | activation meter | " + " | ".join(PRECISIONS)
              + " | fine-tune " + " / ".join(FINE_TUNE) + " | conformance " + " / ".join(CONVERTING) + " | s |",
              "|---|---|---|---|---|---|---|---|" + "---|" * len(PRECISIONS) + "---|---|---|"]
    for r in rows:
        cells = []
        for gpu in conformance.ZOO_GPUS:
            g = gpu.replace(" ", "_")
            cells.append(f"{_num(r[f'{g}_fp16_vs_fp32'])} / {_num(r[f'{g}_bf16_vs_fp32'])} "
                         f"({_num(r[f'{g}_fp16_vs_tf32'])} / {_num(r[f'{g}_bf16_vs_tf32'])})"
                         + (f" L: {r.get(f'{g}_launch_bound')}" if r.get(f"{g}_launch_bound") else ""))
        fp8 = f"{r['fp8_layers']} ({r['fp8_flop_share']:.0%})" if r["fp8_layers"] else "none"
        size = f"{r['input_size']}" + (" (set)" if r["input_fix"] else "")
        lines.append(f"| {r['model']} | {r['params_m']:,.1f}M | {size} | {_num(r['gflop_per_image'])} | {fp8} "
                     f"| {' | '.join(cells)} | {r.get('activation_meter', 'n/a')} | "
                     + " | ".join(r[p] for p in PRECISIONS)
                     + f" | {' / '.join(r.get(f'finetune_{p}', 'n/a') for p in FINE_TUNE)}"
                     + f" | {' / '.join(r.get(f'conformance_{p}', 'n/a') for p in CONVERTING)} | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="", help="comma-separated torchvision names (default: the whole zoo)")
    ap.add_argument("--params", default=str(REPO_ROOT / "params.yaml"))
    ap.add_argument("--max-params", type=float, default=300e6, help="no CPU step above this many parameters")
    ap.add_argument("--step-budget", type=float, default=20.0, help="seconds of fp32 step after which the other "
                                                                      "precisions are not stepped")
    ap.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "zoo"),
                    help="writes <out>.md and <out>.csv")
    args = ap.parse_args()
    import yaml
    params = yaml.safe_load(Path(args.params).read_text()) or {}
    names = [n for n in args.models.split(",") if n] or models.torchvision_names()
    rows, t0 = [], time.perf_counter()
    fork = multiprocessing.get_context("fork")  # torch is imported here and has run nothing: a fork is safe
    for i, name in enumerate(names, 1):
        try:  # each model in a process of its own: what one leaves in memory does not add up over 80
            with ProcessPoolExecutor(1, mp_context=fork) as pool:
                row = pool.submit(check_one, name, params, args.max_params, args.step_budget).result()
        except Exception as err:  # the check itself failed, or its process died (out of memory): a row that says so
            if isinstance(err, BrokenProcessPool):
                err = RuntimeError("the check's process died (out of memory?)")
            row = {"model": name, "params_m": 0.0, "input_size": None, "input_fix": "", "not_checked": first_line(err),
                   "gflop_per_image": None, "fp8_layers": None, "fp8_flop_share": None, "seconds": 0.0,
                   **{p: "FAIL" for p in PRECISIONS}, **{f"{p}_why": first_line(err) for p in PRECISIONS},
                   **{f"finetune_{p}": "FAIL" for p in FINE_TUNE},
                   **{f"finetune_{p}_why": first_line(err) for p in FINE_TUNE},
                   **{f"conformance_{p}": "FAIL" for p in CONVERTING},
                   **{f"conformance_{p}_why": first_line(err) for p in CONVERTING},
                   **{f"{g.replace(' ', '_')}_{k}": None for g, k in RATIO_KEYS}, "activation_meter": "FAIL"}
        rows.append(row)
        done = time.perf_counter() - t0
        print(f"[zoo {i}/{len(names)}] {name}: " + " ".join(f"{p} {row[p]}" for p in PRECISIONS)
              + " fine-tune " + " ".join(f"{p} {row.get(f'finetune_{p}')}" for p in FINE_TUNE)
              + f" ({row['seconds']:.0f} s; {done / 60:.1f} min, ETA {done / i * (len(names) - i) / 60:.1f} min)",
              flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = sys.argv[1:]
    out.with_suffix(".md").write_text(page(rows, time.perf_counter() - t0, argv))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    out.with_suffix(".csv").write_text(buf.getvalue())
    print(f"written: {out.with_suffix('.md')}, {out.with_suffix('.csv')}")


if __name__ == "__main__":
    main()
