"""FSDP beside DDP: what the report says of a sharded variant against the DDP one of the same precision, accumulation
and processes (``summary.scaling``'s ``fsdp`` entries, and their lines in the data-parallel section)."""

from __future__ import annotations

from ampbench.report import fmt
from ampbench.report.summary import _same_work, ratio


def ddp_counted(params: int, trained: int, state_per_param: int, world_size: int, grad_bytes: int = 4) -> dict:
    """What DDP holds per rank and sends per optimizer step, counted as FSDP's are (``train.fsdp``): the whole fp32
    parameters, their gradients, the buckets DDP all-reduces them in (a copy: ``gradient_as_bucket_view`` is off)
    and the optimizer's state on every rank, and a ring all-reduce of the gradients (2 (N-1)/N of them) in fp32, or
    in the 2-byte dtype ``grad_comm`` compresses to (``grad_bytes``)."""
    parts = {"parameters": 4 * params, "gradients": 4 * trained, "gradient_buckets": 4 * trained,
             "optimizer_state": 4 * trained * state_per_param}
    return {"memory_parts": parts, "memory_per_rank": sum(parts.values()),
            "wire_bytes_per_step": int(2 * (world_size - 1) / world_size * trained * grad_bytes)}


def ddp_counts(m: dict, world: int, f: dict) -> dict:
    """``ddp_counted`` for the DDP variant ``m`` (its metrics), from an FSDP run's ``fsdp`` metrics ``f`` (the
    model's counts)."""
    return ddp_counted(f["param_count"], f["trained_count"], f["state_per_param"], world,
                       2 if m.get("grad_comm") in ("fp16", "bf16") else 4)


def against_ddp(row: dict, rows: list[dict], metrics: dict[str, dict]) -> dict:
    """An FSDP variant beside DDP: memory per rank and bytes per step against DDP's, counted for the same model
    (DDP sends the fp32 gradients whatever the autocast, so its counts need no DDP run); and beside the DDP variant
    of the same precision, accumulation and processes where one ran (fp32 gradient communication first):
    throughput, accuracy and peak memory (measured)."""
    m, f = metrics[row["variant"]], metrics[row["variant"]]["fsdp"]
    same = [r for r in rows if r["strategy"] == "ddp" and r["world_size"] == row["world_size"]
            and _same_work(metrics[r["variant"]]) == _same_work(m)]
    base = min(same, key=lambda r: r["grad_comm"] not in (None, "none"), default=None)
    wire = sum(c["bytes"] for c in f["wire_bytes_per_step"].values())
    counted = ddp_counts(metrics[base["variant"]] if base else {}, row["world_size"], f)
    out = {"variant": row["variant"], "against": base["variant"] if base else None,
           "world_size": row["world_size"], "precision": m.get("precision"), "accum_steps": m.get("accum_steps"),
           "param_dtype": f["param_dtype"], "reduce_dtype": f["reduce_dtype"],
           "memory_per_rank": sum(f["memory_per_rank"].values()), "memory_parts": f["memory_per_rank"],
           "wire_bytes_per_step": wire, "wire": f["wire_bytes_per_step"], "peak_mem_bytes": m.get("peak_mem_bytes"),
           "against_memory_per_rank": counted["memory_per_rank"],
           "against_wire_bytes_per_step": counted["wire_bytes_per_step"],
           "compiled_blocks": f.get("compiled_blocks") or [], "eager_blocks": f.get("eager_blocks") or []}
    if base:
        acc, b_acc = row["final_acc"], base["final_acc"]
        out.update(against_grad_comm=base["grad_comm"] or "none",
                   against_compiled=bool(metrics[base["variant"]].get("compiled")),
                   throughput_ratio=ratio(row["imgs_per_s"], base["imgs_per_s"]),
                   acc_diff=acc - b_acc if acc is not None and b_acc is not None else None,
                   against_peak_mem_bytes=base["peak_mem_bytes"])
    return out


