"""The report's first paragraph, in plain language, from the summary's numbers: what the headline variant
bought against strict FP32, why (the environment and the step profile), and one sentence each for the
batch-size sweep and data-parallel scaling.

``why`` is the profile's explanation of one variant against the baseline: the verdict gives it for the
headline variant, the profile section for the others.
"""

from __future__ import annotations

from ampbench.report import fmt, sharded


def _reasons(r: dict, base: dict, env: dict) -> list[str]:
    """Why mixed precision may not pay off here, from what the environment and the run show."""
    gpu = env.get("gpu")
    out = []
    if not gpu:
        out.append("this ran on a CPU, which has no fp16 tensor cores: fp16 arithmetic is emulated there")
    elif not gpu.get("tensor_cores"):
        out.append(f"{gpu['name']} has no tensor cores")
    if (r.get("data_time_fraction") or 0) > 0.3 and r.get("data_placement") != "stream":  # stream: input_sentence
        out.append(f"data loading took {r['data_time_fraction']:.0%} of each step")
    if gpu and (r.get("step_time_ms_median") or 1e9) < 5:
        out.append(f"steps are short ({r['step_time_ms_median']:.1f} ms), so kernel launch overhead weighs heavily")
    return out


DISAGREE = 1.1  # a stage's ratio more than 10% outside the paired check's rounds disagrees with it
MARGIN = 0.02  # a t-interval over repeats must clear 1 by this much to call a variant faster or slower


def repeats_claim(lo: float, hi: float) -> str | None:
    """What a 95% t-interval over repeats claims: faster, slower, or None (it holds 1, or nearly)."""
    return "faster" if lo > 1 + MARGIN else "slower" if hi < 1 - MARGIN else None


def unsteady(summary: dict, *names: str) -> list[str]:
    """Of the runs ``names``, what says the machine was not steady while each ran: "`amp`: its steps ran ..."."""
    return [f"`{n}`: {'; '.join(st['unsteady'])}" for n in dict.fromkeys(names)
            if (st := summary["variants"][n].get("steadiness")) and st["unsteady"]]


def speed(r: dict, summary: dict, name: str) -> tuple[str, str | None]:
    """The verdict's words on a variant's speed against strict FP32, and what they claim (faster | slower | None).

    A claim comes from repeated runs (a t-interval over the repeats that excludes 1), or else from the paired
    check (every round agreeing); never from one run's interval alone, whose bootstrap over one process's steps
    says how precisely that run was timed, not whether a second run would agree. A run on a machine that was not
    steady claims nothing from its stage."""
    sp, (lo, hi) = r["speedup"], r.get("speedup_ci95") or [None, None]
    repeats = (r.get("speedup_ci_method") or "").startswith("t-interval")
    shaky = unsteady(summary, name, summary["baseline"])
    ci = ""
    if lo is not None and hi is not None:
        ci = f" (95% CI {fmt.ratio(lo)} to {fmt.ratio(hi)}{' over repeats' if repeats else ' within one run'})"
    if repeats and shaky:
        return (f"ran {fmt.faster(sp)} than strict FP32{ci}, but on a machine that was not steady: no "
                "claim from it"), None
    if repeats:
        said = repeats_claim(lo, hi)
        if said == "faster":
            return f"trained {fmt.times(sp)} faster{ci} than strict FP32", said
        if said == "slower":
            return f"was {fmt.faster(sp)} than FP32{ci}", said
        return f"was no faster than FP32 ({fmt.times(sp)}{ci})", None
    stage = f"its stage ran {fmt.faster(sp)} than strict FP32{ci}"
    p = r.get("paired")
    both = r.get("paired_compiled") or {}
    if p and both.get("fp32"):  # it compiles and FP32 does not: like with like is both compiled
        return _compiled(both, p, stage, summary)
    if p:
        text = f"{_claim(p, summary)}; {stage}"
        if sp is not None and not p["lo"] / DISAGREE <= sp <= p["hi"] * DISAGREE:
            text += (". The two disagree: trust the paired check, which a drift between the stages (another tenant, "
                     "a throttled clock) cannot fake")
        return text, p.get("claim")
    why = "set train.repeats: 2 or more, or paired.enabled: true, for a claim"
    if (r.get("accum_steps") or 1) > 1 or (r.get("world_size") or 1) > 1:
        why = "set train.repeats: 2 or more for a claim (the paired check times one process without accumulation)"
    return f"ran {fmt.faster(sp)} than strict FP32{ci}: one run each, not enough to call it faster or " \
           f"slower; {why}", None


