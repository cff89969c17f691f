"""The report's data-parallel section: throughput per process, scaling efficiency, the effect of grad_comm.

A variant that trained under DDP (world size > 1) is set against the variant
of the same precision and accumulation that trained in one process
(``ddp: false``) in the same pipeline, and one with compressed gradient
communication against the one with fp32 communication. Nothing is compared
across pipelines: a pair that did not both run here is said to be missing.
"""

from __future__ import annotations


def _key(m: dict) -> tuple:
    return m.get("precision"), m.get("accum_steps")


def summarize(runs: dict[str, dict]) -> dict | None:
    """Rows per DDP variant, and the grad_comm comparisons; None when every variant ran in one process."""
    metrics = {name: run["metrics"] for name, run in runs.items()}
    if not any((m.get("world_size") or 1) > 1 for m in metrics.values()):
        return None
    single = {}
    for name, m in metrics.items():
        if (m.get("world_size") or 1) == 1 and m.get("imgs_per_s"):
            single.setdefault(_key(m), name)
    rows, comms = [], []
    for name, m in metrics.items():
        world = m.get("world_size") or 1
        if world == 1:
            continue
        ips, ref = m.get("imgs_per_s"), single.get(_key(m))
        ref_ips = metrics[ref]["imgs_per_s"] if ref else None
        profile = m.get("profile") or {}
        comm = profile.get("communication") or {}
        comm_ms = ((profile.get("categories") or {}).get("communication") or {}).get("ms_per_step")
        rows.append({"variant": name, "world_size": world, "backend": m.get("backend"), "grad_comm": m.get("grad_comm"),
                     "imgs_per_s": ips, "imgs_per_s_per_process": ips / world if ips else None,
                     "single_variant": ref, "single_imgs_per_s": ref_ips,
                     "threads": m.get("cpu_threads"),
                     "single_threads": metrics[ref].get("cpu_threads") if ref and m.get("device") == "cpu" else None,
                     "speedup_vs_single": ips / ref_ips if ips and ref_ips else None,
                     "efficiency": ips / (world * ref_ips) if ips and ref_ips else None,
                     "exposed_comm_share": comm.get("exposed_share"), "comm_ms_per_step": comm_ms,
                     "peak_mem_bytes": m.get("peak_mem_bytes"), "final_acc": m.get("final_acc")})
    for row in rows:
        if row["grad_comm"] in (None, "none"):
            continue
        base = next((r for r in rows if r["grad_comm"] == "none" and r["world_size"] == row["world_size"]
                     and _key(metrics[r["variant"]]) == _key(metrics[row["variant"]])), None)
        if base is None:
            comms.append({"variant": row["variant"], "grad_comm": row["grad_comm"], "against": None})
            continue
        acc, b_acc = row["final_acc"], base["final_acc"]
        comms.append({"variant": row["variant"], "grad_comm": row["grad_comm"], "against": base["variant"],
                      "throughput_ratio": row["imgs_per_s"] / base["imgs_per_s"]
                      if row["imgs_per_s"] and base["imgs_per_s"] else None,
                      "acc_diff": acc - b_acc if acc is not None and b_acc is not None else None,
                      "exposed_comm_share": row["exposed_comm_share"],
                      "against_exposed_comm_share": base["exposed_comm_share"]})
    return {"rows": rows, "grad_comm": comms}


def sentence(s: dict | None) -> str:
    """The verdict's sentence: how each DDP variant scaled against its one-process run."""
    if not s:
        return ""
    parts = [f"{r['variant']} ran {r['speedup_vs_single']:.2f}x as fast as in one process, "
             f"{r['efficiency']:.0%} scaling efficiency" for r in s["rows"] if r["efficiency"]]
    if not parts:
        return ""
    world, backend = s["rows"][0]["world_size"], s["rows"][0]["backend"]
    return f" Data-parallel over {world} processes ({backend}): {'; '.join(parts)}."


def _pct(v) -> str:
    return "n/a" if v is None else f"{v:.0%}"


def _ms(v) -> str:
    return "n/a" if v is None else f"{v:.3g} ms"


def lines(s: dict | None) -> list[str]:
    """The report's section, or nothing when every variant ran in one process."""
    if not s:
        return []
    out = ["## Past one process: data-parallel training (DDP)", "",
           "| variant | processes | backend | gradients sent as | img/s, all processes | img/s per process "
           "| against one process | scaling efficiency | all-reduce per step (profile) "
           "| step time waiting on the all-reduce |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in s["rows"]:
        against = (f"{r['speedup_vs_single']:.2f}x `{r['single_variant']}`" if r["speedup_vs_single"]
                   else "no one-process run")
        comm = {"none": "fp32", None: "fp32"}.get(r["grad_comm"], r["grad_comm"])
        out.append(f"| {r['variant']} | {r['world_size']} | {r['backend']} | {comm} | {r['imgs_per_s'] or 0:,.0f} "
                   f"| {r['imgs_per_s_per_process'] or 0:,.0f} | {against} | {_pct(r['efficiency'])} "
                   f"| {_ms(r['comm_ms_per_step'])} | {_pct(r['exposed_comm_share'])} |")
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
            "profile (on a CPU their own time in gloo, much of it overlapping the backward pass).", ""]
    threads = sorted({(r["threads"], r["single_threads"]) for r in s["rows"] if r.get("single_threads")})
    if threads:
        out += ["CPU threads: " + "; ".join(f"{a} per DDP process, {b} in the one-process run" for a, b in threads)
                + ".", ""]
    missing = [r["variant"] for r in s["rows"] if not r["speedup_vs_single"]]
    if missing:
        out += [f"No one-process run of the same precision and accumulation as {', '.join(missing)} ran here, so "
                "there is no scaling efficiency for it: add a variant with `ddp: false` to measure one.", ""]
    for c in s["grad_comm"]:
        if c["against"] is None:
            out += [f"`{c['variant']}` sends its gradients as {c['grad_comm']}, but no variant of the same precision "
                    "and accumulation sent them as fp32, so its effect is not measured here.", ""]
            continue
        ratio = f"{c['throughput_ratio']:.2f}x the throughput" if c["throughput_ratio"] else "throughput n/a"
        acc = f", final accuracy {c['acc_diff'] * 100:+.2f} points" if c["acc_diff"] is not None else ""
        out += [f"Gradients sent as {c['grad_comm']} (`{c['variant']}`) against fp32 (`{c['against']}`): {ratio}"
                f"{acc}; the step waited {_pct(c['exposed_comm_share'])} of its time on the all-reduce against "
                f"{_pct(c['against_exposed_comm_share'])}. Compression halves the bytes sent; it pays where the "
                "all-reduce is exposed, not where it hides behind the backward pass.", ""]
    return out
