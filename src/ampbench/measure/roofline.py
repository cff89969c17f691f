"""The roofline: the least time a GPU's datasheet allows for one training step, from the op counter's count
(``measure.opcount``) and a datasheet row (``measure.flops``).

``step_time(ops, row, precision)``: each op takes max(FLOPs / the peak of the dtype it runs in, bytes /
memory bandwidth); their sum is the GPU's time. The host launches each kernel, one after another, at
``LAUNCH_US`` at least (the launch and PyTorch's dispatch), while the GPU runs the ones before: the step takes
the longer of the two, and a step whose launches take longer than its kernels is launch-bound. Eager kernels, no
fusion (``torch.compile`` fuses elementwise ops, moves fewer bytes and launches fewer kernels; CUDA graphs launch
a step at once); every kernel at its datasheet peak, which real kernels do not reach.
"""

from __future__ import annotations

import sys

import torch

from ampbench.errors import ConfigError
from ampbench.measure.flops import DATASHEET
from ampbench.measure.opcount import CATEGORIES, Op, for_config

# The least host time per kernel launched from eager PyTorch: a CUDA launch is a few microseconds (NVIDIA, "Getting
# Started with CUDA Graphs", https://developer.nvidia.com/blog/cuda-graphs/: back-to-back short kernels in a
# stream), and PyTorch's dispatch adds to it. A default; `make gpu-validate` measures a machine's (launch_floor).
LAUNCH_US = 4.0


def gpu_names() -> list[str]:
    return [row["name"] for _, row in DATASHEET]


def find_gpu(name: str) -> dict:
    """The datasheet row of a GPU named as in the table (case and spaces ignored) or as torch names it, or a
    ConfigError with the close matches."""
    def norm(s: str) -> str:
        return "".join(s.lower().split())
    rows = {norm(row["name"]): row for _, row in DATASHEET}
    if norm(name) in rows:
        return rows[norm(name)]
    from ampbench.measure.flops import MISSING, datasheet_row
    row = datasheet_row(name)  # as torch names the GPU: "NVIDIA A100-SXM4-80GB", or "A100" (the table's first match)
    if row:
        return row
    raise ConfigError(f"--gpu {name!r} is not in the datasheet table (a laptop, D or Grace part is not its desktop "
                      f"or datacenter namesake: other clocks, memory and power); the table has: "
                      f"{', '.join(gpu_names())} (or --gpu all); left out for want of a source: {'; '.join(MISSING)}")


def _rate(op: Op, precision: str, row: dict) -> float | None:
    """The peak (FLOP/s) an op's math runs at on ``row``'s GPU; None when that GPU cannot run its dtype."""
    from ampbench.precision import rung
    column = rung(precision).peak_column(op.dtype, row)
    peak = row.get(column) if column else None
    return peak * 1e12 if peak else None


def step_time(ops: list[Op], row: dict, precision: str, launch_us: float = LAUNCH_US) -> dict | None:
    """The roofline step time of ``ops`` on ``row``'s GPU: the longer of the kernels' time and their launches'
    (``launch_us`` each), with the kernels' memory-bound share, their time by category and whether the launches
    bound the step; None when the GPU has no rate for a dtype the step runs in (bf16 before Ampere)."""
    bandwidth = row["bandwidth_gbps"] * 1e9
    total = memory_bound = 0.0
    by_category = dict.fromkeys(CATEGORIES, 0.0)
    for op in ops:
        mem_s = op.bytes / bandwidth
        if op.flops:
            rate = _rate(op, precision, row)
            if rate is None:
                return None
            compute_s = op.flops / rate
        else:
            compute_s = 0.0
        t = max(compute_s, mem_s)
        total += t
        by_category[op.category] += t
        if mem_s >= compute_s:
            memory_bound += t
    kernels = sum(op.kernels for op in ops)
    launch_s = kernels * launch_us * 1e-6
    return {"step_s": max(total, launch_s), "kernels_s": total, "launch_s": launch_s, "kernels": kernels,
            "launch_bound": launch_s > total, "memory_bound_share": memory_bound / total if total else 0.0,
            "by_category_s": by_category}


def unavailable(precision: str, ops: list[Op], row: dict) -> str | None:
    """Why ``row``'s GPU has no roofline of its own for ``precision`` on this model (its cell would repeat another
    column's), or None: no such tensor cores, no TF32 before Ampere, or a converting rung that converts nothing."""
    from ampbench.precision import rung
    r = rung(precision)
    if r.tf32 and not row.get("tf32"):
        return f"no TF32 on {row['name']} (Ampere and later have it): {precision} runs as fp32 there"
    if not row.get(r.datasheet) or not r.runs_on(row):  # without fp8 tensor cores, no fp8 at all, whatever the model
        return f"no {r.datasheet} tensor cores on {row['name']}"
    # a converting rung's GEMMs reach its own column only where it converted: none, and its cell is another's
    if r.converts and not any(op.flops and r.peak_column(op.dtype, row) == r.datasheet for op in ops):
        return f"{precision} converts no layer of this model: it would run bf16"
    return None


