"""The report's numbers, no prose: the baseline, each variant's figures and ratios with their intervals, the
profile comparison, time to accuracy, the batch-size sweep and data-parallel scaling.

Everything comes from the run folders (``results.read_runs``) and the sweep's ``sweep.json``; what summarize
returns is written as ``summary.json`` (DVC metrics) and is all the sections need besides the runs themselves.
"""

from __future__ import annotations

import math

from ampbench import precision
from ampbench.measure import stats

# Figures copied as they are from each run's metrics.json into its summary row.
COPIED = ("precision", "accum_steps", "imgs_per_s", "imgs_per_s_std", "epoch_time_s", "peak_mem_bytes",
          "peak_reserved_bytes", "mem_meter", "activation_bytes", "param_bytes", "grad_bytes",
          "optimizer_state_bytes", "dataset_bytes", "final_acc", "final_acc_std", "best_acc", "skipped_steps",
          "nonfinite_loss_steps", "final_loss_scale", "data_time_fraction", "accum_grad_max_rel_diff",
          "achieved_tflops", "fraction_of_peak", "peak_tflops_datasheet", "peak_precision", "world_size", "backend",
          "grad_comm", "imgs_per_s_per_process", "peak_window", "eval_peak_mem_bytes", "first_step_peak_mem_bytes",
          "gpu_sm_clock_mhz_median", "gpu_sm_clock_mhz_p10_p90", "gpu_temperature_c_median", "gpu_power_w_median",
          "energy_per_image_j",
          "started_at", "fp8_recipe", "fp8_layers", "micro_batch_size", "optimizer", "optimizer_impl",
          "optimizer_state_kept", "clip_grad_norm", "grad_norm_logged", "data_placement", "data_workers", "not_made")
CLOCK_TOLERANCE = 0.05  # a variant whose median SM clock differs more from the baseline's ran on another GPU state


def ratio(a, b) -> float | None:
    """a / b, or None when either is missing or b is zero."""
    if a is None or b is None or not b:
        return None
    return a / b


def pick_baseline(runs: dict[str, dict]) -> str | None:
    """The fp32, no-accumulation run the ratios are taken against (``fp32`` if so named)."""
    candidates = [n for n, r in runs.items()
                  if r["metrics"]["precision"] == "fp32" and r["metrics"]["accum_steps"] == 1]
    if "fp32" in candidates:
        return "fp32"
    return candidates[0] if candidates else None


def pick_tf32(runs: dict[str, dict]) -> str | None:
    """The tf32, no-accumulation run every variant is also set against (PyTorch's default for convolutions)."""
    candidates = [n for n, r in runs.items()
                  if r["metrics"]["precision"] == "tf32" and r["metrics"]["accum_steps"] == 1]
    return "tf32" if "tf32" in candidates else (candidates[0] if candidates else None)


def speedup_with_ci(base: dict, run: dict) -> dict:
    """The speedup, one definition for one run and for repeats: the variant's img/s over the baseline's (img/s
    being timed images over summed step time; over repeats, its mean). Its 95% interval: a t-interval over
    the repeats when both have 2 or more, else a bootstrap over one process's step times (the ratio of mean
    step times, resampled, scaled to the img/s ratio, which differs from it only by uneven batch sizes)."""
    bm, m = base["metrics"], run["metrics"]
    speedup = ratio(m.get("imgs_per_s"), bm.get("imgs_per_s"))
    b_runs, v_runs = bm.get("imgs_per_s_runs") or [], m.get("imgs_per_s_runs") or []
    if len(b_runs) >= 2 and len(v_runs) >= 2:
        _, lo, hi = stats.ratio_ci_from_repeats(v_runs, b_runs)
        return {"speedup": speedup, "speedup_ci95": [lo, hi],
                "speedup_ci_method": f"t-interval over repeats ({len(v_runs)} vs {len(b_runs)})"}
    b_ms, v_ms = base["step_times_ms"], run["step_times_ms"]
    lo, hi = stats.bootstrap_ratio_ci(b_ms, v_ms)
    of_means = ratio(stats.mean_std(b_ms)[0], stats.mean_std(v_ms)[0]) if b_ms and v_ms else None
    if speedup is None or not of_means or math.isnan(lo):
        return {"speedup": speedup, "speedup_ci95": [None, None], "speedup_ci_method": "no step times"}
    scale = speedup / of_means
    return {"speedup": speedup, "speedup_ci95": [lo * scale, hi * scale],
            "speedup_ci_method": "bootstrap over one run's step times (ratio of means)"}


