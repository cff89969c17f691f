"""report.md, section by section. Each section is one function ``(summary, env, runs) -> lines``, and
``SECTIONS`` lists them in the report's order: a new section is one function and one line there.

``summary`` is what ``report.summary.summarize`` computed (plus the figures drawn and the params changed),
``env`` is env.json, ``runs`` the run folders as ``results.read_runs`` reads them. Every number comes from
them; the only ones that do not are the article's, quoted and labelled as such.
"""

from __future__ import annotations

from pathlib import Path

from ampbench.measure import stats
from ampbench.report import fmt, glance
from ampbench.report.fmt import not_made
from ampbench.report.fmt import speedup as _speedup
from ampbench.report.memory import memory
from ampbench.report.roofline import article, roofline
from ampbench.report.safety import safety
from ampbench.report.scale import scaling, sweep
from ampbench.report.summary import profile_categories
from ampbench.report.verdict import items, why

SAME = "none: the same arithmetic as fp32 here"  # a paired claim where there is no TF32 hardware

# The article's own measurement (ResNet-18, CIFAR-10, batch 256, CUDA 12.1, "NVIDIA 5090 (24GB)"): quoted, not ours.
def model_line(m: dict) -> str:
    """Model <name> (<n> parameters, <s>x<s> inputs), <k> classes of <data> (<n> train / <n> test images)."""
    params = f"{m['param_count']:,} parameters, " if m.get("param_count") else ""
    trained = m.get("trainable_param_count")
    if params and trained is not None and trained != m["param_count"]:  # fine-tuning: say how much of it trains
        params = f"{trained:,} of {m['param_count']:,} parameters trained, "
    size = f"{m['input_size']}x{m['input_size']} inputs" if m.get("input_size") else "CIFAR-sized inputs"
    classes = f"{m['num_classes']} classes of " if m.get("num_classes") else ""
    return (f"Model {m.get('model') or m.get('arch')} ({params}{size}), {classes}{m.get('data_source')} data "
            f"({m.get('train_images')} train / {m.get('test_images')} test images)")


def _first(runs: dict[str, dict]) -> dict:
    return next(iter(runs.values()))["metrics"] if runs else {}


def _imgs_per_s(r: dict) -> str:
    spread = r.get("imgs_per_s_p10_p90")
    extra = f" ({spread[0]:,.0f} to {spread[1]:,.0f})" if spread else ""
    if r.get("imgs_per_s_std") is not None:
        extra += f" ±{r['imgs_per_s_std']:,.0f} sd over {r['repeats']} repeats"
    return fmt.num(r["imgs_per_s"], ",.0f") + extra


def _tflops(r: dict) -> str:
    if r.get("achieved_tflops") is None:
        return "missing"
    frac = r.get("fraction_of_peak")
    of_peak = f" ({frac:.0%} of {r['peak_tflops_datasheet']:g} {r['peak_precision']} peak)" if frac else ""
    return f"{r['achieved_tflops']:.3g}{of_peak}"


def _accuracy(r: dict) -> str:
    sd = f" ±{r['final_acc_std'] * 100:.2f}" if r.get("final_acc_std") is not None else ""
    return fmt.num(r["final_acc"], ".2%") + sd


def header(summary: dict, env: dict, runs: dict) -> list[str]:
    """The first screen: the answer as a title, the model it is about, six bullets, what next, the summary
    table (``glance``)."""
    return glance.first_screen(summary, env, f"{model_line(_first(runs))}." if runs else "")


def verdict(summary: dict, env: dict, runs: dict) -> list[str]:
    """The verdict in full: each claim with its interval, its reasons and its caveats, one per bullet."""
    return ["## The verdict in full", "", "What the first screen says, with the evidence behind each claim.", ""] \
        + [f"- {item}" for item in items(summary, env)] + [""]


