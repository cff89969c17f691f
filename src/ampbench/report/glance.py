"""The report's first screen: a title that carries the answer, at most six short bullets (speed, memory,
accuracy, trust, why, headroom), one line on what to do next, and a summary table of seven columns.

Every figure here is one the sections below show with its evidence; nothing estimated appears on this screen.
A ratio below 1 reads as "N x slower".
"""

from __future__ import annotations

from ampbench import precision
from ampbench.report import fmt
from ampbench.report.verdict import repeats_claim, unsteady

MAX_WORDS = 30  # a bullet's budget


def claim(name: str, summary: dict) -> tuple[float | None, str, str | None]:
    """Variant ``name``'s speed against strict FP32 as the verdict judges it: (ratio, where it comes from, claim),
    the claim "faster" | "slower" | None. Repeats give a t-interval; else the paired check's rounds; else one run
    each, which claims nothing."""
    r = summary["variants"][name]
    sp, (lo, hi) = r.get("speedup"), r.get("speedup_ci95") or [None, None]
    shaky = unsteady(summary, name, summary["baseline"])
    if (r.get("speedup_ci_method") or "").startswith("t-interval") and lo is not None:
        said = None if shaky else repeats_claim(lo, hi)
        return sp, f"{r.get('repeats', 2)} repeats, 95% CI {fmt.ratio(lo)} to {fmt.ratio(hi)}", said
    both = (r.get("paired_compiled") or {}).get("fp32")
    p = both or r.get("paired")
    if p:
        need = (summary.get("paired") or {}).get("claim_rounds", 8)
        rounds = len(p["rounds"])
        how = "both compiled, " if both else ""
        where = f"paired check, {how}{rounds} round{'s' * (rounds != 1)}"
        if p.get("same_arithmetic"):  # tf32 where there is no TF32: the ratio is the check's own noise
            return p["median"], where + "; the same arithmetic as FP32 here", None
        if rounds < need:
            where += f"; {need} needed for a claim"
        return p["median"], where, p.get("claim")
    return sp, "one run each: not a claim", None


def speed(ratio: float | None) -> str:
    """A speedup in words: 2.40x faster, 5.5x slower, 1.00x (within half a percent), n/a."""
    if ratio is None:
        return "n/a"
    if abs(ratio - 1) < 0.005:
        return "1.00x"
    return fmt.faster(ratio)


def _emulated(env: dict, r: dict) -> str:
    """Where a CPU ran it: "CPU: fp16 emulated", "CPU"; "" on a GPU."""
    if env.get("gpu"):
        return ""
    rung = precision.RUNGS.get(r.get("precision"))
    return f"CPU: {r.get('precision')} emulated" if rung and rung.emulated_on_cpu else "CPU"


def _accuracy_words(r: dict, base: dict) -> str | None:
    """"within spread" when the difference is under twice the larger sd, else "+0.40 pts accuracy"; None without."""
    if r.get("acc_diff") is None:
        return None
    return "accuracy within spread" if fmt.spread_judged(r, base)[0] else f"{fmt.points(r['acc_diff'])} accuracy"


def versus(ratio: float | None) -> str:
    """A ratio to strict FP32 in words: "2.40x faster than strict FP32", "as fast as strict FP32", "not measured
    against strict FP32"."""
    words = speed(ratio)
    return {"n/a": "not measured against strict FP32", "1.00x": "as fast as strict FP32"}.get(
        words, f"{words} than strict FP32")


def title(summary: dict, env: dict) -> str:
    """The answer in one line: "# FP16-AMP: 5.5x slower than strict FP32 here (CPU: fp16 emulated)"."""
    name, base = summary.get("headline"), summary.get("baseline")
    if name is None or base is None:
        return "# ampbench report: no FP32 baseline and mixed-precision pair among the finished runs"
    r, b = summary["variants"][name], summary["variants"][base]
    ratio, _, said = claim(name, summary)
    words = speed(ratio)
    text = f"{fmt.label(r)}: {versus(ratio)} here"
    if env.get("gpu") and r.get("mem_ratio") is not None:
        text += f", {fmt.change(r['mem_ratio'])} memory"
    acc = _accuracy_words(r, b)
    if env.get("gpu") and acc:
        text += f", {acc}"
    notes = ["not yet a claim"] if said is None and words not in ("n/a", "1.00x") else []
    notes += [_emulated(env, r)] if _emulated(env, r) else []
    return "# " + text + (f" ({'; '.join(notes)})" if notes else "")


