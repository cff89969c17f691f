"""The report's roofline sections: what the datasheet allows each precision for this model beside what was
measured, and ours beside the article's (its quoted figures, and its card's roofline)."""

from __future__ import annotations

from ampbench import precision
from ampbench.report import fmt
from ampbench.report.fmt import speedup as _speedup

ARTICLE = {
    "hardware": 'the article\'s "NVIDIA 5090 (24GB)", CUDA 12.1, ResNet-18, CIFAR-10, batch 256',
    "rows": [
        {"precision": "FP32", "memory": "18.7 GB", "imgs_per_s": "1,200", "epoch": "3m21s"},
        {"precision": "FP16", "memory": "9.2 GB", "imgs_per_s": "3,800", "epoch": "1m02s"},
    ],
    "speedup": "3.2x", "memory_change": "-51%",
}


def article(summary: dict, env: dict, runs: dict) -> list[str]:
    """Our ratios beside the article's 3.2x and -51%, and the article's own table."""
    lines = ["## Ours beside the article's", "",
             "Our ratios beside the article's claim (3.2x faster, -51% memory), and the article's own table.", "",
             "| | speedup vs FP32 | peak memory vs FP32 |", "|---|---|---|",
             f"| the article (its GPU, quoted) | {ARTICLE['speedup']} | {ARTICLE['memory_change']} |"]
    for name, r in summary["variants"].items():
        if name != summary["baseline"]:
            lines.append(f"| {name}, this run | {_speedup(r)} | {fmt.change(r.get('mem_ratio'))} |")
    lines += [""] + _article_roofline(summary.get("roofline"))
    lines += [f"The article's own table ({ARTICLE['hardware']}; quoted, not measured here):", "",
              "| precision | memory | img/s | time per epoch |", "|---|---|---|---|"]
    lines += [f"| {r['precision']} | {r['memory']} | {r['imgs_per_s']} | {r['epoch']} |" for r in ARTICLE["rows"]]
    return lines + ["", f"The article's claim: {ARTICLE['speedup']} faster, {ARTICLE['memory_change']} memory.", ""]


def _article_roofline(found: dict | None) -> list[str]:
    a = (found or {}).get("article")
    if not a:
        return []
    r, claimed = a["fp16_vs_fp32"], float(ARTICLE["speedup"].rstrip("x"))
    return [f"On the article's {a['gpu']}, the roofline of ResNet-18 at batch {a['batch']} (counted here, op by op, at "
            f"that card's datasheet peaks) gives fp16 {fmt.times(r)} strict fp32: a GeForce card runs fp16 with fp32 "
            "accumulation at twice its fp32 rate, and fp16 halves the bytes each op moves. That is the ratio if both "
            "precisions ran every kernel equally close to its peak, not a bound on a measured ratio. The article's "
            f"{ARTICLE['speedup']} is {claimed / r:.2f}x that ratio, so its FP32 run reached {r / claimed:.0%} of the "
            "share of its peak its FP16 run reached: a fact about its baseline, which ran further below its peak "
            "(eager overhead, the input pipeline, or a setting that held fp32 back), not a gain beyond the hardware, "
            "and not one a precision can be credited with.", ""]


def _census_lines(found: dict) -> list[str]:
    """What each converting rung converts in this model (roofline.json keeps each census under its rung)."""
    return [line for name in precision.converting(n for n in found if n in precision.RUNGS)
            for line in precision.rung(name).census_lines(found[name])]


