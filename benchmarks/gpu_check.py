"""GPU check: strict fp32, tf32, fp16-AMP, bf16-AMP and fp16-AMP with accumulation 4, in one process.

    python benchmarks/gpu_check.py --out benchmarks/results/gpu_check.json     # make gpu-check

Runs ampbench's engine (no DVC, no MLflow) on synthetic CIFAR-shaped data, ResNet-18 with the CIFAR stem,
batch 256; each variant trains --steps optimizer steps (the first --warmup untimed), --repeats times. Then a
short accuracy run (fp32 and fp16, --acc-epochs epochs on the learnable synthetic set) shows both learn alike.
Prints one table and writes it as JSON and as a markdown page beside it (--out with .md), with the command,
versions and date. Sized to finish in a few minutes on a current GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from ampbench import data, env
from ampbench.config import AmpConfig, ModelConfig, TrainConfig
from ampbench.measure import stats
from ampbench.precision import amp_settings, rung, unsupported
from ampbench.runplan import RunPlan
from ampbench.train import runner

VARIANTS = [  # name, precision, accum_steps
    ("fp32_strict", "fp32", 1),
    ("tf32", "tf32", 1),
    ("fp16_amp", "fp16", 1),
    ("bf16_amp", "bf16", 1),
    ("fp16_amp_accum4", "fp16", 4),
]


def plan_for(name, precision, accum, args, epochs=1, repeats=None) -> RunPlan:
    repeats = args.repeats if repeats is None else repeats
    return RunPlan(variant=name, precision=precision, accum_steps=accum, device=args.device, seed=0,
                   model=ModelConfig(arch=args.arch, channels_last=True),
                   train=TrainConfig(epochs=epochs, batch_size=args.batch, warmup_steps=args.warmup,
                                     allow_tf32=rung(precision).tf32, repeats=repeats),
                   amp=amp_settings(precision, AmpConfig()))


def _gib(n) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--arch", default="resnet18")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps per variant and repeat")
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--acc-epochs", type=int, default=4)
    ap.add_argument("--acc-images", type=int, default=10240)
    ap.add_argument("--out", default="benchmarks/results/gpu_check.json")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: no CUDA GPU here; this check needs one (or pass --device cpu for a smoke run)")

    info = env.probe()
    t0 = time.perf_counter()
    speed_data = data.synthetic_in_memory(args.steps * args.batch, args.batch, seed=0, device=args.device)
    rows = {}
    for name, precision, accum in VARIANTS:
        reason = unsupported(precision, info["gpu"]) if args.device == "cuda" else None
        if reason:
            print(f"{name}: skipped: {reason}")
            continue
        result = runner.train_repeats(plan_for(name, precision, accum, args), speed_data, progress=False)
        rows[name] = result.metrics
        m = result.metrics
        print(f"{name}: {m['imgs_per_s']:,.0f} img/s ({time.perf_counter() - t0:.0f}s elapsed)", flush=True)

    acc_data = data.synthetic_in_memory(args.acc_images, 2048, seed=1, device=args.device)
    accuracy = {}
    for name, precision in (("fp32_strict", "fp32"), ("fp16_amp", "fp16")):
        plan = plan_for(name, precision, 1, args, epochs=args.acc_epochs, repeats=1)
        accuracy[name] = runner.train(plan, acc_data, progress=False).metrics["final_acc"]
        print(f"accuracy run {name}: {accuracy[name]:.4f}", flush=True)

    base = rows.get("fp32_strict", {}).get("imgs_per_s_runs")
    tf32_runs = rows.get("tf32", {}).get("imgs_per_s_runs")
    table = []
    for name, m in rows.items():
        vs = {}
        for label, ref in (("vs_fp32", base), ("vs_tf32", tf32_runs)):
            if ref and len(ref) >= 2 and len(m["imgs_per_s_runs"]) >= 2:
                vs[label] = stats.ratio_ci_from_repeats(m["imgs_per_s_runs"], ref)
            elif ref:
                vs[label] = (m["imgs_per_s"] / (sum(ref) / len(ref)), None, None)
        table.append({"variant": name, "precision": m["precision"], "accum_steps": m["accum_steps"],
                      "tf32": m["tf32"], "imgs_per_s": m["imgs_per_s"], "imgs_per_s_std": m["imgs_per_s_std"],
                      "step_time_ms": m["step_time_ms"], **vs, "peak_alloc_bytes": m["peak_mem_bytes"],
                      "peak_reserved_bytes": m["peak_reserved_bytes"], "activation_bytes": m["activation_bytes"],
                      "achieved_tflops": m["achieved_tflops"], "fraction_of_peak": m["fraction_of_peak"],
                      "peak_tflops_datasheet": m["peak_tflops_datasheet"], "accuracy": accuracy.get(name)})

    header = (f"{info['gpu']['name'] if info['gpu'] else 'CPU'}, torch {torch.__version__}, CUDA "
              f"{info['cuda_runtime']}, driver {(info['gpu'] or {}).get('driver')}, {args.arch}, batch {args.batch}, "
              f"{args.steps} steps ({args.warmup} warm-up) x {args.repeats} repeats")
    lines = markdown_table(table)
    print("\n" + header + "\n" + "\n".join(lines))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"env": info, "args": vars(args), "rows": table}, indent=2, default=str) + "\n")
    md = out.with_suffix(".md")
    md.write_text("\n".join([
        f"# GPU check: {header.split(',')[0]}", "",
        f"Measured on {time.strftime('%Y-%m-%d')} with `python {' '.join(sys.argv)}`.", "", header + ".", "",
        *lines, "",
        "img/s: end to end after the warm-up steps, mean and sd over repeats; ratios: mean img/s over the "
        "reference's, 95% t-interval over repeats; peaks: CUDA max allocated / reserved; activations: bytes "
        "saved for backward in one micro-batch; TFLOP/s: torch.utils.flop_counter FLOPs x img/s, against the "
        "datasheet's dense peak (quoted, not measured); accuracy: a short run on the learnable synthetic set.",
        ""]))
    print(f"\nwrote {out} and {md} in {time.perf_counter() - t0:.0f}s")


def _ratio(v) -> str:
    if not v:
        return "n/a"
    return f"{v[0]:.2f}x" + (f" ({v[1]:.2f} to {v[2]:.2f})" if v[1] else "")


def markdown_table(table: list[dict]) -> list[str]:
    lines = ["| variant | img/s (± sd) | vs strict fp32 (95% CI) | vs tf32 | peak alloc GiB | peak reserved GiB "
             "| activations GiB | TFLOP/s | of peak | accuracy |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        sd = f" ± {r['imgs_per_s_std']:,.0f}" if r["imgs_per_s_std"] is not None else ""
        frac = f"{r['fraction_of_peak']:.0%}" if r["fraction_of_peak"] else "n/a"
        acc = f"{r['accuracy']:.2%}" if r["accuracy"] is not None else ""
        lines.append(f"| {r['variant']} | {r['imgs_per_s']:,.0f}{sd} | {_ratio(r.get('vs_fp32'))} "
                     f"| {_ratio(r.get('vs_tf32'))} | {_gib(r['peak_alloc_bytes'])} | {_gib(r['peak_reserved_bytes'])} "
                     f"| {_gib(r['activation_bytes'])} | {r['achieved_tflops']:.1f} | {frac} | {acc} |")
    return lines


if __name__ == "__main__":
    main()
