"""The paired check: each one-process variant without accumulation, timed in short windows taken in turns in one
process.

    python stages/paired.py --params params.yaml --data data/prepared --env reports/env.json --out reports/paired.json

The train stages run one after another, each in its own process, so whatever changes between them (another
tenant on a shared GPU or CPU, a throttled clock, a warmer card) lands on one variant alone, and a bootstrap over
one process's steps turns that into a narrow interval around the wrong ratio. Here every variant gets a window of
``paired.steps`` timed optimizer steps (the engine's own step on the model, optimizer, compilation, recipe and
TF32 setting its train stage uses, at train.batch_size, after ``WARM`` untimed steps), and the windows go round in
turns, ``paired.rounds`` times, in the orders of a Williams design (A B C, B C A, C A B, C B A, A C B, B A C for
three: each variant in every position and after every other equally often, so neither a drift nor what a heavy
window leaves for the next favours one), and each round gives a ratio to the strict-fp32 baseline measured
seconds, not stages, apart. The report sets the rounds' median ratio beside the stages' and claims a variant
faster (slower) than the baseline only where every round says so by more than ``MARGIN``: with 6 rounds chance
does that with probability 2 x 2^-6 = 3% (a two-sided sign test), so fewer than 6 rounds measure but claim nothing.
"""

from __future__ import annotations

import statistics
import time

import torch

from ampbench import models, runplan
from ampbench.config import Config, variant_world
from ampbench.errors import analysis, first_line
from ampbench.precision import BASELINE, set_tf32
from ampbench.sweep.bench import Bench

WARM = 2  # untimed steps at the start of each window: what the window before left behind, worked off
CLAIM_ROUNDS = 6  # rounds that agree before a ratio is called faster or slower (sign test, two-sided p = 2 x 2^-6)
MARGIN = 0.02  # a round's ratio within 2% of 1 says neither


def variants(cfg: Config) -> list[str]:
    """The variants the paired check times: one process, no accumulation (a step of the same work as the
    baseline's), the baseline (strict fp32; named fp32 if several) first."""
    found = [n for n, v in cfg.variants.items() if v.accum_steps == 1 and variant_world(cfg, n) == 1]
    base = baseline(cfg, found)
    return ([base] if base else []) + [n for n in found if n != base]


def baseline(cfg: Config, names: list[str]) -> str | None:
    strict = [n for n in names if cfg.variants[n].precision == BASELINE]
    return "fp32" if "fp32" in strict else (strict[0] if strict else None)


def orders(n: int) -> list[list[int]]:
    """A Williams design for ``n`` variants: the orders the rounds take in turn, each variant in every position
    equally often and after every other variant equally often (within a round), so what one window leaves behind
    (a cache, the allocator, a clock after a heavy window) lands on every variant alike: n orders for an even n,
    2n (the cyclic ones and their mirrors) for an odd n."""
    if n < 2:
        return [list(range(n))]
    first = [0]  # 0, 1, n-1, 2, n-2, ...
    lo, hi = 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(v + k) % n for v in first] for k in range(n)]
    return rows if n % 2 == 0 else rows + [row[::-1] for row in rows]


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
    """Every variant's windows, in turns; its round-by-round img/s and ratios to the baseline's."""
    batch, rounds, steps = cfg.train.batch_size, cfg.paired.rounds, cfg.paired.steps
    names = variants(cfg)
    benches, feeds, not_made = {}, {}, {}

    def window(name: str, n: int, warmup: int):
        """``n`` timed steps of ``name`` (its TF32 switch set first: it is the process's, not the model's)."""
        set_tf32(benches[name].plan.train.allow_tf32)
        return benches[name].run(batch, n, feeds[name], warmup=warmup)

    for name in names:
        plan = runplan.make_plan(cfg, name, device.type)
        bench, why = analysis("paired", f"{models.name(cfg.model)} ({name}: its setup)", Bench, cfg, prepared,
                              device, plan.precision, plan)
        if bench is None:
            not_made[name] = why
            continue
        if batch % bench.multiple:
            not_made[name] = f"batch {batch} is no multiple of {bench.multiple}, the micro-batches it runs"
            continue
        benches[name], feeds[name] = bench, bench.batches(batch)
        try:
            window(name, 1, 2)  # warm: allocation, cuDNN's autotuning, compilation
        except Exception as err:  # e.g. out of memory beside the others: that variant is left out, said why
            not_made[name] = first_line(err)
            del benches[name], feeds[name]
    order = list(benches)
    base = baseline(cfg, order)
    rates: dict[str, list[float]] = {n: [] for n in order}
    design = orders(len(order))
    t0 = time.perf_counter()
    for r in range(rounds if base else 0):
        turn = [order[i] for i in design[r % len(design)]]
        for name in turn:
            rates[name].append(window(name, steps, WARM).imgs_per_s() or 0.0)
        print(f"[paired] round {r + 1}/{rounds}: " + ", ".join(f"{n} {rates[n][-1]:,.0f} img/s" for n in turn)
              + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    out = {"enabled": True, "device": device.type, "batch": batch, "rounds": rounds, "steps": steps,
           "order": "a Williams design: each variant in every position, and after every other, equally often",
           "claim_rounds": CLAIM_ROUNDS, "margin": MARGIN, "baseline": base,
           "not_made": not_made, "imgs_per_s": rates, "vs_fp32": {}}
    if base is None and not not_made.get("fp32"):
        out["why_no_ratio"] = "no one-process strict-fp32 variant without accumulation to take ratios against"
    for name, series in rates.items():
        ratios = [a / b for a, b in zip(series, rates.get(base) or [], strict=True) if a and b]
        if name != base and ratios:
            out["vs_fp32"][name] = {"precision": cfg.variants[name].precision, "median": statistics.median(ratios),
                                    "lo": min(ratios), "hi": max(ratios), "rounds": ratios, "claim": claim(ratios)}
    return out