def roofline(summary: dict, env: dict, runs: dict) -> list[str]:
    """What the datasheet allows each precision for this model, beside what was measured."""
    found = summary.get("roofline")
    if not found:
        return []
    lines = ["## What the datasheet allows: the roofline", ""]
    if found.get("error"):
        return lines + [f"Not counted: {found['error']}.", ""]
    lines.append(
        f"One training step of {found['model']} at batch {found['batch']} is {found['flops'] / 1e9:,.1f} GFLOP and "
        f"moves {found['bytes'] / 1e9:,.2f} GB in fp32 (counted op by op on meta tensors). "
        f"{found['conv_flop_share']:.0%} of its FLOPs are convolutions, so plain PyTorch (TF32 convolutions, IEEE "
        f"matmuls) trains it closest to {'tf32' if found['closest_default'] == 'tf32' else 'strict fp32'}: that "
        "column is what a user of plain PyTorch starts from.")
    lines += _census_lines(found)
    gpu = found.get("gpu")
    if not gpu:
        where = f"{env['gpu']['name']} is not in the datasheet table" if env.get("gpu") else "this ran on a CPU"
        return lines + ["", f"There is no roofline to set beside the measurements: {where}. `ampbench roofline --gpu "
                        "all` gives each precision's roofline on every GPU of the table.", ""]
    by_precision: dict[str, list[str]] = {}
    for name, m in found["measured"].items():
        by_precision.setdefault(m["precision"], []).append(
            f"{name}: {fmt.times(m['speedup'])} measured{' eager' if m.get('eager') else ''}, {m['of_roofline']:.0%} "
            "of the roofline's img/s")
    lines += ["", f"On {gpu['name']} ({gpu['source']}; {gpu['bandwidth_gbps']:,} GB/s):", ""]
    return lines + roofline_table(gpu["table"], by_precision) + ["", roofline_note(found.get("launch_us")), ""] \
        + _host_work(found, summary["variants"])


def _host_work(found: dict, rows: dict) -> list[str]:
    """For each variant whose precision the roofline calls launch-bound, the engine's own host work per step (its
    step profile) beside the launch floor: how much of such a step is the engine's."""
    lines = []
    for name, m in found["measured"].items():
        cell = found["gpu"]["table"].get(m["precision"]) or {}
        host = (rows[name].get("profile") or {}).get("host_ms_per_step")
        if cell.get("launch_bound") and host is not None:
            lines.append(f"`{name}` is launch-bound here: launching its {cell['kernels']:,} kernels one by one takes "
                         f"at least {fmt.ms(cell['launch_ms'])} a step. Its step profile measured the host's work in a "
                         f"step (Python, dispatch and launches, waits for the device excluded; under torch.profiler, "
                         f"which adds to each op's host time) at {fmt.ms(host)}, {host / cell['launch_ms']:.2f}x that "
                         "floor.")
    return lines + [""] if lines else []


def roofline_note(launch_us: float | None, inference: bool = False) -> str:
    """What a roofline is, with the launch floor it was counted with (roofline.json's ``launch_us``); ``inference``:
    of one forward pass (``ampbench roofline --inference``)."""
    return ROOFLINE_NOTE.format(what="one inference pass (forward only)" if inference else "one training step",
                                launch=f"{launch_us:g} us" if launch_us else "a few microseconds")


ROOFLINE_NOTE = (
    "What a roofline is: {what} counted op by op (FLOPs and the bytes each op reads and writes; eager "
    "kernels, no fusion, fp8's scaling as torch.compile fuses it), each op at max(FLOPs / the datasheet peak of the "
    "dtype it runs in, bytes / memory bandwidth), and at least the host's time to launch its kernels one by one "
    "({launch} each: a step whose launches take longer than its kernels is launch-bound, and its precision barely "
    "matters; torch.compile and CUDA graphs launch fewer). Its ratio is what switching precision would buy if both "
    "precisions ran every kernel equally close to the datasheet's peaks: a ratio of two least times, which bounds "
    "neither measured time nor their ratio. Real kernels run below peak, and unevenly: a measured speedup above the "
    "roofline ratio means the slower precision ran further below its peak (a fact about the baseline, not a gain "
    "beyond the hardware); one below it, that the faster precision did. Every byte is charged to DRAM: an L2 cache "
    "(96 MB on an RTX 5090, 50 MB on an H100) holds a layer's activations between its ops when they fit, and fp16's "
    "fit where fp32's, twice the size, may not, so on such layers the count understates what fp16 gains.")