def against_fp32(comparisons: list[dict]) -> list[dict]:
    """``comparisons`` (``against_ddp``'s), each lower-precision one with what its precision bought under FSDP: its
    memory per rank and bytes per step against the FSDP fp32 variant of the same processes and accumulation."""
    for c in comparisons:
        ref = next((r for r in comparisons if r["precision"] == "fp32" and r["world_size"] == c["world_size"]
                    and r["accum_steps"] == c["accum_steps"] and r is not c), None)
        if ref and c["precision"] not in ("fp32", "tf32"):
            c.update(fp32_variant=ref["variant"], fp32_memory_per_rank=ref["memory_per_rank"],
                     fp32_wire_bytes_per_step=ref["wire_bytes_per_step"])
    return comparisons


PARTS = ("parameters", "gradients", "optimizer_state", "gathered_blocks", "unsharded_block_gradients",
         "accumulated_gradients")


def _mib(b) -> str:
    return f"{b / fmt.MIB:,.2f} MiB" if b is not None else "n/a"


def gathered(c: dict) -> str:
    """The dtypes a variant's blocks are all-gathered in, as the report says them: "bf16", "float8 and bf16" (a
    converting rung's weights in its own format beside the rest), "fp32" (no policy); BatchNorm's and the root's
    own fp32 left out."""
    low = [d for d in (c.get("wire", {}).get("all_gather", {}).get("by_dtype") or {}) if d != "float32"]
    low = sorted(low, key=lambda d: d.startswith("float8"), reverse=True)  # the low format first
    return " and ".join(fmt.dtype(d) for d in low) or fmt.dtype(c["param_dtype"])


def compiled(c: dict) -> str:
    """How much of a variant torch.compile compiled under FSDP: block by block (DDP compiles the whole model), a
    block holding a BatchNorm unit of its own left eager; "" where it ran eager."""
    done, eager = c.get("compiled_blocks") or [], c.get("eager_blocks") or []
    if not done and not eager:
        return ""
    return (f", {len(done)} of {len(done) + len(eager)} blocks compiled, the root's own layers eager"
            + (f" (left eager: {', '.join(eager)}, each holding a BatchNorm sharded apart)" if eager else ""))


def sent(c: dict) -> str:
    """The table's "gradients sent as" cell of an FSDP variant."""
    return f"{fmt.dtype(c['reduce_dtype'])} reduce-scatter, {gathered(c)} all-gather"


