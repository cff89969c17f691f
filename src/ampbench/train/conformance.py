"""Will this model run through ampbench? One model checked in seconds, before ``dvc repro``.

    ampbench check-model tv:efficientnet_b0            # the params.yaml's variants, at its data size
    ampbench check-model models.my_net:build --json out.json

``check_model(cfg)`` builds the model, finds the input size it takes, counts its roofline on meta tensors, lists
what fp8 would convert, checks each converting rung against the unconverted model (``train.rungcheck``: its
logits within the rung's tolerance, every gradient there, the dtypes its casts take), and runs one optimizer step per
precision (the engine's own ``train_step``, on a tiny
batch of random images, on the CPU unless a GPU is at hand) with the activation meter after it, each part timed.
The result is a list of rows: ``{"check", "ok", "detail"}``, with ``ok`` None for a part that is information, not
a pass or fail (the roofline and fp8 are analyses: a model they cannot follow still trains).
``benchmarks/zoo.py`` runs it over torchvision.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from ampbench import config, data, models, runplan
from ampbench.config import optim
from ampbench.errors import analysis, first_line
from ampbench.measure import roofline
from ampbench.models import finetune
from ampbench.precision import BASELINE, converting, names, rung
from ampbench.train import probes, rungcheck, setup, step

ZOO_GPUS = ("RTX 5090", "H100 SXM")  # the roofline's ratios are given on these (the article's card, a datacenter one)
STEP_BATCH = 2  # images per checked step: the least a BatchNorm in training mode takes
ROOFLINE_PRECISIONS = ("fp32", "tf32", "bf16", "fp16")  # the ratios given (fp8's census is its own row)


def _timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def _step(cfg: config.Config, precision: str, size: int, num_classes: int, device: torch.device,
          batch: int = STEP_BATCH) -> dict:
    """One optimizer step of ``precision`` at ``batch`` images of size x size: its loss and time."""
    plan = runplan.for_precision(cfg, precision, device.type)
    note = ""
    r = rung(precision)
    if r.cpu_recipes and device.type == "cpu" and plan.recipe not in r.cpu_recipes:
        note = f"recipe {r.cpu_recipes[0]} here: {plan.recipe} runs on a GPU only; "
        plan = dataclasses.replace(plan, recipe=r.cpu_recipes[0])
    meta = {"image_shape": [3, size, size], "num_classes": num_classes, "mean": [0.5] * 3, "std": [0.25] * 3}
    s = setup.build(plan, meta, device)
    frozen = {n: p.detach().clone() for n, p in s.model.named_parameters() if not p.requires_grad}
    trained = [p.detach().clone() for p in s.model.parameters() if p.requires_grad]
    scale = s.scaler.get_scale() if s.policy.uses_scaler else None
    g = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(batch, 3, size, size, generator=g).to(device)
    y = torch.randint(0, num_classes, (batch,), generator=g).to(device)
    if cfg.model.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    t0 = time.perf_counter()
    loss = float(step.train_step(s.step_model, s.opt, s.scaler, s.policy, x, y, batch,
                                 clip=cfg.train.clip_grad_norm))
    seconds = time.perf_counter() - t0
    # a CPU has no fp16 or fp8 tensor cores: autocast to fp16 and torchao's fp8 GEMMs run emulated there
    emulated = device.type == "cpu" and r.emulated_on_cpu
    if not math.isfinite(loss):
        raise RuntimeError(f"the step's loss is {loss}" + (
            " on a CPU, whose autocast lists differ from CUDA's: it runs in fp16 some ops CUDA autocast keeps in fp32 "
            "(F.normalize's norm: its eps of 1e-12 is 0 in fp16, so a zero vector gives 0/0); a GPU run tells"
            if emulated and r.autocast == "float16" else ""))
    changed = [n for n, p in s.model.named_parameters() if n in frozen and not torch.equal(p, frozen[n])]
    if changed:
        raise RuntimeError(f"the step changed {len(changed)} frozen parameter(s), e.g. {changed[0]}")
    skipped = scale is not None and s.scaler.get_scale() < scale  # fp16's step skipped for an overflow
    if frozen and not skipped and all(torch.equal(a, b) for a, b in zip(
            trained, (p for p in s.model.parameters() if p.requires_grad), strict=True)):
        raise RuntimeError("the step moved no trained parameter")
    # the activation meter, as a train stage runs it (an analysis: its failure is said, the step still passed)
    saved, why = analysis("activations", models.name(cfg.model), probes.activation_bytes, s.model, x, s.policy)
    return {"loss": loss, "s": seconds, "activation_bytes": saved, "trained": sum(t.numel() for t in trained),
            "skipped": skipped,
            "note": note + ("emulated on a CPU: it shows the step runs, not its speed; " if emulated else ""),
            "activations": f"activations {saved / 2**10:,.0f} KiB" if why is None else f"activations not measured "
                                                                                       f"({why})"}


def _cannot_run(name: str, device: torch.device) -> str:
    """Why this machine cannot run rung ``name`` (a GPU without its tensor cores), or ''."""
    if device.type != "cuda":
        return ""
    major, minor = torch.cuda.get_device_capability(device)
    r = rung(name)
    if r.gate == "fp8_supported" and (major, minor) < (8, 9):
        return r.gate_fix
    return r.unsupported({"name": torch.cuda.get_device_name(device), "capability": f"{major}.{minor}"}) or ""


def check_model(cfg: config.Config, *, precisions: tuple[str, ...] = (), device: str = "cpu",
                step_budget_s: float = 0.0, max_params: float = 0.0, no_step: str = "",
                fine_tune: tuple[str, ...] = (), rungs: bool = True) -> dict:
    """Every check of ``cfg``'s model: ``{"model", "params", "input_size", "rows", "ok"}``.

    ``precisions``: those to step (default: the variants'); ``step_budget_s`` > 0 leaves the other precisions
    unstepped once fp32's step took longer, ``max_params`` > 0 steps none of a larger model, ``no_step`` (a
    reason) steps none: each named in its rows. ``fine_tune``: precisions stepped again with the model's backbone
    frozen (``model.freeze: [backbone]``: everything but its final classification layer), each step checked to
    leave every frozen parameter as it was and to move the trained ones (rows ``fine-tune <precision>``).
    ``rungs=False`` leaves the converting rungs' conformance unchecked (said in their rows).
    """
    precisions = precisions or tuple(dict.fromkeys(v.precision for v in cfg.variants.values()))
    dev = torch.device(device)
    name = models.name(cfg.model)
    desc = data.describe(cfg.data)
    num_classes, side = desc["num_classes"], models.input_size(cfg.model, desc["image_size"])
    rows = []

    def row(check: str, ok: bool | None, detail: str, **extra) -> dict:
        rows.append({"check": check, "ok": ok, "detail": detail, **extra})
        return rows[-1]

    model, built_s = _timed(models.build_meta, cfg.model, num_classes=num_classes, image_size=side)
    trained, params = finetune.trained(model)
    frozen = f" ({trained / 1e6:,.2f}M of them trained)" if trained != params else ""
    row("build", True, f"{params / 1e6:,.1f}M parameters{frozen}, shapes built in {built_s:.1f} s", s=built_s)
    if max_params and params > max_params:
        no_step = f"{params / 1e6:,.0f}M parameters, over {max_params / 1e6:,.0f}M for a step on the {device}"
    fix = models.input_size_fix(cfg.model, num_classes, side, model)
    size = side
    if fix is None and not models.takes(model, side, num_classes):
        row("input size", False, f"no input side tried gives logits of shape (2, {num_classes}) in training mode; "
                                 "make the model return one tensor of class scores")
    elif fix:
        size = fix[0]  # the rest is checked at the size the model takes
        row("input size", False, fix[1])
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, input_size=size))
    else:
        row("input size", True, f"{size}x{size}" + (" (model.input_size)" if cfg.model.input_size else
                                                    " (the data's)"))
    out = {"model": name, "params": params, "input_size": size, "num_classes": num_classes, "rows": rows}

    try:
        found, count_s = _timed(roofline.for_config, cfg, optim.for_count, precisions=ROOFLINE_PRECISIONS)
        per_image = found["summary"]["flops"] / found["batch"]
        ratios = {}
        for gpu in ZOO_GPUS:
            t = roofline.table(found["ops"], roofline.find_gpu(gpu), found["batch"])
            ratios[gpu] = {f"{p}_vs_{ref}": (t.get(p) or {}).get(f"vs_{ref}") for p in ("fp16", "bf16")
                           for ref in ("fp32", "tf32")}
            ratios[gpu]["launch_bound"] = [p for p, c in t.items() if c.get("launch_bound")]
        row("roofline", None, f"{per_image / 1e9:,.2f} GFLOP per image per step; " + "; ".join(
            f"{gpu}: fp16 {r['fp16_vs_fp32']:.2f}x, bf16 {r['bf16_vs_fp32']:.2f}x strict fp32"
            + (f" (launch-bound: {', '.join(r['launch_bound'])})" if r["launch_bound"] else "")
            for gpu, r in ratios.items() if r["fp16_vs_fp32"] and r["bf16_vs_fp32"])
            + f" (batch {found['batch']}, counted in {count_s:.1f} s)", flops_per_image=per_image, ratios=ratios)
    except Exception as err:  # an analysis: the model still trains without it
        row("roofline", None, f"not counted: {first_line(err)}")

    batches = {}  # a converting rung's step batch: the least multiple of STEP_BATCH its micro-batch rule takes here
    for name_ in converting(names()):  # what each converting rung converts in this model
        try:
            found = rung(name_).census(model, runplan.recipe(cfg, name_), size, cfg.model.convert_ends)
            batches[name_] = math.lcm(STEP_BATCH, rung(name_).images_multiple(found, dev.type))
            row(f"{name_} converts", None, (
                f"{len(found['called'])} Linear layer(s), {found['flop_share']:.0%} of the forward FLOPs"
                if found["called"] else f"no layer: an {name_} variant would measure bf16"),
                layers=len(found["called"]), flop_share=found["flop_share"])
        except Exception as err:
            row(f"{name_} converts", None, f"not found: {first_line(err)}")

    fp32_s = None
    for precision in precisions:
        check = f"step {precision}"
        if no_step:
            row(check, None, f"not stepped: {no_step}")
            continue
        if step_budget_s and fp32_s is not None and fp32_s > step_budget_s:
            row(check, None, f"not stepped: fp32's step took {fp32_s:.0f} s, over the {step_budget_s:g} s budget")
            continue
        try:
            batch = batches.get(precision, STEP_BATCH)
            done, total_s = _timed(_step, cfg, precision, size, num_classes, dev, batch)
        except Exception as err:  # what a user's training would hit: the reason, in one line
            row(check, False, first_line(err))
            continue
        if precision == BASELINE:
            fp32_s = done["s"]
        row(check, True, f"{done['note']}loss {done['loss']:.3f}, step {done['s']:.2f} s (with setup "
                         f"{total_s:.1f} s), batch {batch} at {size}x{size} on {dev.type}; {done['activations']}",
            s=done["s"], activation_bytes=done["activation_bytes"])
    for name_ in (n for n in converting(names()) if n in batches):  # each converting rung against the model
        check = f"{name_} conformance"
        why = (not rungs and "not asked for") or no_step or (
            step_budget_s and fp32_s is not None and fp32_s > step_budget_s and f"fp32's step took {fp32_s:.0f} s"
        ) or _cannot_run(name_, dev)
        if why:
            row(check, None, f"not checked: {why}")
            continue
        recipe = runplan.recipe(cfg, name_)
        cpu_recipes = rung(name_).cpu_recipes
        if dev.type == "cpu" and cpu_recipes and recipe not in cpu_recipes:
            recipe = cpu_recipes[0]
        try:
            ok, detail, figures = rungcheck.check(cfg.model, name_, recipe, size, num_classes, batches[name_], dev,
                                                  cfg.seed)
        except Exception as err:
            row(check, False, first_line(err))
            continue
        row(check, ok, f"{recipe}, batch {batches[name_]}: {detail}", **figures)
    tuned = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, freeze=("backbone",)))
    for precision in fine_tune:
        check = f"fine-tune {precision}"
        if no_step or (step_budget_s and fp32_s is not None and fp32_s > step_budget_s):
            row(check, None, "not stepped: " + (no_step or f"fp32's step took {fp32_s:.0f} s"))
            continue
        try:
            done = _step(tuned, precision, size, num_classes, dev, batches.get(precision, STEP_BATCH))
        except Exception as err:
            row(check, False, first_line(err))
            continue
        row(check, True, f"backbone frozen, {done['trained']:,} of {params:,} parameters trained and the rest "
                         f"unchanged; loss {done['loss']:.3f}, step {done['s']:.2f} s"
                         + (" (skipped: fp16 overflow)" if done["skipped"] else ""), s=done["s"])
    out["ok"] = all(r["ok"] is not False for r in rows)
    return out


def table(result: dict) -> str:
    """The rows as a Markdown table, under a line naming the model."""
    mark = {True: "ok", False: "FAIL", None: "-"}
    lines = [f"{result['model']}: {result['params'] / 1e6:,.1f}M parameters, {result['input_size']}x"
             f"{result['input_size']} inputs, {result['num_classes']} classes", "",
             "| check | result | detail |", "|---|---|---|"]
    lines += [f"| {r['check']} | {mark[r['ok']]} | {r['detail']} |" for r in result["rows"]]
    return "\n".join(lines)