def roofline_table(table: dict[str, dict | None], measured: dict[str, list[str]] | None = None) -> list[str]:
    """One GPU's roofline per precision (``roofline.table``), with what was measured beside it when given."""
    extra = " measured |" if measured is not None else ""
    lines = ["| precision | roofline step | roofline img/s | vs strict fp32 | vs tf32 | memory-bound share of the "
             "kernels | kernels, their launches |" + extra, "|---|---|---|---|---|---|---|" + ("---|" if extra else "")]
    for rung, r in table.items():
        if r is None or "na" in r:
            why = r["na"] if r else f"no {rung} tensor cores"
            lines.append(f"| {rung} | n/a: {why} | | | | | |" + (" |" if extra else ""))
            continue
        cell = f" {'; '.join(measured.get(rung, [])) or 'not run'} |" if measured is not None else ""
        bound = " **launch-bound**" if r.get("launch_bound") else ""
        launches = f"{r['kernels']:,}, {fmt.ms(r['launch_ms'])}" if r.get("kernels") else "n/a"
        lines.append(f"| {rung} | {fmt.ms(r['step_ms'])}{bound} | {r['imgs_per_s']:,.0f} | {fmt.times(r['vs_fp32'])} "
                     f"| {fmt.times(r['vs_tf32'])} | {r['memory_bound_share']:.0%} | {launches} |" + cell)
    return lines


def data_parallel_table(table: dict[str, dict], link: dict | None, nproc: int, strategy: str) -> list[str]:
    """``nproc`` GPUs' roofline per precision (``links.table``): one GPU's kernels, the collectives' bytes and time
    on ``link``, the step, img/s over all GPUs, what bounds it; then each precision's memory per GPU by part."""
    on = f"on {link['name']}" if link else "on the link (n/a)"
    lines = [f"| precision | one GPU's step | sent per GPU per step | {on} | step, {nproc} GPUs | img/s, {nproc} GPUs "
             f"| bound by | memory per GPU (counted) |", "|---|---|---|---|---|---|---|---|"]
    parts = []
    for rung, r in table.items():
        if "na" in r:
            lines.append(f"| {rung} | n/a: {r['na']} | | | | | | |")
            continue
        sent = "; ".join(f"{k.replace('_', '-')} {fmt.size(w['bytes'])} "
                         + "+".join(fmt.dtype(d) for d in (w.get("by_dtype") or {w["dtype"]: 0}))
                         for k, w in r["wire"].items())
        comm = fmt.ms(r["comm_ms"]) if r["comm_ms"] is not None else "n/a"
        step = fmt.ms(r["step_ms"]) if r["step_ms"] is not None else "n/a"
        ips = f"{r['imgs_per_s']:,.0f}" if r["imgs_per_s"] is not None else "n/a"
        bound = {"collectives": "**the collectives**", None: "n/a"}.get(r["bound"], r["bound"])
        lines.append(f"| {rung} | {fmt.ms(r['gpu_step_ms'])} | {sent} | {comm} | {step} | {ips} | {bound} | "
                     f"{fmt.size(sum(r['memory_per_gpu'].values()))} |")
        parts.append(f"- {rung}: " + ", ".join(f"{k.replace('_', ' ')} {fmt.size(v)}"
                                                for k, v in r["memory_per_gpu"].items()))
    what = ("FSDP holds 1/N of the fp32 parameters, gradients and optimizer state, and two blocks gathered at a time"
            if strategy == "fsdp" else "DDP holds the whole model, its gradients, their buckets and the optimizer "
            "state on every GPU")
    return lines + ["", f"Memory per GPU by part ({what}; the activations come on top, the same under both "
                    "strategies at the same batch per GPU):", *parts]