def time_to_accuracy(history: list[dict], target: float) -> tuple[float, int] | None:
    """(seconds, epoch) when eval accuracy first reached ``target``, summing epoch times; None if never."""
    total = 0.0
    for row in history:
        total += float(row["epoch_time_s"])
        if float(row["eval_acc"]) >= target:
            return total, int(row["epoch"])
    return None


def profile_categories(profiles: list[dict]) -> list[str]:
    """The op categories that took time in any of ``profiles``, in the profiler's order."""
    order = next((p["category_order"] for p in profiles if p.get("category_order")), [])
    seen = [c for p in profiles for c in p.get("categories", {})]
    return [c for c in order if c in seen] + [c for c in dict.fromkeys(seen) if c not in order]


def compare(base: dict, run: dict, peak_ratio: float | None = None) -> dict | None:
    """Category by category, base ms / run ms; and the Amdahl bounds from the base profile.

    Which categories are tensor-core work, and which are work a precision adds (casts, loss scaling), the
    profile itself says (``category_roles``), so the report needs no training code to know.
    """
    bp, rp = base.get("profile") or {}, run.get("profile") or {}
    if not bp.get("categories") or not rp.get("categories"):
        return None
    roles = bp.get("category_roles") or {}
    rows = {}
    for cat in profile_categories([bp, rp]):
        b = bp["categories"].get(cat, {}).get("ms_per_step")
        r = rp["categories"].get(cat, {}).get("ms_per_step")
        if b or r:
            rows[cat] = {"base_ms": b or 0.0, "ms": r or 0.0, "speedup": b / r if b and r else None,
                         "role": roles.get(cat)}
    tc = sum(c.get("ms_per_step", 0.0) for cat, c in bp["categories"].items() if roles.get(cat) == "tensor_core")
    share = tc / bp["wall_ms_per_step"] if bp["wall_ms_per_step"] else 0.0
    known = bool(roles)  # a profile that does not say which time is tensor-core work gives no bound
    out = {"categories": rows, "tensor_core_share": share if known else None,
           "amdahl_bound": 1 / (1 - share) if known and share < 1 else None,
           "step_speedup": ratio(bp["wall_ms_per_step"], rp["wall_ms_per_step"])}
    if peak_ratio and known:
        out["peak_ratio"] = peak_ratio
        out["amdahl_bound_at_peak"] = 1 / ((1 - share) + share / peak_ratio)
    return out


def headline(summary: dict) -> str | None:
    """The variant the verdict speaks of: fp16 without accumulation, else any non-baseline variant."""
    rows = summary["variants"]
    for name, r in rows.items():
        if r["precision"] == "fp16" and r["accum_steps"] == 1 and r.get("speedup") is not None:
            return name
    return next((n for n, r in rows.items() if n != summary["baseline"] and r.get("speedup") is not None), None)