def _claim(c: dict, summary: dict, how: str = "") -> str:
    """What a paired comparison with strict FP32 says (``how``: how both ran, when it is not eager), its rounds."""
    rounds = f"{len(c['rounds'])} rounds in turns in one process, from {fmt.ratio(c['lo'])} to {fmt.ratio(c['hi'])}"
    said = {"faster": f"trained {fmt.times(c['median'])} faster than strict FP32{how} in the paired check ({rounds})",
            "slower": f"was {fmt.faster(c['median'])} than FP32{how} in the paired check ({rounds})"}
    said = None if c.get("same_arithmetic") else said.get(c.get("claim"))
    if c.get("same_arithmetic"):
        said = (f"runs the same arithmetic as strict FP32{how} on this device (no TF32 tensor cores), so its paired "
                f"ratio ({fmt.times(c['median'])}, {rounds}) is the check's own noise, not a speed difference")
    if said is None:
        need = summary["paired"].get("claim_rounds", 8)
        said = (f"was no faster than {'strict ' if how else ''}FP32{how} in the paired check "
                f"({fmt.times(c['median'])}, {rounds}"
                + ("" if len(c["rounds"]) >= need else f"; {need} rounds agreeing are needed to call it faster "
                   "or slower") + ")")
    return said


def _compiled(both: dict, p: dict, stage: str, summary: dict) -> tuple[str, str | None]:
    """A compiled variant's words: its ratio to strict FP32 compiled the same way (the claim), to bf16 compiled,
    and the eager baseline's beside them."""
    c = both["fp32"]
    text = _claim(c, summary, ", both compiled,")
    if both.get("bf16"):
        text += f", {fmt.times(both['bf16']['median'])} bf16 compiled"
    return (f"{text}; against eager FP32 (the compilation's fusion counted in) {fmt.times(p['median'])}; {stage}",
            c.get("claim"))


def _memory(r: dict) -> str:
    mem = r.get("mem_ratio")
    if mem is None:
        text = "with peak memory not measured"
    elif abs(mem - 1) < 0.005:
        text = "with the same peak memory (within 0.5%)"
    else:
        text = f"using {abs(mem - 1):.0%} {'less' if mem < 1 else 'more'} peak memory"
    act = r.get("activation_ratio")
    if act is not None:
        text += f" and {abs(act - 1):.0%} {'less' if act < 1 else 'more'} activation memory"
    return text


def _accuracy(r: dict, base: dict) -> str:
    acc, b_acc, diff = r.get("final_acc"), base.get("final_acc"), r.get("acc_diff")
    if acc is None or b_acc is None:
        return ""
    within, spread = fmt.spread_judged(r, base)
    if within:
        judged = f"within run-to-run spread (sd {spread * 100:.2f} points)"
    else:
        judged = f"a difference of {diff * 100:+.2f} points" + ("" if spread else " from a single run each, so its "
                                                                                  "spread is unknown")
    return f"; final accuracy {acc:.2%} against {b_acc:.2%}, {judged}"




def verdict(summary: dict, env: dict) -> str:
    """The headline variant against the baseline: speed with its interval, memory, accuracy, and why."""
    return " ".join(verdict_items(summary, env))


