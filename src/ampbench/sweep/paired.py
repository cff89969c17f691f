"""The paired check: each precision the variants train in, timed in short windows taken in turns in one process.

    python stages/paired.py --params params.yaml --data data/prepared --env reports/env.json --out reports/paired.json

The train stages run one after another, each in its own process, so whatever changes between them (another
tenant on a shared GPU or CPU, a throttled clock, a warmer card) lands on one variant alone, and a bootstrap over
one process's steps turns that into a narrow interval around the wrong ratio. Here every precision gets a window
of ``paired.steps`` timed optimizer steps (the engine's own step, at train.batch_size, after one untimed step),
and the windows go round in turns, ``paired.rounds`` times, the order rotated each round (A B C, B C A, C A B,
...): a drift lands on every precision alike, and each round gives a ratio to fp32 measured minutes, not stages,
apart. The report sets the rounds' median ratio beside the stages' and claims a precision faster (slower) than
fp32 only where every round says so: with 5 rounds that happens by chance with probability 2^-5 = 3% (a sign
test), so fewer than 5 rounds measure but claim nothing.
"""

from __future__ import annotations

import statistics
import time

import torch

from ampbench import models
from ampbench.config import Config
from ampbench.errors import analysis
from ampbench.precision import BASELINE
from ampbench.sweep.bench import Bench

CLAIM_ROUNDS = 5  # rounds that agree before a ratio is called faster or slower (sign test, one-sided p = 2^-5)
MARGIN = 0.02  # a round's ratio within 2% of 1 says neither


def precisions(cfg: Config) -> list[str]:
    """The precisions of the variants the verdict compares (one process, no accumulation), fp32 first."""
    found = [v.precision for v in cfg.variants.values() if v.accum_steps == 1]
    return list(dict.fromkeys([BASELINE, *found]))


def claim(ratios: list[float]) -> str | None:
    """faster | slower when every round says so (and there are enough rounds), else None."""
    if len(ratios) < CLAIM_ROUNDS:
        return None
    if all(r > 1 + MARGIN for r in ratios):
        return "faster"
    if all(r < 1 - MARGIN for r in ratios):
        return "slower"
    return None


def run_paired(cfg: Config, prepared: dict, device: torch.device) -> dict:
    """Every precision's windows, in turns; its round-by-round img/s and ratios to fp32."""
    batch, rounds, steps = cfg.train.batch_size, cfg.paired.rounds, cfg.paired.steps
    benches, not_made = {}, {}
    for p in precisions(cfg):
        bench, why = analysis("paired", f"{models.name(cfg.model)} ({p}: its setup)", Bench, cfg, prepared, device, p)
        if bench is None:
            not_made[p] = why
            continue
        if batch % bench.multiple:
            not_made[p] = f"batch {batch} is no multiple of {bench.multiple}, the micro-batches {p} runs"
            continue
        bench.feed = bench.batches(batch)
        bench.run(batch, 1, bench.feed)  # warm: allocation, cuDNN's autotuning, compilation
        benches[p] = bench
    order = list(benches)
    rates: dict[str, list[float]] = {p: [] for p in order}
    t0 = time.perf_counter()
    for r in range(rounds if BASELINE in benches else 0):
        turn = order[r % len(order):] + order[:r % len(order)]  # rotated: no precision always first
        for p in turn:
            timed = benches[p].run(batch, steps, benches[p].feed, warmup=1)
            rates[p].append(timed.imgs_per_s())
        print(f"[paired] round {r + 1}/{rounds}: " + ", ".join(f"{p} {rates[p][-1]:,.0f} img/s" for p in turn)
              + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    out = {"enabled": True, "device": device.type, "batch": batch, "rounds": rounds, "steps": steps,
           "order": "rotated each round", "claim_rounds": CLAIM_ROUNDS, "margin": MARGIN, "not_made": not_made,
           "imgs_per_s": rates, "vs_fp32": {}}
    base = rates.get(BASELINE) or []
    for p, series in rates.items():
        if p == BASELINE or not base:
            continue
        ratios = [a / b for a, b in zip(series, base, strict=True) if a and b]
        if ratios:
            out["vs_fp32"][p] = {"median": statistics.median(ratios), "lo": min(ratios), "hi": max(ratios),
                                 "rounds": ratios, "claim": claim(ratios)}
    return out