def _fit(head: str, parts: list[str]) -> str:
    """``head`` and as many of ``parts`` as keep the bullet within MAX_WORDS words, the rest counted ("and 2 more
    in the table"); ``head`` alone, less its last word, where none fits."""
    for n in range(len(parts), -1, -1):
        rest = f"; {len(parts) - n} more in the table" if n < len(parts) else ""
        text = f"{head} {', '.join(parts[:n])}{rest}." if n else head.rsplit(" ", 1)[0]
        if len(text.split()) <= MAX_WORDS or not n:
            return text
    return head


def _speed_bullet(summary: dict, name: str) -> str:
    ratio, where, _ = claim(name, summary)
    head = f"**Speed**: `{name}` {versus(ratio)} ({where})."
    others = [f"`{n}` " + ("the same arithmetic as FP32 here" if fmt.same_arithmetic(o)
                           else speed(claim(n, summary)[0]))
              for n, o in summary["variants"].items()
              if n not in (name, summary["baseline"]) and o.get("speedup") is not None]
    return _fit(head + " Others:", others) if others else head


def _memory_bullet(summary: dict, env: dict, name: str) -> str | None:
    r = summary["variants"][name]
    if r.get("mem_ratio") is None and r.get("activation_ratio") is None:
        return None
    what = "peak allocated" if env.get("gpu") else "process peak RSS"
    text = f"**Memory**: `{name}` {fmt.change(r.get('mem_ratio'))} {what} against strict FP32"
    if r.get("activation_ratio") is not None:
        text += f"; {fmt.change(r['activation_ratio'])} activations saved for backward"
    return text + "."


def _accuracy_bullet(summary: dict, name: str) -> str | None:
    r, b = summary["variants"][name], summary["variants"][summary["baseline"]]
    if r.get("final_acc") is None or b.get("final_acc") is None:
        return None
    within, spread = fmt.spread_judged(r, b)
    judged = (f"within spread (sd {spread * 100:.2f} pts)" if within
              else f"{fmt.points(r['acc_diff'])}" + ("" if spread else ", one run each (spread unknown)"))
    return f"**Accuracy**: `{name}` {r['final_acc']:.2%} against {b['final_acc']:.2%} for strict FP32: {judged}."


def _trust_bullet(summary: dict, name: str) -> str:
    shaky = [n for n, r in summary["variants"].items() if (r.get("steadiness") or {}).get("unsteady")]
    steady = "every stage ran steady" if not shaky else \
        "not steady: " + ", ".join(f"`{n}`" for n in shaky[:4]) + (" and more" if len(shaky) > 4 else "")
    repeats = summary["variants"][name].get("repeats") or 1
    runs = f"{repeats} training runs per variant" if repeats > 1 else "one training run per variant"
    p = summary.get("paired")
    paired = f"paired check: {p['rounds']} round{'s' * (p['rounds'] != 1)}" if p and not p.get("error") \
        else "no paired check"
    return f"**Trust**: {steady}; {runs}; {paired}. Steadiness and the paired check are below."


def _why_bullet(summary: dict, env: dict, name: str) -> str | None:
    r = summary["variants"][name]
    rung = precision.RUNGS.get(r.get("precision"))
    if not env.get("gpu") and rung and rung.emulated_on_cpu:
        return f"**Why**: a CPU has no {r.get('precision')} tensor cores; its {r.get('precision')} arithmetic is " \
               "emulated, so it says nothing of a GPU."
    cmp = (summary.get("profile_comparison") or {}).get(name)
    if not cmp:
        return None
    cats = {c: x for c, x in cmp["categories"].items() if x["speedup"] is not None and x.get("role") != "unattributed"}
    if not cats:
        return None
    big = max(cats, key=lambda c: max(cats[c]["base_ms"], cats[c]["ms"]))
    row = cats[big]
    text = (f"**Why**: {big}, the largest share of the step, went {fmt.faster(row['speedup'])} "
            f"({row['base_ms']:.3g} -> {row['ms']:.3g} ms)")
    if cmp.get("amdahl_bound"):
        text += f"; the Amdahl bound is {fmt.times(cmp['amdahl_bound'])}"
    return text + "."


