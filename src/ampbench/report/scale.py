"""The report's sections on scale: the batch-size sweep (how large a batch each precision fits, and its
throughput there) and data-parallel training (throughput per process, scaling efficiency, gradient
compression). Each is a section of ``sections.SECTIONS``, with its signature; each writes nothing when its
stage did not run.
"""

from __future__ import annotations

from ampbench.report import fmt, sharded
from ampbench.report.summary import sweep_memory


def sweep(summary: dict, env: dict, runs: dict) -> list[str]:
    """The batch-size sweep's points and the largest batch each precision fits; nothing when it did not run."""
    s = summary.get("sweep")
    if not s:
        return []
    cuda = s["device"] == "cuda"
    meter = "CUDA peak allocated" if cuda else "activations (bytes saved for backward; peak RSS says little here)"
    batches = sorted({p["batch_size"] for pts in s["points"].values() for p in pts})
    out = ["## Batch-size sweep", "",
           f"Short timed runs, not training: {s['steps']} optimizer steps per point after {s['warmup']} untimed "
           "ones, a fresh model built as training builds it (cuDNN autotuning on a GPU), the engine's step, "
           f"img/s as training measures it (p10 to p90 of the steps' rates) and {meter}. "
           f"{s['measured_points']} point(s) measured in this run, {s['reused_points']} reused from an earlier "
           "run with the same settings, data, machine and code.", "",
           "| batch | " + " | ".join(f"{p} (eager)" if p in s["eager"] else p for p in s["points"]) + " |",
           "|---|" + "---|" * len(s["points"])]
    for b in batches:
        cells = []
        for pts in s["points"].values():
            p = next((p for p in pts if p["batch_size"] == b), None)
            if p is None:
                cells.append("-")
            elif p.get("oom"):
                cells.append("out of memory")
            else:
                lo, hi = p.get("imgs_per_s_p10") or 0, p.get("imgs_per_s_p90") or 0
                cells.append(f"{p['imgs_per_s']:,.0f} img/s ({lo:,.0f} to {hi:,.0f}), "
                             f"{(sweep_memory(p, s['device']) or 0) / fmt.MIB:,.1f} MiB")
        out.append(f"| {b} | " + " | ".join(cells) + " |")
    out.append("")
    if s["eager"]:
        out += [f"{', '.join(s['eager'])} ran eager (without torch.compile, under which alone torchao's low-precision "
                "training is fast): " + ("a CPU runs it so" if not cuda else "train.compile is false") + ".", ""]
    out += [f"Could not be made: {p['precision']} at batch {p['batch_size']} ({p['error']})." for p in s["not_made"]]
    out += [""] if s["not_made"] else []
    if s["left_out"]:  # the CPU budget: the batches a CPU would have taken minutes over, each named
        out += [f"Left out: {p['precision']} at batch {p['batch_size']}, {p['why']}." for p in s["left_out"]]
        out += ["", "Raise sweep.cpu_point_budget_s (or set it to 0) to measure them on this CPU; a GPU measures "
                "every point.", ""]
    if not s["largest"]:
        return out
    out += ["Largest batch that fits:", "", "| precision | largest batch | vs fp32 | how | limit |",
            "|---|---|---|---|---|"]
    for prec, r in s["largest"].items():
        limit = f"{r['limit_bytes'] / fmt.GIB:.1f} GiB ({r['limit']})" if r.get("limit_bytes") else "n/a"
        notes = "".join(f"; {n}" for n in r.get("notes") or [])  # batches that did not run, and why
        out.append(f"| {prec} | {fmt.num(r.get('largest_batch'), ',', 'n/a')} | {fmt.times(r.get('vs_fp32'))} "
                   f"| {r['method']}: {r['how']}{notes} | {limit} |")
    if not cuda:
        out += ["", "On a CPU nothing runs out of memory, so these are estimates from the measured bytes per "
                "image, not measurements; on a GPU the sweep searches for the largest batch that runs."]
    return out + [""]


