"""The paired check: each one-process variant without accumulation, timed in short windows taken in turns in one
process.

    python stages/paired.py --params params.yaml --data data/prepared --env reports/env.json --out reports/paired.json

The train stages run one after another, each in its own process, so whatever changes between them (another
tenant on a shared GPU or CPU, a throttled clock, a warmer card) lands on one variant alone, and a bootstrap over
one process's steps turns that into a narrow interval around the wrong ratio. Here every variant gets windows
of timed optimizer steps (the engine's own step on the model, optimizer, compilation, recipe and TF32 setting
its train stage uses, at train.batch_size, after ``WARM`` untimed steps), and the windows go round in turns,
``paired.rounds`` times, in the orders of a Williams design (A B C, B C A, C A B, C B A, A C B, B A C for three:
each variant in every position and after every other equally often, so neither a drift nor what a heavy window
leaves for the next favours one), and each round gives a ratio to the strict-fp32 baseline measured seconds, not
stages, apart. A window is sized by time: at least ``paired.window_s`` seconds and ``paired.steps`` steps, its
step count fixed per variant from a calibration window before the rounds, so a window spans a busy machine's
scheduler slices and a clock's changes rather than landing inside one. The report sets the rounds' median ratio
beside the stages' and claims a variant faster (slower) than the baseline only where every round says so by more
than ``MARGIN``: with 8 rounds chance does that with probability at most 2 x 2^-8 = 0.8% (a two-sided sign
test), so fewer than 8 rounds measure but claim nothing. A variant whose arithmetic is the baseline's on this
device (tf32 on a CPU or a GPU before Ampere) is marked ``same_arithmetic``: the report says so, not a claim.

A variant that compiles (fp8 and mxfp8 under train.compile: auto on CUDA) while the baseline runs eager would be
measured against eager fp32, and its ratio would hold Inductor's fusion of every other op besides the precision:
then strict fp32 and bf16 compiled the same way (``CONTROLS``) take windows in the same turns, and that variant's
ratios against them, both compiled, are given beside the eager ones (``vs_compiled``).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import torch

from ampbench import models, runplan
from ampbench.config import Config, variant_world
from ampbench.errors import analysis, first_line
from ampbench.precision import BASELINE, RUNGS, set_tf32
from ampbench.sweep.bench import Bench

WARM = 2  # untimed steps at the start of each window: what the window before left behind, worked off
CLAIM_ROUNDS = 8  # rounds that agree before a ratio is called faster or slower (stats.sign_test_p(8, 8): 0.8%)
CALIBRATE = 3  # timed steps of the window that sizes a variant's windows
MARGIN = 0.02  # a round's ratio within 2% of 1 says neither
CONTROLS = ("fp32", "bf16")  # compiled control windows, when a variant compiles and the baseline does not


def control_name(precision: str) -> str:
    return f"compiled {precision}"


def controls(cfg: Config, plans: dict, device: str) -> dict:
    """The compiled control windows' plans (``control_name`` -> RunPlan): strict fp32 and bf16 as the sweep runs
    them, compiled, when a timed variant compiles and the baseline does not; none otherwise."""
    base = baseline(cfg, list(plans))
    if base is None or plans[base].train.compile or not any(p.train.compile for p in plans.values()):
        return {}
    out = {}
    for precision in CONTROLS:
        plan = runplan.for_precision(cfg, precision, device)
        out[control_name(precision)] = dataclasses.replace(plan, variant=control_name(precision),
                                                           train=dataclasses.replace(plan.train, compile=True))
    return out


def _ratios(series: list[float], reference: list[float]) -> dict | None:
    """A variant's round-by-round ratios to a reference's windows of the same rounds: median, range, claim."""
    ratios = [a / b for a, b in zip(series, reference, strict=True) if a and b]
    if not ratios:
        return None
    return {"median": statistics.median(ratios), "lo": min(ratios), "hi": max(ratios), "rounds": ratios,
            "claim": claim(ratios)}


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


def same_arithmetic(precision: str, device: torch.device) -> bool:
    """The precision computes exactly what strict fp32 does on this device: fp32 itself, or a TF32 rung where there
    are no TF32 tensor cores (a CPU, a GPU before Ampere)."""
    rung = RUNGS[precision]
    if precision == BASELINE:
        return True
    if not rung.tf32 or rung.autocast or rung.converts:
        return False
    return device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 0)


def window_steps(step_s: float, min_steps: int, window_s: float) -> int:
    """Timed steps per window for a step of ``step_s`` seconds: ``window_s`` seconds' worth, at least ``min_steps``."""
    return max(min_steps, math.ceil(window_s / step_s) if step_s > 0 else min_steps)


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
    batch, rounds = cfg.train.batch_size, cfg.paired.rounds
    names = variants(cfg)
    benches, feeds, not_made, steps = {}, {}, {}, {}

    def window(name: str, n: int, warmup: int):
        """``n`` timed steps of ``name`` (its TF32 switch set first: it is the process's, not the model's)."""
        set_tf32(benches[name].plan.train.allow_tf32)
        return benches[name].run(batch, n, feeds[name], warmup=warmup)

    plans = {name: runplan.make_plan(cfg, name, device.type) for name in names}
    plans.update(controls(cfg, plans, device.type))
    for name, plan in plans.items():
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
            rate = window(name, CALIBRATE, 0).imgs_per_s()  # sizes its windows: window_s seconds of its steps
            steps[name] = window_steps(batch / rate if rate else 0.0, cfg.paired.steps, cfg.paired.window_s)
        except Exception as err:  # e.g. out of memory beside the others: that variant is left out, said why
            not_made[name] = first_line(err)
            del benches[name], feeds[name]
    order = list(benches)
    base = baseline(cfg, [n for n in order if n in cfg.variants])
    rates: dict[str, list[float]] = {n: [] for n in order}
    design = orders(len(order))
    t0 = time.perf_counter()
    for r in range(rounds if base else 0):
        turn = [order[i] for i in design[r % len(design)]]
        for name in turn:
            rates[name].append(window(name, steps[name], WARM).imgs_per_s() or 0.0)
        print(f"[paired] round {r + 1}/{rounds}: " + ", ".join(f"{n} {rates[n][-1]:,.0f} img/s" for n in turn)
              + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    out = {"enabled": True, "device": device.type, "batch": batch, "rounds": rounds, "steps": steps,
           "window_s": cfg.paired.window_s, "min_steps": cfg.paired.steps,
           "order": "a Williams design: each variant in every position, and after every other, equally often",
           "claim_rounds": CLAIM_ROUNDS, "margin": MARGIN, "baseline": base,
           "not_made": not_made, "imgs_per_s": rates, "vs_fp32": {}, "vs_compiled": {},
           "controls": [n for n in plans if n not in names]}
    if base is None and not not_made.get("fp32"):
        out["why_no_ratio"] = "no one-process strict-fp32 variant without accumulation to take ratios against"
    for name, series in rates.items():
        got = _ratios(series, rates.get(base) or []) if name != base else None
        if got:
            out["vs_fp32"][name] = {"precision": plans[name].precision, **got}
            if same_arithmetic(plans[name].precision, device):  # the rule's claim kept; the report says why not
                out["vs_fp32"][name]["same_arithmetic"] = True
        if name in names and plans[name].train.compile and out["controls"]:  # both compiled
            both = {p: _ratios(series, rates.get(control_name(p)) or []) for p in CONTROLS}
            out["vs_compiled"][name] = {p: r for p, r in both.items() if r}
    return out