def lines(comparisons: list[dict]) -> list[str]:
    """Each FSDP variant against DDP: throughput, accuracy, memory per rank and bytes per step."""
    out = []
    for c in comparisons:
        parts = ", ".join(f"{k.replace('_', ' ')} {_mib(c['memory_parts'][k])}" for k in PARTS
                          if k in c["memory_parts"])
        wire = ", ".join(f"{k.replace('_', '-')} {_mib(w['bytes'])} in "
                         + " and ".join(fmt.dtype(d) for d in (w.get("by_dtype") or {w["dtype"]: 0}))
                         for k, w in c["wire"].items())
        head = (f"FSDP (`{c['variant']}`, {c['world_size']} processes, {gathered(c)} gathered, "
                f"{fmt.dtype(c['reduce_dtype'])} reduced{compiled(c)})")
        ddp = (f"against {_mib(c['against_memory_per_rank'])} (every DDP rank holds the whole fp32 parameters, "
               "gradients, the buckets it all-reduces them in and the optimizer state)")
        bought = (f" Against FSDP fp32 (`{c['fp32_variant']}`), {gathered(c)} gathers "
                  f"{_held(c['memory_per_rank'], c['fp32_memory_per_rank'], 'hold')} and "
                  f"{_sent(c['wire_bytes_per_step'], c['fp32_wire_bytes_per_step'], 'send')}."
                  if c.get("fp32_variant") else "")
        sent_vs = f"against {_mib(c['against_wire_bytes_per_step'])} (DDP's all-reduce of the fp32 gradients)"
        if not c["against"]:
            out += [f"{head}: memory per rank {_mib(c['memory_per_rank'])} counted ({parts}) {ddp}; sent per "
                    f"optimizer step by each rank {_mib(c['wire_bytes_per_step'])} ({wire}) {sent_vs}.{bought} "
                    "No DDP variant of the same precision and accumulation ran here to set its throughput "
                    "beside: add one.", ""]
            continue
        whole = (", compiled whole, where FSDP's blocks left eager are not: the throughput sets the two apart too"
                 if c.get("against_compiled") and c.get("eager_blocks") else "")
        out += [f"{head} against DDP (`{c['against']}`, gradients all-reduced in "
                f"{fmt.dtype({'none': 'float32'}.get(c['against_grad_comm'], c['against_grad_comm']))}{whole}): "
                f"{fmt.against(c)}. "
                f"Memory per rank, counted: {_mib(c['memory_per_rank'])} ({parts}) {ddp}. Sent per optimizer step "
                f"by each rank: {_mib(c['wire_bytes_per_step'])} ({wire}) against "
                f"{_mib(c['against_wire_bytes_per_step'])} (the all-reduce).{bought} Peak memory, measured: "
                f"{_mib(c['peak_mem_bytes'])} against {_mib(c['against_peak_mem_bytes'])}.", ""]
    if comparisons:
        out += ["Counted: from the model's sizes and the dtypes, a ring's bytes ((N-1)/N of each collective's "
                "whole; an all-gather per micro-batch for the forward and again for the backward, the weights "
                "resharded after the forward); the bytes FSDP's collectives send are checked against the count in "
                "the tests. The gathered blocks (the one running and the one prefetched) and a block's unsharded "
                "gradients are the transient parts; with accumulation every gradient is held whole until the last "
                "micro-batch. On a CPU the measured peak is the process's peak RSS, which the data and the runtime "
                "dominate; gloo runs a reduce-scatter as an all-reduce, so its times are not NCCL's.", ""]
    return out


def _change(new: float, old: float) -> str:
    """"17% less", "5% more" or "the same": ``new`` against ``old`` (a count, never 0 here)."""
    d = new / old - 1
    return "the same" if abs(d) < 0.005 else f"{abs(d):.0%} {'less' if d < 0 else 'more'}"


def _held(new: float, old: float, verb: str) -> str:
    return f"{verb} {_change(new, old)} memory per rank"


def _sent(new: float, old: float, verb: str) -> str:
    return f"{verb} {_change(new, old)} bytes" if _change(new, old) != "the same" else f"{verb} as many bytes"


def verdict_sentence(comparisons: list[dict]) -> str:
    """What sharding bought, in the verdict: memory per rank and bytes moved against DDP's (counted), and what a
    lower precision bought against FSDP fp32."""
    said = []
    for c in comparisons:
        if c.get("fp32_variant"):
            said.append(f"{c['variant']} ({gathered(c)} gathers) "
                        f"{_held(c['memory_per_rank'], c['fp32_memory_per_rank'], 'held')} and "
                        f"{_sent(c['wire_bytes_per_step'], c['fp32_wire_bytes_per_step'], 'sent')} against "
                        f"{c['fp32_variant']}")
        else:
            said.append(f"{c['variant']} held {_mib(c['memory_per_rank'])} per rank against DDP's "
                        f"{_mib(c['against_memory_per_rank'])} and sent {_mib(c['wire_bytes_per_step'])} a step "
                        f"against {_mib(c['against_wire_bytes_per_step'])}"
                        + (f", at {c['throughput_ratio']:.2f}x DDP's throughput" if c.get("throughput_ratio") else ""))
    return f" Sharded with FSDP (counted): {'; '.join(said)}." if said else ""