def scaling(summary: dict, env: dict, runs: dict) -> list[str]:
    """Data-parallel throughput, scaling efficiency and gradient compression; nothing for one process."""
    s = summary.get("scaling")
    if not s:
        return []
    fs = {c["variant"]: c for c in s.get("fsdp") or []}
    out = [f"## Past one process: data-parallel training (DDP{', FSDP' if fs else ''})", "",
           "How each data-parallel variant scaled against the same precision in one process.", "",
           "| variant | processes | backend | gradients sent as | img/s, all processes | img/s per process "
           "| against one process | scaling efficiency | "
           + ("collectives per step (profile) | step time waiting on them (DDP) or in them (FSDP) |" if fs else
              "all-reduce per step (profile) | step time waiting on the all-reduce |"),
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in s["rows"]:
        against = (f"{r['speedup_vs_single']:.2f}x `{r['single_variant']}`" if r["speedup_vs_single"]
                   else "no one-process run")
        comm = sharded.sent(fs[r["variant"]]) if r["variant"] in fs else \
            {"none": "fp32", None: "fp32"}.get(r["grad_comm"], r["grad_comm"])
        wait = fmt.pct(r["exposed_comm_share"])
        if r.get("collectives_share") is not None:  # FSDP: the profile's share, gloo's emulated
            wait = (f"{fmt.pct(r['collectives_share'])} in them (profile"
                    f"{', emulated: gloo' if r['backend'] == 'gloo' else ''})")
        out.append(f"| {r['variant']} | {r['world_size']} | {r['backend']} | {comm} | {r['imgs_per_s'] or 0:,.0f} "
                   f"| {r['imgs_per_s_per_process'] or 0:,.0f} | {against} | {fmt.pct(r['efficiency'])} "
                   f"| {fmt.ms(r['comm_ms_per_step'])} | {wait} |")
    out += ["", "img/s counts every process's images per wall second of the slowest process; peak memory in the "
            "results table is the largest process's. Scaling efficiency: that throughput over the number of "
            "processes times the throughput of the variant with the same precision and accumulation that trained "
            "in one process (`ddp: false`) here, with one process's share of the machine (one GPU; on a CPU, the "
            "threads torchrun gives each process); 100% is perfect scaling. The step time waiting on the "
            "all-reduce is measured after training: the same DDP steps timed with and without their gradient "
            "all-reduce (`no_sync`), slowest process each; the all-reduce that overlaps the backward pass costs "
            "nothing there. With accumulation, micro-batches but the last of each step run under `no_sync`: one "
            "all-reduce per optimizer step. Evaluation is sharded over the processes (rank 0's BatchNorm "
            "statistics), its sums all-reduced. All-reduce per step is the time of the communication ops in the step "
            "profile (on a CPU their own time in gloo, much of it overlapping the backward pass)."
            + (" Under FSDP a step without its collectives is no step (the all-gathers bring the weights), so its "
               "figure is the profile's share of the step spent in them, overlapped or not: not a wait. On gloo it "
               "is emulated, not what NCCL would take: gloo runs the reduce-scatter as an all-reduce, on the CPU's "
               "own threads." if fs else ""), ""]
    threads = sorted({(r["threads"], r["single_threads"]) for r in s["rows"] if r.get("single_threads")})
    if threads:
        out += ["CPU threads: " + "; ".join(f"{a} per DDP process, {b} in the one-process run" for a, b in threads)
                + ".", ""]
    missing = [r["variant"] for r in s["rows"] if not r["speedup_vs_single"]]
    if missing:
        out += [f"No one-process run of the same precision and accumulation as {', '.join(missing)} ran here, so "
                "there is no scaling efficiency for it: add a variant with `ddp: false` to measure one.", ""]
    out += sharded.lines(s.get("fsdp") or [])
    for c in s["grad_comm"]:
        if c["against"] is None:
            out += [f"`{c['variant']}` sends its gradients as {c['grad_comm']}, but no variant of the same precision "
                    "and accumulation sent them as fp32, so its effect is not measured here.", ""]
            continue
        out += [f"Gradients sent as {c['grad_comm']} (`{c['variant']}`) against fp32 (`{c['against']}`): "
                f"{fmt.against(c)}; the step waited {fmt.pct(c['exposed_comm_share'])} of its time on the all-reduce "
                f"against {fmt.pct(c['against_exposed_comm_share'])}. Compression halves the bytes sent; it pays where "
                "the all-reduce is exposed, not where it hides behind the backward pass.", ""]
    return out