def _variant(name: str, run: dict, base: dict | None, target_acc: float, tf32: dict | None = None) -> dict:
    """One variant's row: its own figures, its ratios against the baseline run ``base``, and its speedup
    against the tf32 run ``tf32`` (None for that run itself)."""
    m = run["metrics"]
    row = {key: m.get(key) for key in COPIED}
    row.update(repeats=m.get("repeats", 1), status=m.get("status", "complete"),
               step_time_ms_median=(m.get("step_time_ms") or {}).get("median"))
    row["profile"] = m.get("profile")
    rung = precision.RUNGS.get(m.get("precision"))
    # under FSDP compiled block by block: none compiled (each held a BatchNorm unit) is an eager run
    sharded = m.get("fsdp") or {}
    compiled = bool(m.get("compiled")) and ("compiled_blocks" not in sharded or bool(sharded["compiled_blocks"]))
    row["eager"] = bool(rung and rung.fast_compiled and not compiled)  # fp8 measured uncompiled
    row["compiled"] = compiled  # its activation bytes are still the eager model's
    if target_acc:
        reached = time_to_accuracy(run["history"], target_acc)
        row["time_to_target_s"], row["time_to_target_epoch"] = reached or (None, None)
    row["imgs_per_s_p10_p90"] = m.get("imgs_per_s_p10_p90")
    # within one training (repeats' steps are joined: the first repeat's), where the work per step is the same
    ms = run.get("step_times_ms") or []
    row["steadiness"] = stats.steadiness(ms[:len(ms) // max(1, row["repeats"])], m.get("gpu_sm_clock_mhz_p10_p90"))
    if base is not None:
        bm = base["metrics"]
        row.update(speedup_with_ci(base, run))
        row["mem_ratio"] = ratio(row["peak_mem_bytes"], bm.get("peak_mem_bytes"))
        row["activation_ratio"] = ratio(row["activation_bytes"], bm.get("activation_bytes"))
        acc, b_acc = row["final_acc"], bm.get("final_acc")
        row["acc_diff"] = None if acc is None or b_acc is None else acc - b_acc
        row["sm_clock_ratio"] = ratio(row["gpu_sm_clock_mhz_median"], bm.get("gpu_sm_clock_mhz_median"))
        row["clock_differs"] = row["sm_clock_ratio"] is not None and abs(row["sm_clock_ratio"] - 1) > CLOCK_TOLERANCE
        row["energy_ratio"] = ratio(row["energy_per_image_j"], bm.get("energy_per_image_j"))
    if tf32 is not None and tf32 is not run:
        row["vs_tf32"] = ratio(row["imgs_per_s"], tf32["metrics"].get("imgs_per_s"))
    return row


def summarize(runs: dict[str, dict], target_acc: float = 0.0, sweep_json: dict | None = None,
              roofline_json: dict | None = None, paired_json: dict | None = None) -> dict:
    """Every number the report shows: per-variant rows and ratios, the profile comparison, sweep, scaling, and
    the paired check's ratio beside each one-process variant's."""
    base, tf32 = pick_baseline(runs), pick_tf32(runs)
    out = {"baseline": base, "tf32_baseline": tf32, "variants": {}, "target_acc": target_acc or None,
           "profile_comparison": {}}
    for name, run in runs.items():
        out["variants"][name] = _variant(name, run, runs[base] if base else None, target_acc,
                                         runs[tf32] if tf32 else None)
        if base and name != base:
            bm, m = runs[base]["metrics"], run["metrics"]
            cmp = compare(bm, m, ratio(m.get("peak_tflops_datasheet"), bm.get("peak_tflops_datasheet")))
            if cmp:
                out["profile_comparison"][name] = cmp
    out["headline"] = headline(out)
    out["run_order"] = sorted((n for n, r in out["variants"].items() if r.get("started_at")),
                              key=lambda n: out["variants"][n]["started_at"])
    out["sweep"] = sweep(sweep_json)
    out["scaling"] = scaling(runs)
    out["roofline"] = roofline(roofline_json, out["variants"])
    out["paired"] = paired(paired_json, out["variants"])
    return out


def paired(found: dict | None, rows: dict[str, dict]) -> dict | None:
    """The paired check (``sweep.paired``), and on each variant it timed that variant's ratio to the baseline's
    there (``row["paired"]``): what the verdict claims from when repeats are 1."""
    if not found or not found.get("enabled"):
        return None
    for name, r in rows.items():
        got = (found.get("vs_fp32") or {}).get(name)
        if got:
            r["paired"] = got
        both = (found.get("vs_compiled") or {}).get(name)
        if both:
            r["paired_compiled"] = both  # against strict fp32 and bf16 compiled the same way
    return found


def roofline(found: dict | None, rows: dict[str, dict]) -> dict | None:
    """env_check's roofline, with each one-process variant's measured img/s against its precision's roofline
    img/s on this GPU (the share of the roofline's img/s it reached)."""
    if not found:
        return None
    out = dict(found)
    table = (found.get("gpu") or {}).get("table") or {}
    out["measured"] = {}
    for name, r in rows.items():
        cell = table.get(r["precision"])
        if cell and "na" not in cell and r["accum_steps"] == 1 and (r.get("world_size") or 1) == 1 \
                and r.get("imgs_per_s"):
            out["measured"][name] = {"precision": r["precision"], "speedup": r.get("speedup"),
                                     "roofline_vs_fp32": cell["vs_fp32"],
                                     "of_roofline": r["imgs_per_s"] / cell["imgs_per_s"], "eager": r.get("eager")}
    return out


def sweep(found: dict | None) -> dict | None:
    """The sweep as the report shows it: points by precision, the largest batches and their ratio to fp32's."""
    if not found or not found.get("enabled"):
        return None
    by_prec: dict[str, list[dict]] = {}
    for p in found["points"]:
        by_prec.setdefault(p["variant"], []).append(p)
    largest_found = found.get("largest") or {}
    largest = {k: dict(largest_found[k]) for k in found.get("precisions", largest_found) if k in largest_found}
    base = (largest.get("fp32") or {}).get("largest_batch")
    for row in largest.values():
        row["vs_fp32"] = row["largest_batch"] / base if base and row.get("largest_batch") else None
    return {"device": found["device"], "steps": found["steps"], "warmup": found["warmup"], "points": by_prec,
            "largest": largest,
            "reused_points": found.get("reused_points"), "measured_points": found.get("measured_points"),
            "not_made": found.get("not_made") or [], "left_out": found.get("left_out") or [],
            "eager": found.get("eager") or []}


def sweep_memory(point: dict, device: str) -> int | None:
    """The memory a sweep point is shown with: CUDA peak allocated on a GPU, activation bytes elsewhere."""
    return point.get("peak_mem_bytes") if device == "cuda" else point.get("activation_bytes")


def _same_work(m: dict) -> tuple:
    return m.get("precision"), m.get("accum_steps")


def scaling(runs: dict[str, dict]) -> dict | None:
    """Data-parallel rows (each DDP variant against the one-process run of the same precision and accumulation)
    and the grad_comm comparisons; None when every variant ran in one process.

    Nothing is compared across pipelines: a pair that did not both run here has no ratio.
    """
    metrics = {name: run["metrics"] for name, run in runs.items()}
    if not any((m.get("world_size") or 1) > 1 for m in metrics.values()):
        return None
    single = {}
    for name, m in metrics.items():
        if (m.get("world_size") or 1) == 1 and m.get("imgs_per_s"):
            single.setdefault(_same_work(m), name)
    rows = [_scaling_row(name, m, single.get(_same_work(m)), metrics) for name, m in metrics.items()
            if (m.get("world_size") or 1) > 1]
    comms = []
    for row in rows:
        if row["grad_comm"] in (None, "none") or row["strategy"] == "fsdp":
            continue
        base = next((r for r in rows if r["grad_comm"] == "none" and r["strategy"] == "ddp"
                     and r["world_size"] == row["world_size"]
                     and _same_work(metrics[r["variant"]]) == _same_work(metrics[row["variant"]])), None)
        if base is None:
            comms.append({"variant": row["variant"], "grad_comm": row["grad_comm"], "against": None})
            continue
        acc, b_acc = row["final_acc"], base["final_acc"]
        comms.append({"variant": row["variant"], "grad_comm": row["grad_comm"], "against": base["variant"],
                      "throughput_ratio": ratio(row["imgs_per_s"], base["imgs_per_s"]),
                      "acc_diff": acc - b_acc if acc is not None and b_acc is not None else None,
                      "exposed_comm_share": row["exposed_comm_share"],
                      "against_exposed_comm_share": base["exposed_comm_share"]})
    from ampbench.report.sharded import against_ddp, against_fp32
    return {"rows": rows, "grad_comm": comms,
            "fsdp": against_fp32([against_ddp(r, rows, metrics) for r in rows if r["strategy"] == "fsdp"])}


def _scaling_row(name: str, m: dict, ref: str | None, metrics: dict[str, dict]) -> dict:
    world, ips = m["world_size"], m.get("imgs_per_s")
    ref_ips = metrics[ref]["imgs_per_s"] if ref else None
    profile = m.get("profile") or {}
    comm = (profile.get("categories") or {}).get("communication") or {}
    comm_ms = comm.get("ms_per_step")
    return {"variant": name, "world_size": world, "backend": m.get("backend"), "grad_comm": m.get("grad_comm"),
            "strategy": m.get("strategy") or "ddp",  # (runs from before FSDP: DDP)
            "imgs_per_s": ips, "imgs_per_s_per_process": ips / world if ips else None,
            "single_variant": ref, "single_imgs_per_s": ref_ips, "threads": m.get("cpu_threads"),
            "single_threads": metrics[ref].get("cpu_threads") if ref and m.get("device") == "cpu" else None,
            "speedup_vs_single": ratio(ips, ref_ips), "efficiency": ratio(ips, world * ref_ips) if ref_ips else None,
            "exposed_comm_share": (profile.get("communication") or {}).get("exposed_share"),
            # under FSDP no step runs without its collectives: the profile's share of the step in them instead
            "collectives_share": comm.get("share") if m.get("strategy") == "fsdp" else None,
            "comm_ms_per_step": comm_ms, "peak_mem_bytes": m.get("peak_mem_bytes"), "final_acc": m.get("final_acc")}


def _rounded(value, digits: int = 4):
    """A headline figure as DVC shows it: floats to ``digits`` significant figures, the rest as they are."""
    return float(f"{value:.{digits}g}") if isinstance(value, float) and math.isfinite(value) else value


def headline_metrics(summary: dict) -> dict:
    """``metrics.json``, DVC's declared metric: per variant the figures a user compares across experiments, about
    ten each, flat under the variant's name, so `dvc exp show` and `dvc metrics diff` stay readable (summary.json
    holds every figure). A figure not measured is left out, not written as 0."""
    out = {}
    for name, r in summary["variants"].items():
        lo, hi = r.get("speedup_ci95") or [None, None]
        st = r.get("steadiness")
        ips = r.get("imgs_per_s")
        row = {"imgs_per_s": None if ips is None else round(ips, 1),  # to 0.1 img/s: a 10 img/s change shows
               "speedup": r.get("speedup"), "speedup_lo": lo, "speedup_hi": hi,
               "vs_tf32": r.get("vs_tf32"), "paired": (r.get("paired") or {}).get("median"),
               "peak_mem_ratio": r.get("mem_ratio"), "activation_ratio": r.get("activation_ratio"),
               "final_acc": r.get("final_acc"),
               "acc_diff_pts": None if r.get("acc_diff") is None else r["acc_diff"] * 100,
               "steady": None if st is None else not st["unsteady"]}
        if name == summary["baseline"]:  # its speedup (1, the anchor) kept; its other ratios to itself dropped
            row = {k: v for k, v in row.items() if k in ("imgs_per_s", "speedup", "vs_tf32", "final_acc", "steady")}
        out[name] = {k: v if k == "imgs_per_s" else _rounded(v) for k, v in row.items() if v is not None}
    return out