def table(counted: dict[str, list[Op]], row: dict, batch: int, launch_us: float = LAUNCH_US) -> dict[str, dict]:
    """Per precision on one GPU: roofline step time, img/s, the ratio to strict fp32 and to tf32; ``{"na": why}``
    where the GPU has no roofline of its own for it (never another column's figures)."""
    out: dict[str, dict] = {}
    for precision, ops in counted.items():
        why = unavailable(precision, ops, row)
        t = None if why else step_time(ops, row, precision, launch_us)
        out[precision] = {"step_ms": t["step_s"] * 1e3, "imgs_per_s": batch / t["step_s"],
                          "kernels_ms": t["kernels_s"] * 1e3, "launch_ms": t["launch_s"] * 1e3,
                          "kernels": t["kernels"], "launch_bound": t["launch_bound"],
                          "memory_bound_share": t["memory_bound_share"]} if t else \
            {"na": why or f"no {precision} rate on {row['name']} for a dtype this step runs in"}
    for ref in ("fp32", "tf32"):
        base = out.get(ref)
        base = None if base is None or "na" in base else base
        for r in out.values():
            if "na" not in r:
                r[f"vs_{ref}"] = base["step_ms"] / r["step_ms"] if base else None
    return out


def available(cell: dict | None) -> bool:
    """A table cell with figures (not n/a)."""
    return bool(cell) and "na" not in cell


def closest_default(conv_flop_share: float) -> str:
    """Which rung a plain PyTorch run of this model is closest to: TF32 convolutions, IEEE fp32 matmuls."""
    return "tf32" if conv_flop_share >= 0.5 else "fp32"


ARTICLE_GPU = "RTX 5090"  # the article's card; its model, ResNet-18 (CIFAR stem), at its batch of 256


def article_record(make_optimizer) -> dict:
    """The article's ResNet-18 at batch 256, counted in fp32 and fp16: its roofline ratio on an RTX 5090."""
    from ampbench import config
    article = config.from_dict({"model": {"arch": "resnet18"}, "data": {"source": "synthetic"},
                                "train": {"batch_size": 256}})
    ops = for_config(article, make_optimizer, 256, ("fp32", "fp16"))["ops"]
    return _article(ops)


def _article(ops: dict) -> dict:
    ratio = table({p: ops[p] for p in ("fp32", "fp16")}, find_gpu(ARTICLE_GPU), 256)["fp16"]["vs_fp32"]
    return {"gpu": ARTICLE_GPU, "model": "resnet18", "batch": 256, "fp16_vs_fp32": ratio}


def record(cfg, gpu_name: str | None, make_optimizer, article: dict | None = None) -> dict:
    """What env_check writes as roofline.json for the report: the model's step counted per precision (fp8 only
    when a variant trains in it), its table on this GPU (when the datasheet has it), and the article's ResNet-18
    at batch 256 on an RTX 5090 (``article``: ``article_record``'s, counted already); ``make_optimizer(params,
    train)``: the optimizer of a train section, on meta tensors (``opcount.for_config``)."""
    from ampbench.measure.flops import datasheet_row
    from ampbench.precision import names, rung

    used = {v.precision for v in cfg.variants.values()}
    found = for_config(cfg, make_optimizer, precisions=tuple(p for p in names() if rung(p).always_counted or p in used))
    s = found["summary"]
    out = {"model": found["model"], "batch": found["batch"], "input_size": found["input_size"], "launch_us": LAUNCH_US,
           "flops": s["flops"], "bytes": s["bytes"], "conv_flop_share": s["conv_flop_share"],
           "closest_default": closest_default(s["conv_flop_share"]), "gpu": None}
    row = datasheet_row(gpu_name)
    if row:
        out["gpu"] = {"name": row["name"], "source": row["source"], "bandwidth_gbps": row["bandwidth_gbps"],
                      "table": table(found["ops"], row, found["batch"])}
    same = (cfg.model.arch, cfg.model.factory, found["batch"], found["input_size"]) == ("resnet18", "", 256, 32)
    out["article"] = _article(found["ops"]) if same else article or article_record(make_optimizer)
    return out


def record_cached(cfg, gpu_name: str | None, shape: dict, folder, make_optimizer) -> dict:
    """``record``, kept in ``folder`` (None: no cache) under a key of everything it depends on: the model (a
    factory's source too), the data's classes and image size (``shape``), the train section, the precisions the
    variants train in and the fp8 recipe, the GPU's name, torch, and the code of this counter and of
    ``make_optimizer``. env_check runs on every `dvc repro`, and counting a model on every run costs seconds that
    give the same answer."""
    import hashlib
    import json
    from pathlib import Path

    from ampbench import config, models, runplan
    from ampbench.results import atomic_write, source_digest, source_files

    if folder is None:
        return record(cfg, gpu_name, make_optimizer)
    here = Path(__file__).resolve()
    optimizer_code = Path(sys.modules[make_optimizer.__module__].__file__).resolve()  # the optimizer's entry too
    code = source_digest(source_files(here) + [here, optimizer_code])

    def cached(name: str, parts: dict, make):
        key = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
        path = Path(folder) / f"{name}-{key}.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass
        out = make()
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(out, sort_keys=True))
        for old in sorted(path.parent.glob(f"{name}-*.json"), key=lambda p: p.stat().st_mtime)[:-8]:
            old.unlink(missing_ok=True)  # the last 8 counts are kept
        return out

    def article():  # depends on nothing of the user's: counted once per torch and counter
        return cached("article", {"torch": torch.__version__, "code": code}, lambda: article_record(make_optimizer))

    return cached("roofline", {
        "model": config.to_dict(cfg.model), "model_source": models.source_hash(cfg.model), "shape": shape,
        "train": config.to_dict(cfg.train), "precisions": sorted({v.precision for v in cfg.variants.values()}),
        "recipes": {p: runplan.recipe(cfg, p) for p in sorted({v.precision for v in cfg.variants.values()})},
        "gpu": gpu_name, "torch": torch.__version__, "code": code,
    }, lambda: record(cfg, gpu_name, make_optimizer, article()))