def verdict_items(summary: dict, env: dict) -> list[str]:
    """The verdict, a claim per item: speed with its interval, memory and accuracy; steadiness; why; the
    roofline's launch bound; skipped steps; the clock; the step profile."""
    name, base_name = summary.get("headline"), summary["baseline"]
    if name is None or base_name is None:
        return ["There is no FP32 baseline and FP16 variant pair among the finished runs, so there is no verdict; "
                "the table below shows what was measured."]
    r, base = summary["variants"][name], summary["variants"][base_name]
    where = env["gpu"]["name"] if env.get("gpu") else f"this CPU ({env.get('cpu_model')})"
    said, claim = speed(r, summary, name)
    items = [f"On {where}, {name} ({fmt.label(r)}) {said}.",
             f"Beside strict FP32, {name} ran {_memory(r)}{_accuracy(r, base)}."]
    shaky = unsteady(summary, name, base_name)
    if shaky:
        items.append("The machine was not steady while these ran (" + "; ".join(shaky) + "), so no speedup is "
                     "claimed from their stages: rerun on a quiet machine"
                     + (", or trust the paired check" if r.get("paired") else "") + ".")
    if claim != "faster":
        reasons = _reasons(r, base, env)
        if reasons:
            items.append("Why: " + "; ".join(reasons) + ".")
    cell = (((summary.get("roofline") or {}).get("gpu") or {}).get("table") or {}).get(r.get("precision"))
    if cell and cell.get("launch_bound"):
        items.append(f"On this GPU's roofline its step is launch-bound: {cell['kernels']:,} kernels launched one by "
                     f"one take {fmt.ms(cell['launch_ms'])}, longer than the {fmt.ms(cell['kernels_ms'])} they run at "
                     "the datasheet's peaks, so the precision moves it little; torch.compile, CUDA graphs or a larger "
                     "batch would.")
    if r.get("skipped_steps"):
        items.append(f"The loss scaler skipped {r['skipped_steps']} overflowing steps.")
    if r.get("clock_differs"):
        items.append(f"Its GPU ran at a median SM clock {fmt.change(r['sm_clock_ratio'])} against {base_name}'s, so "
                     "part of the difference is the clock's (see the GPU clock section).")
    cmp = (summary.get("profile_comparison") or {}).get(name)
    if cmp:
        items.append(why(name, base_name, cmp))
    return items


def why(name: str, base_name: str, cmp: dict) -> str:
    """Which categories got faster and by how much, what the precision added, and the Amdahl bound."""
    cats = {c: r for c, r in cmp["categories"].items()
            if r["speedup"] is not None and r["base_ms"] > 0 and r.get("role") != "unattributed"}
    big = sorted(cats, key=lambda c: -max(cats[c]["base_ms"], cats[c]["ms"]))[:3]  # where the time is
    parts = [f"{c} {fmt.faster(cats[c]['speedup'])} ({cats[c]['base_ms']:.3g} -> {cats[c]['ms']:.3g} ms)"
             for c in big]
    text = f"The step profile ({name} against {base_name}, ms per step) says where: " + ", ".join(parts) + "."
    added = [f"{row['ms'] - row['base_ms']:.3g} ms of {c}" for c, row in cmp["categories"].items()
             if row.get("role") == "precision_overhead" and row["ms"] > row["base_ms"]]
    if added:
        text += f" {name} added " + " and ".join(added) + " per step."
    bound = cmp.get("amdahl_bound")
    if bound:
        text += (f" Convolutions and matmuls were {cmp['tensor_core_share']:.0%} of the fp32 step, so even if "
                 f"tensor cores made them free the step could be at most {fmt.times(bound)} faster (an Amdahl bound")
        if cmp.get("amdahl_bound_at_peak"):
            text += (f"; {fmt.times(cmp['amdahl_bound_at_peak'])} at the datasheet's {cmp['peak_ratio']:.1f}x "
                     "fp16/fp32 peak ratio")
        text += ")."
    return text


def sweep_sentence(s: dict | None) -> str:
    """How much larger a batch each precision fits than fp32."""
    if not s:
        return ""
    parts = [f"{prec} fits {row['vs_fp32']:.2f}x the batch of fp32 ({row['largest_batch']:,} against "
             f"{s['largest']['fp32']['largest_batch']:,} images{', estimated' if row['method'] == 'estimate' else ''})"
             for prec, row in s["largest"].items() if prec != "fp32" and row.get("vs_fp32")]
    return f" In the batch-size sweep, {'; '.join(parts)}." if parts else ""