def _headroom_bullet(summary: dict, env: dict, name: str) -> str:
    found = summary.get("roofline") or {}
    gpu = found.get("gpu")
    if not gpu:
        return "**Headroom**: no roofline for this device; `ampbench roofline --gpu all` gives every GPU's."
    r = summary["variants"][name]
    cell = (gpu.get("table") or {}).get(r.get("precision")) or {}
    if "vs_fp32" not in cell:
        return f"**Headroom**: the roofline has no {r.get('precision')} column on {gpu['name']}."
    text = f"**Headroom**: the roofline allows {r.get('precision')} {fmt.times(cell['vs_fp32'])} strict FP32 on " \
           f"{gpu['name']}"
    measured = (found.get("measured") or {}).get(name)
    if measured:
        text += f"; `{name}` reached {measured['of_roofline']:.0%} of its roofline img/s"
    if cell.get("launch_bound"):
        text += " (launch-bound)"
    return text + "."


def bullets(summary: dict, env: dict) -> list[str]:
    """At most six bullets, each at most MAX_WORDS words."""
    name = summary.get("headline")
    if name is None or summary.get("baseline") is None:
        return []
    found = [_speed_bullet(summary, name), _memory_bullet(summary, env, name), _accuracy_bullet(summary, name),
             _trust_bullet(summary, name), _why_bullet(summary, env, name), _headroom_bullet(summary, env, name)]
    return [f"- {b}" for b in found if b]


def next_step(summary: dict, env: dict) -> str:
    """One line: what to do next, from what this run could and could not tell."""
    name = summary.get("headline")
    if name is None or summary.get("baseline") is None:
        return "**Next**: add a strict FP32 variant and an FP16 one to params.yaml's variants, then `dvc repro`."
    r = summary["variants"][name]
    if not env.get("gpu"):
        return "**Next**: run `make repro` on a GPU (or `make gpu-check` for a quick look); a CPU emulates fp16."
    ratio, where, said = claim(name, summary)
    if unsteady(summary, *summary["variants"]) and not where.startswith("paired"):  # drift cannot fake a pairing
        return "**Next**: rerun on a quiet machine (`dvc repro -f`); an unsteady stage's ratio claims nothing."
    if said is None:
        need = (summary.get("paired") or {}).get("claim_rounds", 8)
        return f"**Next**: set `paired.rounds: {need}` (or `train.repeats: 3`) and run `dvc repro` for a claim."
    if said == "faster":
        return (f"**Next**: train with `precision: {r['precision']}`; check its accuracy at your full schedule "
                "(time to accuracy below).")
    return "**Next**: read the step profile below; try `train.compile: true` or a larger batch, then `dvc repro`."


def table(summary: dict) -> list[str]:
    """Seven columns: the variant and its precision, img/s, its ratio to strict FP32 (its stage; the paired
    check's), to TF32, peak memory and accuracy against strict FP32."""
    lines = ["| variant | img/s | vs strict FP32 | paired check | vs TF32 | peak memory | accuracy |",
             "|---|---|---|---|---|---|---|"]
    for name, r in summary["variants"].items():
        base = name == summary["baseline"]
        paired = (r.get("paired") or {}).get("median")
        paired = "same arithmetic" if fmt.same_arithmetic(r) else speed(paired)
        acc = fmt.num(r.get("final_acc"), ".2%") + ("" if base else f" ({fmt.points(r.get('acc_diff'))})")
        lines.append(f"| {fmt.named(name, r)} | {fmt.num(r.get('imgs_per_s'), ',.0f')} "
                     f"| {'baseline' if base else speed(r.get('speedup'))} | {'-' if base else paired} "
                     f"| {speed(r.get('vs_tf32')) if r.get('vs_tf32') is not None else '-'} "
                     f"| {'-' if base else fmt.change(r.get('mem_ratio'))} "
                     f"| {acc} |")
    return lines


def first_screen(summary: dict, env: dict, model: str = "") -> list[str]:
    """The title, the model it is about (``model``: a line), the bullets, what to do next, the summary table."""
    found = bullets(summary, env)
    note = ("Ratios of one stage each; the paired check times the variants in turns in one process. The sections "
            "below give each figure with its evidence.")
    return [title(summary, env), ""] + ([model, ""] if model else []) + found + ([""] if found else []) \
        + [next_step(summary, env), ""] + table(summary) + ["", note, ""]
