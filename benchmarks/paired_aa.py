"""The paired check's false claims, counted: A/A runs, where no claim is true.

    python benchmarks/paired_aa.py --runs 200 --out benchmarks/results/paired_aa.md

Each run is the paired stage's own ``run_paired`` on the CPU demo's settings (small CNN, batch 16, 8 rounds of
windows of at least 0.2 s and 20 steps) with strict fp32, its identical twin, and tf32, which on a CPU is the same
arithmetic as fp32. Any "faster" or "slower" the rule says of the twin or of tf32 is a false claim (the report
shows neither, as both are marked the same arithmetic, but the rule is what guards every other comparison). The
runs are made quiet, and beside a bursty load: as many spinning processes as the machine has cores, each paused
and resumed at random every 50 to 400 ms (a neighbour's bursts, a scheduler's slices). The table gives, per
condition, the comparisons, the false claims, their rate and its 95% upper bound (Clopper-Pearson); the target
is at most 1%.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import multiprocessing as mp
import os
import random
import signal
import sys
import time
from pathlib import Path

import torch

from ampbench import config, data, env
from ampbench.sweep import paired

TWINS = ("fp32_twin", "tf32")  # the same arithmetic as the baseline, fp32, on a CPU: no claim is true


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def bursty_load(seed: int = 0):
    """One spinning process per core, each paused and resumed at random every 50 to 400 ms, until the block ends."""
    procs = [mp.Process(target=_spin, daemon=True) for _ in range(os.cpu_count() or 1)]
    for p in procs:
        p.start()
    stop = mp.Event()
    toggler = mp.Process(target=_toggle, args=([p.pid for p in procs], stop, seed), daemon=True)
    toggler.start()
    try:
        yield
    finally:
        stop.set()
        toggler.join(5)
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.join(5)


def _toggle(pids: list[int], stop, seed: int) -> None:
    rng = random.Random(seed)
    paused = set()
    while not stop.is_set():
        pid = rng.choice(pids)
        os.kill(pid, signal.SIGCONT if pid in paused else signal.SIGSTOP)
        paused ^= {pid}
        time.sleep(rng.uniform(0.05, 0.4))


def settings(rounds: int, steps: int, window_s: float) -> config.Config:
    return config.from_dict({"device": "cpu", "model": {"arch": "small_cnn"}, "mlflow": {"enabled": False},
                             "train": {"batch_size": 16, "warmup_steps": 4},
                             "variants": {"fp32": {"precision": "fp32"}, "fp32_twin": {"precision": "fp32"},
                                          "tf32": {"precision": "tf32"}},
                             "paired": {"enabled": True, "rounds": rounds, "steps": steps, "window_s": window_s}})


def false_claims(found: dict) -> dict[str, str | None]:
    """What one run said of each twin against fp32: its claim (any is false), or None."""
    return {name: (found["vs_fp32"].get(name) or {}).get("claim") for name in TWINS}


def runs(n: int, cfg: config.Config, prepared: dict) -> list[dict[str, str | None]]:
    out = []
    for i in range(n):
        with contextlib.redirect_stdout(io.StringIO()):  # the stage's round-by-round lines
            out.append(false_claims(paired.run_paired(cfg, prepared, torch.device("cpu"))))
        if (i + 1) % 20 == 0:
            wrong = sum(c is not None for r in out for c in r.values())
            print(f"  {i + 1}/{n} runs, {wrong} false claims", flush=True)
    return out


def row(condition: str, found: list[dict]) -> str:
    from scipy.stats import binomtest
    comparisons = len(found) * len(TWINS)
    wrong = sum(c is not None for r in found for c in r.values())
    per = {t: sum(r[t] is not None for r in found) for t in TWINS}
    upper = binomtest(wrong, comparisons).proportion_ci(0.95, method="exact").high
    return (f"| {condition} | {len(found)} | {comparisons} | {wrong} ({', '.join(f'{t} {k}' for t, k in per.items())}) "
            f"| {wrong / comparisons:.1%} | {upper:.1%} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20, help="at least this many steps per window")
    ap.add_argument("--window-s", type=float, default=0.2, help="and at least this many seconds")
    ap.add_argument("--load", choices=["quiet", "bursty", "both"], default="both")
    ap.add_argument("--out", default="", help="a markdown file for the table")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = settings(args.rounds, args.steps, args.window_s)
    prepared = data.synthetic_in_memory(192, 128, seed=0, device="cpu")
    rows = []
    for condition in (["quiet", "bursty"] if args.load == "both" else [args.load]):
        print(f"{condition}: {args.runs} runs", flush=True)
        t0 = time.perf_counter()
        with bursty_load() if condition == "bursty" else contextlib.nullcontext():
            found = runs(args.runs, cfg, prepared)
        rows.append(row(condition, found) + f" {time.perf_counter() - t0:.0f} s |")
        print(rows[-1], flush=True)
    lines = [f"# The paired check's false claims (A/A), {args.rounds} rounds, windows of at least {args.window_s} s "
             f"and {args.steps} steps", "",
             f"`python {' '.join(sys.argv)}`, {env.probe().get('cpu_model')}, {os.cpu_count()} cores, torch "
             f"{torch.__version__}, one torch thread. "
             "Each run: strict fp32, its identical twin, and tf32 (the same arithmetic on a CPU) in the paired "
             "check's turns; any claim of the twin or tf32 against fp32 is false. Target: at most 1%.", "",
             "| condition | runs | comparisons | false claims | rate | 95% upper bound | time |",
             "|---|---|---|---|---|---|---|",
             *rows]
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