def scaling_sentence(s: dict | None) -> str:
    """How each DDP variant scaled against its one-process run."""
    if not s:
        return ""
    parts = [f"{r['variant']} ran {r['speedup_vs_single']:.2f}x as fast as in one process, "
             f"{r['efficiency']:.0%} scaling efficiency" for r in s["rows"] if r["efficiency"]]
    world, backend = s["rows"][0]["world_size"], s["rows"][0]["backend"]
    said = f" Data-parallel over {world} processes ({backend}): {'; '.join(parts)}." if parts else ""
    return said + sharded.verdict_sentence(s.get("fsdp") or [])  # what sharding bought, where a variant sharded


INPUT_BOUND = 0.10  # a streamed variant whose device waited longer than this share of each step for data


def input_sentence(summary: dict, env: dict) -> str:
    """Streamed variants whose device waited for data: that part of the step no precision can speed up."""
    device = env["gpu"]["name"] if env.get("gpu") else "the CPU"
    parts = []
    for name, r in summary["variants"].items():
        share = r.get("data_time_fraction")
        if r.get("data_placement") == "stream" and share is not None and share > INPUT_BOUND:
            parts.append(f"{device} waited {share:.0%} of each {name} step for data")
    if not parts:
        return ""
    workers = {r.get("data_workers") for r in summary["variants"].values() if r.get("data_placement") == "stream"}
    now = f" ({', '.join(str(w) for w in sorted(workers, key=str))} now)" if workers else ""
    return (f" Input-bound: {'; '.join(parts)}: a faster precision cannot speed that part; raise data.workers{now}, "
            "or keep the set on the device (data.placement: device) if it fits.")


def ladder_sentence(summary: dict, env: dict) -> str:
    """Every variant against strict fp32 and against tf32: "fp16 2.10x faster than strict fp32, 1.30x faster than
    TF32"."""
    tf32, base = summary.get("tf32_baseline"), summary.get("baseline")
    if not tf32 or not base:
        return ""
    parts = []
    for name, r in summary["variants"].items():
        if name == base or r.get("speedup") is None:
            continue
        against = f", {fmt.faster(r['vs_tf32'])} than TF32" if r.get("vs_tf32") is not None else ""
        label = fmt.named(name, r)
        paired = (f" (paired check: {fmt.faster(r['paired']['median'])}"
                  f"{', the same arithmetic here' if fmt.same_arithmetic(r) else ''})" if r.get("paired") else "")
        parts.append(f"{label} {fmt.faster(r['speedup'])} than strict fp32{paired}{against}")
    if not parts:
        return ""
    closest = (summary.get("roofline") or {}).get("closest_default")
    default = {"tf32": "for this conv net the TF32 ratio is what switching from a plain PyTorch run buys",
               "fp32": "this model's FLOPs are matmuls, so a plain PyTorch run of it is closest to strict fp32"}
    text = (f" Against each rung of the ladder: {'; '.join(parts)} (PyTorch's default is TF32 convolutions and IEEE "
            f"matmuls{': ' + default[closest] if closest in default else ''}")
    if not env.get("gpu"):
        text += "; on a CPU tf32 is fp32, the same arithmetic, so its ratio to fp32 is run-to-run difference"
    return text + ")."


def paragraph(summary: dict, env: dict) -> str:
    """The whole verdict as one paragraph."""
    return " ".join(items(summary, env))


def items(summary: dict, env: dict) -> list[str]:
    """The whole verdict, one claim per item: the headline variant, the input, the ladder, the sweep, scaling."""
    extra = (input_sentence(summary, env), ladder_sentence(summary, env), sweep_sentence(summary.get("sweep")),
             scaling_sentence(summary.get("scaling")))
    return verdict_items(summary, env) + [e.strip() for e in extra if e]