def results(summary: dict, env: dict, runs: dict) -> list[str]:
    """The results table, what is missing, how to read it, the interval's method, and time to accuracy."""
    base = summary["baseline"]
    lines = ["## Results (measured in this run)", "",
             "Every variant's figures, each ratio against strict fp32 with its 95% interval.", "",
             "| variant | precision | accumulation | img/s (p10 to p90 step) | speedup vs fp32 (95% CI) | vs tf32 "
             "| peak memory | memory vs fp32 | activations | activations vs fp32 | TFLOP/s | time per epoch "
             "| final accuracy | accuracy vs fp32 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in summary["variants"].items():
        vs_tf32 = fmt.times(r["vs_tf32"]) if r.get("vs_tf32") is not None else "n/a"
        lines.append(
            f"| {name} | {fmt.precision(r)} | {r['accum_steps']} | {_imgs_per_s(r)} | {_speedup(r)} | {vs_tf32} "
            f"| {fmt.size(r['peak_mem_bytes'])} | {fmt.change(r.get('mem_ratio'))} | {fmt.activations(r)} "
            f"| {fmt.change(r.get('activation_ratio'))} | {_tflops(r)} | {fmt.num(r['epoch_time_s'], '.1f')} s "
            f"| {_accuracy(r)} | {fmt.points(r.get('acc_diff'))} |")
    lines.append("")
    lines += fmt.eager_note(summary)
    if summary.get("missing"):
        lines += [f"No finished run for: {', '.join(summary['missing'])} (missing, not estimated).", ""]
    lines += [
        "How to read it: img/s is training throughput after the warm-up steps: the timed images over the summed "
        "step times, each step timed end to end (from one step's data to the next's: data, compute and the host's "
        "work between steps; evaluation excluded; CUDA events on a GPU); in brackets the p10 and p90 of the "
        "steps' own rates. The speedup is the ratio of two img/s figures. TFLOP/s is "
        "model FLOPs (forward + backward, torch.utils.flop_counter) times img/s; on a known GPU, against the "
        "datasheet's dense peak for that precision (a datasheet figure, not measured). Peak memory is "
        + ("CUDA peak allocated over the steady-state training steps (evaluation apart)" if env.get("gpu")
           else "the process's peak RSS (on a CPU it mostly counts the process and data, not the model)")
        + "; activations are the bytes autograd saves for backward in one forward pass of one micro-batch. "
        + (f"Ratios are against `{base}` (strict IEEE fp32)" if base else "No fp32 variant ran, so there are no ratios")
        + (f"; vs tf32 against `{summary['tf32_baseline']}` (TF32 matmuls and convolutions: PyTorch's default "
           "for convolutions)." if summary.get("tf32_baseline") else "."), ""]
    methods = sorted({r["speedup_ci_method"] for r in summary["variants"].values() if r.get("speedup_ci_method")})
    if methods:
        caveat = (" A bootstrap over the step times of one process is an interval within one run: it says how "
                  "precisely that run was timed, nothing about process-to-process variation (another process can "
                  "land on other kernels, clocks or memory placement) or about a machine that changed between the "
                  "stages; the verdict claims no speedup from it (the paired check below, or train.repeats: 3 or "
                  "more, for a figure to publish).")
        lines += [f"Speedup interval: {'; '.join(methods)}."
                  + (caveat if any(m.startswith("bootstrap") for m in methods) else ""), ""]
    return lines + not_made(summary, "flops") + _time_to_accuracy(summary)


def _time_to_accuracy(summary: dict) -> list[str]:
    target = summary.get("target_acc")
    if not target:
        return []
    base = summary["variants"].get(summary["baseline"] or "", {}).get("time_to_target_s")
    lines = [f"Training time to {target:.1%} evaluation accuracy (epoch times summed, evaluation excluded):", "",
             "| variant | time to target | reached at epoch | speedup vs fp32 (time ratio) |", "|---|---|---|---|"]
    for name, r in summary["variants"].items():
        t = r.get("time_to_target_s")
        if t is None:
            lines.append(f"| {name} | not reached | - | - |")
        else:
            lines.append(f"| {name} | {t:.1f} s | {r['time_to_target_epoch']} | "
                         f"{fmt.times(base / t) if base else 'n/a'} |")
    return lines + [""]


def profile(summary: dict, env: dict, runs: dict) -> list[str]:
    """A category table per variant, why each variant against the baseline, GPU idle time, the profile's cost."""
    lines = ["## Why: the step profile", ""]
    rows = {n: r["profile"] for n, r in summary["variants"].items() if (r.get("profile") or {}).get("categories")}
    failed = not_made(summary, "profile")
    if not rows:
        return lines + (failed or ["No step profile (profile.steps: 0)."])
    lines += failed
    names = list(rows)
    first = rows[names[0]]
    lines += [f"Time per optimizer step by op category, from torch.profiler over {first['steps']} steps per variant "
              f"after training, with the trained model's state (never inside a timed step); time is {first['basis']}"
              ", each op's own time (self time), with the dtypes it ran in.", "",
              "| category | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for cat in profile_categories(list(rows.values())):
        cells = []
        for n in names:
            c = rows[n]["categories"].get(cat)
            cells.append(f"{c['ms_per_step']:.3g} ms ({c['share']:.0%}; {c['dtypes'] or 'no float inputs'})"
                         if c else "-")
        lines.append(f"| {cat} | " + " | ".join(cells) + " |")
    lines.append("| step wall time | " + " | ".join(f"{rows[n]['wall_ms_per_step']:.3g} ms" for n in names) + " |")
    on_gpu = "gpu_busy_fraction" in first
    if on_gpu:
        lines.append("| GPU busy (kernels / wall) | " + " | ".join(fmt.pct(rows[n]["gpu_busy_fraction"])
                                                                    for n in names) + " |")
        lines.append("| kernels per step | " + " | ".join(f"{rows[n]['kernels_per_step']:.0f}" for n in names) + " |")
    lines.append("")
    for name, cmp in (summary.get("profile_comparison") or {}).items():
        if name == summary.get("headline"):
            lines += [f"{name} against {summary['baseline']}: the verdict above says where its time went.", ""]
        else:
            lines += [why(name, summary["baseline"], cmp), ""]
    if on_gpu:
        idle = [f"{n} {fmt.pct(1 - rows[n]['gpu_busy_fraction'])}" for n in names]
        lines += ["Share of the step the GPU sat idle waiting for the host (launch-bound when large): "
                  + ", ".join(idle) + ".", ""]
    cost = sum(rows[n].get("cost_s") or 0 for n in names)
    lines += [f"Profiling cost {cost:.1f} s in all, outside the timed steps (the profiled steps run with the "
              "profiler's overhead, so their wall time is above the timed steps'). Each run's trace is "
              "`profile_trace.json` in its run folder and MLflow run: open it in https://ui.perfetto.dev or "
              "chrome://tracing.", ""]
    return lines


def gpu_state(summary: dict, env: dict, runs: dict) -> list[str]:
    """SM clock, temperature, power and energy per image per variant (NVML samples); nothing without them."""
    rows = {n: r for n, r in summary["variants"].items() if r.get("gpu_sm_clock_mhz_median") is not None
            or r.get("gpu_power_w_median") is not None}
    if not rows:
        return []
    lines = ["## GPU clock, temperature and energy", "", "What the GPU ran at while each variant trained, and the "
             "energy each image cost.", "",
             "| variant | ran | median SM clock | vs the baseline's | median temperature | median power | energy per "
             "image | energy vs the baseline |", "|---|---|---|---|---|---|---|---|"]
    order = summary.get("run_order") or []
    for name, r in rows.items():
        ran = f"{order.index(name) + 1} of {len(order)}" if name in order else "-"
        clock = fmt.num(r.get("gpu_sm_clock_mhz_median"), ",.0f", "n/a")
        lines.append(f"| {name} | {ran} | {clock} MHz | {fmt.change(r.get('sm_clock_ratio'))} "
                     f"| {fmt.num(r.get('gpu_temperature_c_median'), '.0f', 'n/a')} C "
                     f"| {fmt.num(r.get('gpu_power_w_median'), ',.0f', 'n/a')} W "
                     f"| {fmt.num(r.get('energy_per_image_j'), '.3g', 'n/a')} J "
                     f"| {fmt.times(r.get('energy_ratio'))} |")
    lines += ["", "Sampled by NVML every 0.5 s during each variant's train stage (setup, evaluation and the profile "
              "included), on the GPU it trained on (found by UUID; rank 0's under DDP). Energy per image is that "
              "GPU's median power over its own img/s. The variants ran one after another, "
              "in the order shown; a GPU that heats up can lower its clock for the later ones.", ""]
    differs = [n for n, r in rows.items() if r.get("clock_differs")]
    if differs:
        lines += ["The median SM clock of " + ", ".join(f"`{n}`" for n in differs) + " differs by more than 5% from "
                  "the baseline's: part of their speed difference is the clock's, not the precision's (the GPU may "
                  "have throttled, or boosted); rerun with the variants in another order to tell.", ""]
    return lines


def figures(summary: dict, env: dict, runs: dict) -> list[str]:
    """Every figure drawn, by its path relative to report.md."""
    found, failed = summary.get("figures") or [], summary.get("figures_not_drawn") or {}
    lines = [f"Figure {name} could not be drawn: {why}." for name, why in failed.items()]
    lines = lines + [""] if lines else []
    lead = ["The figures the sections above describe, as PNG files beside this report.", ""]
    return ["## Figures", ""] + lead + lines + [f"![{Path(f).stem}]({f})" for f in found] + [""] \
        if found or lines else []


def environment(summary: dict, env: dict, runs: dict) -> list[str]:
    """Hardware, software, the baseline's TF32 setting, the model, the processes, the commit, the params."""
    gpu = env.get("gpu")
    if gpu:
        yes = {True: "yes", False: "no"}
        hw = (f"{gpu['name']} (compute capability {gpu['capability']}, driver {gpu.get('driver') or 'unknown'}, "
              f"tensor cores: {yes[gpu['tensor_cores']]}, bf16: {yes[gpu['bf16_supported']]})")
    else:
        hw = f"no GPU: CPU {env.get('cpu_model')}, {env.get('cpu_count')} cores (fp16 is emulated on a CPU)"
    first = _first(runs)
    defaults = env.get("tf32_defaults")
    lines = ["## Environment", "", "What ran, on what, from which code and settings.", "", f"- Hardware: {hw}",
             f"- Software: torch {env.get('torch')}, CUDA runtime {env.get('cuda_runtime')}, "
             f"cuDNN {env.get('cudnn')}, Python {env.get('python')}",
             f"- {_tf32_line(runs)}"
             + (f"; torch's defaults here: matmul {defaults['matmul_fp32_precision']}, cuDNN convolutions "
                f"{defaults['cudnn_conv_fp32_precision']}" if defaults else ""),
             f"- {model_line(first)}, batch {first.get('batch_size')}, {first.get('epochs')} epochs, "
             f"device {first.get('device')}", _processes(runs),
             f"- Code: git commit {first.get('git_commit', 'unknown')}"]
    changed = summary.get("params_changed") or {}
    if changed:
        lines.append("- Params that differ from the defaults: "
                     + ", ".join(f"`{k}: {v}`" for k, v in sorted(changed.items())))
    else:
        lines.append("- Params: the defaults")
    return lines + [""]


def _tf32_line(runs: dict[str, dict]) -> str:
    """What each variant's fp32 matmuls and convolutions ran in (in autocast variants: the ops it leaves fp32)."""
    groups: dict[str, list[str]] = {}
    for name, r in runs.items():
        flags = r["metrics"].get("tf32") or {}
        key = (f"matmul {flags.get('matmul_fp32_precision', '?')}, convolutions "
               f"{flags.get('cudnn_conv_fp32_precision', '?')}")
        groups.setdefault(key, []).append(name)
    return ("fp32 math (in fp16 and bf16 variants: the ops autocast leaves in fp32): "
            + "; ".join(f"{', '.join(names)}: {key}" for key, names in groups.items()))


def _processes(runs: dict[str, dict]) -> str:
    worlds = {n: r["metrics"].get("world_size") or 1 for n, r in runs.items()}
    ddp = [n for n, w in worlds.items() if w > 1]
    if not ddp:
        return "- Processes: one per variant (world size 1)"
    m = runs[ddp[0]]["metrics"]
    return (f"- Processes: {m['world_size']} (torchrun, {m.get('backend')} backend) for {', '.join(ddp)}; one for "
            f"{', '.join(n for n in worlds if n not in ddp) or 'none'}; the global batch of {m.get('batch_size')} "
            "is split over the processes")


def reproduce(summary: dict, env: dict, runs: dict) -> list[str]:
    return ["## Reproduce", "", "The commands that make this report again.", "", "```",
            "git checkout <the commit above>", "dvc repro          # or: make repro",
            "```", ""]


# The report, in order: a new section is a function above and its name here.
def steadiness(summary: dict, env: dict, runs: dict) -> list[str]:
    """Whether the machine was steady while each variant trained, and the paired check's ratios beside the
    stages'."""
    rows = summary["variants"]
    lines = ["## Steadiness and the paired check", "",
             "The train stages run one after another, so a machine that changed between them (another tenant, a "
             f"throttled clock) moves one variant alone. A run is called unsteady when its step times spread past "
             f"{stats.SPREAD_LIMIT}x (p90 / p10), when its steps got more than {stats.DRIFT_LIMIT}x slower or faster "
             f"from the first third of training to the last, or when its GPU's SM clock moved past "
             f"{stats.CLOCK_LIMIT}x while busy; the verdict claims no speedup from an unsteady stage.", "",
             "| variant | step time p90 / p10 | last third vs first | SM clock p90 / p10 | steady |",
             "|---|---|---|---|---|"]
    for name, r in rows.items():
        st = r.get("steadiness")
        if not st:
            lines.append(f"| {name} | n/a | n/a | n/a | too few timed steps to tell |")
            continue
        clock = f"{st['clock_spread']:.3f}x" if st.get("clock_spread") else "n/a"
        lines.append(f"| {name} | {st['spread']:.2f}x | {stats.fmt_drift(st['drift'])} | {clock} | "
                     f"{'no: ' + '; '.join(st['unsteady']) if st['unsteady'] else 'yes'} |")
    lines.append("")
    p = summary.get("paired")
    if not p:
        return lines + ["No paired check ran (paired.enabled: false).", ""]
    if p.get("error"):
        return lines + [f"The paired check could not be made ({p['error']}).", ""]
    lines += [f"The paired check: each one-process variant without accumulation timed in windows of "
              f"{fmt.windows(p)} at batch {p['batch']} as its train stage runs it, in turns in one process "
              f"({p['order']}), "
              f"{p['rounds']} rounds; each round's ratio is to `{p['baseline']}`'s window of the same round, so a "
              f"drift lands on every variant alike. A variant is called faster (slower) only when all of at least "
              f"{p['claim_rounds']} rounds say so by more than {p['margin']:.0%} (a two-sided sign test: "
              f"{stats.sign_test_p(p['claim_rounds'], p['claim_rounds']):.0%} by chance).", "",
              "| variant | precision | paired: median vs fp32 | rounds | claim | its stage vs fp32 |",
              "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        got = r.get("paired")
        if got:
            lines.append(f"| {name} | {fmt.precision(r)} | {fmt.times(got['median'])} | "
                         + ", ".join(fmt.ratio(x) for x in got["rounds"])
                         + f" | {SAME if got.get('same_arithmetic') else got.get('claim') or 'none'}"
                         f" | {fmt.times(r.get('speedup'))} |")
    compiled = [(n, r["paired_compiled"]) for n, r in rows.items() if r.get("paired_compiled")]
    if compiled:
        lines += ["", f"Both compiled: {', '.join(f'`{n}`' for n, _ in compiled)} compiles (torch.compile) and the "
                  "baseline does not, so its ratio to eager fp32 counts Inductor's fusion of every op besides the "
                  "precision; strict fp32 and bf16 compiled the same way took windows in the same turns "
                  f"({', '.join(p.get('controls') or [])}):", "",
                  "| variant | vs fp32, both compiled | rounds | claim | vs bf16, both compiled | vs eager fp32 |",
                  "|---|---|---|---|---|---|"]
        for n, both in compiled:
            c, b = both.get("fp32") or {}, both.get("bf16") or {}
            lines.append(f"| {n} | {fmt.times(c.get('median'))} | " + ", ".join(fmt.ratio(x) for x in c.get(
                "rounds", [])) + f" | {c.get('claim') or 'none'} | {fmt.times(b.get('median'))} | "
                f"{fmt.times((rows[n].get('paired') or {}).get('median'))} |")
    lines += [""] + [f"Not in the paired check: `{n}` ({why})." for n, why in (p.get("not_made") or {}).items()]
    return lines + ([""] if p.get("not_made") else [])


SECTIONS = (header, verdict, results, steadiness, roofline, profile, article, memory, sweep, scaling, gpu_state,
            safety, figures, environment, reproduce)


def render(summary: dict, env: dict, runs: dict[str, dict]) -> str:
    """report.md's text."""
    return "\n".join(line for section in SECTIONS for line in section(summary, env, runs))
