"""params.yaml into frozen dataclasses: the only reader of params.yaml.

Every field has a default and a comment. Unknown keys and bad values raise
``ConfigError`` with one line naming the key, the bad value and what is
allowed. Integers are accepted where floats are expected.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse, urlsplit, urlunsplit

import yaml

from ampbench import precision
from ampbench.errors import ConfigError


def _recipes() -> tuple[str, ...]:
    """Every registered rung's recipes (each rung checks that a variant's is one of its own)."""
    return tuple(dict.fromkeys(r for rung in precision.RUNGS.values() for r in rung.recipes))


DATA_SOURCES = ("cifar10", "cifar100", "folder", "synthetic")  # each is a source in data.SOURCES
ARCH_NAMES = ("resnet18", "small_cnn", "vit_tiny")  # built in; "tv:<name>" is any torchvision classifier
OPTIMIZERS = ("sgd", "adamw")
BAD_FILES = ("skip", "stop")
PLACEMENTS = ("auto", "device", "stream")  # auto: device when the set fits beside the model, else stream
OPTIMIZER_IMPLS = ("auto", "fused", "foreach", "for_loop")  # auto: fused on CUDA, foreach elsewhere
# Each optimizer's own defaults for what params.yaml leaves out: SGD's lr 0.1 makes AdamW diverge, and AdamW's
# decoupled weight decay is not SGD's L2 penalty.
OPTIMIZER_DEFAULTS = {"sgd": {"lr": 0.1, "weight_decay": 5e-4}, "adamw": {"lr": 1e-3, "weight_decay": 0.05}}
ADAMW_MAX_LR = 0.01  # above it an AdamW learning rate is an SGD value brought over


def _opt(default: Any, *, choices: tuple | None = None, lo: float | None = None,
         hi: float | None = None, lo_open: bool = False, hi_open: bool = False,
         nonempty: bool = False, length: int | None = None) -> Any:
    """A dataclass field with its validation rules kept in metadata (``length``: a list of exactly that many
    values, which may repeat; other lists list each value once)."""
    meta = {"choices": choices, "lo": lo, "hi": hi, "lo_open": lo_open,
            "hi_open": hi_open, "nonempty": nonempty, "length": length}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class DataConfig:
    source: str = _opt("cifar10", choices=DATA_SOURCES)  # where the images come from
    url: str = ""                 # "" = the official archive of data.source; or a mirror / file:// URL
    md5: str = ""                 # "" = the official archive's checksum; give one with a different archive
    archive: str = ""             # a local copy of the archive to use instead of downloading
    path: str = ""                # source folder: an ImageFolder tree (path/<class>/<image>)
    image_size: int = _opt(32, lo=8)  # source folder: images are resized to image_size x image_size once
    train_size: int = _opt(0, lo=0)  # training images to use (0 = all)
    test_size: int = _opt(0, lo=0)   # evaluation images to use (0 = all; a folder without splits holds out 10%)
    placement: str = _opt("auto", choices=PLACEMENTS)  # device: the set resident on the device; stream: DataLoader
    workers: int = _opt(-1, lo=-1)   # stream: worker processes (-1 = usable cores / distributed.nproc_per_node)
    bad_files: str = _opt("skip", choices=BAD_FILES)  # source folder: an unreadable image is skipped, named in a
    # warning (skip), or stops the stage, named (stop); files that are not images by suffix are always skipped


@dataclass(frozen=True)
class ModelConfig:
    arch: str = "resnet18"        # resnet18 (CIFAR stem) | small_cnn | vit_tiny | tv:<torchvision model name>
    factory: str = ""             # "package.module:function": returns your nn.Module given num_classes; wins over arch
    input_size: int = _opt(0, lo=0)  # side of the images fed to the model, resized on the device (0 = the data's)
    channels_last: bool = True    # NHWC memory layout, which tensor-core convolutions prefer


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = _opt(10, lo=1)              # passes over the training set
    batch_size: int = _opt(256, lo=1)         # images per optimizer step (the effective batch)
    optimizer: str = _opt("sgd", choices=OPTIMIZERS)  # sgd (Nesterov momentum) | adamw
    lr: float = _opt(0.1, lo=0, lo_open=True)  # peak learning rate of the warm-up + cosine schedule
    momentum: float = _opt(0.9, lo=0, hi=1, hi_open=True)  # SGD momentum
    weight_decay: float = _opt(5e-4, lo=0)    # SGD: L2 penalty; AdamW: decoupled weight decay
    betas: tuple[float, ...] = _opt((0.9, 0.999), lo=0, hi=1, hi_open=True, length=2)  # AdamW's moment decay rates
    eps: float = _opt(1e-8, lo=0, lo_open=True)  # AdamW's denominator term
    optimizer_impl: str = _opt("auto", choices=OPTIMIZER_IMPLS)  # auto = fused on CUDA, foreach elsewhere
    clip_grad_norm: float = _opt(0.0, lo=0)   # clip the gradients' total norm to this (0 = off)
    log_grad_norm: bool = False               # record the gradient norm of every step with clipping off too
    warmup_steps: int = _opt(20, lo=0)        # first optimizer steps, excluded from timing
    allow_tf32: bool = False                  # set in a run plan from its precision (tf32), not in params.yaml
    eval_batch_size: int = _opt(1024, lo=1)   # images per evaluation batch
    augment: bool = True                      # random crop (4-pixel padding) and flip, on the device
    repeats: int = _opt(1, lo=1)              # trainings per variant, seeds seed, seed+1, ...: mean and spread
    compile: bool = False                     # torch.compile the model (first steps compile: raise warmup_steps)
    target_acc: float = _opt(0.0, lo=0, hi=1)  # report each variant's training time to this eval accuracy (0 = off)


@dataclass(frozen=True)
class AmpConfig:
    init_scale: float = _opt(8192.0, lo=0, lo_open=True)      # starting loss scale (PyTorch's default is 65536)
    growth_factor: float = _opt(2.0, lo=1, lo_open=True)      # scale multiplier after growth_interval clean steps
    backoff_factor: float = _opt(0.5, lo=0, hi=1, lo_open=True, hi_open=True)  # scale multiplier on overflow
    growth_interval: int = _opt(2000, lo=1)                   # clean steps before the scale grows
    max_consecutive_nonfinite: int = _opt(10, lo=1)  # inf/NaN-loss steps in a row (each skipped) before stopping
    audit_batches: int = _opt(2, lo=0)               # batches for the fp16 numerics audit (0 = no audit)


@dataclass(frozen=True)
class ProfileConfig:
    steps: int = _opt(3, lo=0)    # optimizer steps profiled with torch.profiler after training (0 = no profile)


@dataclass(frozen=True)
class SweepConfig:
    enabled: bool = True          # run the batch-size sweep stage (false: it writes an empty result in a second)
    batch_sizes: tuple[int, ...] = _opt((32, 64, 128, 256, 512, 1024), lo=1, nonempty=True)  # batches to time
    steps: int = _opt(10, lo=1)   # timed optimizer steps per point, after 2 untimed ones (no full training)
    precisions: tuple[str, ...] = _opt((), choices=precision.names)  # precisions to sweep; () = those of the variants
    find_max: bool = True         # the largest batch that fits: searched on CUDA, estimated on a CPU
    memory_limit_gib: float = _opt(0.0, lo=0)  # cap the process's GPU memory, e.g. 24 for a 24 GB card (0 = all)
    # on a CPU, a point is left out (with the larger batches of its precision) when the last point's time per
    # image says it would take longer than this; a GPU measures every point (0 = no limit)
    cpu_point_budget_s: float = _opt(20.0, lo=0)


@dataclass(frozen=True)
class DebugConfig:
    detect_anomaly: bool = False  # run training under torch.autograd.detect_anomaly (slow; finds the NaN's origin)


GRAD_COMMS = ("none", "fp16", "bf16")


@dataclass(frozen=True)
class DistributedConfig:
    nproc_per_node: int = _opt(1, lo=1)  # training processes per machine (torchrun --nproc-per-node); 1 = one process
    backend: str = _opt("auto", choices=("auto", "nccl", "gloo"))  # auto = nccl on CUDA, gloo on a CPU
    grad_comm: str = _opt("none", choices=GRAD_COMMS)  # gradients all-reduced as fp32 (none), fp16 or bf16
    find_unused_parameters: bool = False  # DDP's own flag: for models with parameters the loss does not use


@dataclass(frozen=True)
class Variant:
    precision: str = _opt("fp32", choices=precision.names)  # a rung: fp32 (strict) | tf32 | fp16 | bf16 | fp8
    accum_steps: int = _opt(1, lo=1)                   # micro-batches per optimizer step
    ddp: bool = True              # false: one process even when distributed.nproc_per_node > 1 (the scaling baseline)
    grad_comm: str = _opt("", choices=("", *GRAD_COMMS))  # "" = distributed.grad_comm
    fp8_recipe: str = _opt("", choices=lambda: ("", *_recipes()))  # fp8, mxfp8: its recipe; "" = its default
    optimizer_impl: str = _opt("", choices=("", *OPTIMIZER_IMPLS))  # "" = train.optimizer_impl


@dataclass(frozen=True)
class MlflowConfig:
    enabled: bool = True          # log runs to MLflow (results are on disk either way)
    experiment: str = _opt("ampbench", nonempty=True)  # MLflow experiment name
    tracking_uri: str = ""        # "" = $MLFLOW_TRACKING_URI, else sqlite:///<repo>/mlflow.db
    log_model: bool = True        # each variant's trained model as an MLflow LoggedModel (loadable with its code)


def _default_variants() -> dict[str, Variant]:
    return {"fp32": Variant("fp32", 1), "tf32": Variant("tf32", 1), "amp": Variant("fp16", 1),
            "amp_accum": Variant("fp16", 4)}


@dataclass(frozen=True)
class Config:
    device: str = _opt("auto", choices=("auto", "cuda", "cpu"))  # where to train
    seed: int = _opt(0, lo=0)     # seed for weights, data order and augmentation
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    amp: AmpConfig = field(default_factory=AmpConfig)
    variants: dict[str, Variant] = field(default_factory=_default_variants)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)


def sweep_precisions(cfg: Config) -> tuple[str, ...]:
    """sweep.precisions, else the variants' precisions in their order."""
    return cfg.sweep.precisions or tuple(dict.fromkeys(v.precision for v in cfg.variants.values()))


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_VARIANT_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")


def _where(path: str, value: Any) -> str:
    return f"params.yaml: {path} = {value!r}"


def _check_scalar(path: str, value: Any, typ: type, meta: dict) -> Any:
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, typ) and (typ is bool or not isinstance(value, bool))
    if not ok:
        raise ConfigError(f"{_where(path, value)} is not {_TYPE_NAMES[typ]}; set it to {_TYPE_NAMES[typ]}")
    choices = meta.get("choices")
    choices = choices() if callable(choices) else choices  # a registry's names, read when checked
    if choices and value not in choices:
        allowed = " | ".join(c if c != "" else '""' for c in choices)
        raise ConfigError(f"{_where(path, value)} is not allowed; choose one of: {allowed}")
    if meta.get("nonempty") and not value.strip():
        raise ConfigError(f"{_where(path, value)} is empty; give it a name")
    lo, hi = meta.get("lo"), meta.get("hi")
    if lo is not None and (value < lo or (meta["lo_open"] and value == lo)):
        raise ConfigError(f"{_where(path, value)} is out of range; it must be {'>' if meta['lo_open'] else '>='} {lo}")
    if hi is not None and (value > hi or (meta["hi_open"] and value == hi)):
        raise ConfigError(f"{_where(path, value)} is out of range; it must be {'<' if meta['hi_open'] else '<='} {hi}")
    return value


def _build(cls: type, raw: Any, path: str) -> Any:
    """Build dataclass ``cls`` from ``raw``, checking keys, types and ranges."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{_where(path, raw)} is not a mapping; write it as '{path}:' followed by indented keys")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in raw:
        if key not in fields:
            name = f"{path}.{key}" if path else str(key)
            raise ConfigError(f"params.yaml: unknown key '{name}'; allowed here: {', '.join(fields)}")
    values = {}
    for name, f in fields.items():
        if name not in raw:
            continue
        sub = f"{path}.{name}" if path else name
        typ = hints[name]
        if name == "variants":
            values[name] = _build_variants(raw[name], sub)
        elif dataclasses.is_dataclass(typ):
            values[name] = _build(typ, raw[name], sub)
        elif typing.get_origin(typ) is tuple:
            values[name] = _check_list(sub, raw[name], typing.get_args(typ)[0], dict(f.metadata))
        else:
            values[name] = _check_scalar(sub, raw[name], typ, dict(f.metadata))
    return cls(**values)


def _check_list(path: str, value: Any, typ: type, meta: dict) -> tuple:
    """A YAML list of scalars, each checked like a scalar field; no repeats."""
    if not isinstance(value, list | tuple):  # a tuple: a dict made by to_dict
        raise ConfigError(f"{_where(path, value)} is not a list; write it as [a, b, ...]")
    if meta.get("nonempty") and not value:
        raise ConfigError(f"{_where(path, value)} is empty; give at least one value")
    if meta.get("length") is not None and len(value) != meta["length"]:
        raise ConfigError(f"{_where(path, value)} has {len(value)} values; give exactly {meta['length']}")
    items = tuple(_check_scalar(f"{path}[{i}]", v, typ, {**meta, "nonempty": False}) for i, v in enumerate(value))
    if meta.get("length") is None and len(set(items)) != len(items):
        raise ConfigError(f"{_where(path, value)} repeats a value; list each once")
    return items


def _build_variants(raw: Any, path: str) -> dict[str, Variant]:
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{_where(path, raw)} must be a non-empty mapping of name -> "
                          "{precision, accum_steps}, e.g. 'fp32: {precision: fp32, accum_steps: 1}'")
    out = {}
    for name, spec in raw.items():
        if not isinstance(name, str) or not _VARIANT_NAME.match(name):
            raise ConfigError(f"params.yaml: variant name {name!r} is not allowed; use letters, digits, "
                              "'_' or '-', starting with a letter")
        out[name] = _build(Variant, spec, f"{path}.{name}")
    return out


def _cross_check(cfg: Config) -> None:
    nproc = cfg.distributed.nproc_per_node
    for name, v in cfg.variants.items():
        own = precision.rung(v.precision).recipes
        if v.fp8_recipe and v.fp8_recipe not in own:
            raise ConfigError(f"{_where(f'variants.{name}.fp8_recipe', v.fp8_recipe)} is not a recipe of precision "
                              f"{v.precision}; " + (f"choose one of: {' | '.join(own)}, or \"\" for {own[0]}" if own
                                                    else "it takes none: delete fp8_recipe"))
        if cfg.train.batch_size % v.accum_steps:
            raise ConfigError(
                f"params.yaml: variants.{name}.accum_steps = {v.accum_steps} does not divide "
                f"train.batch_size = {cfg.train.batch_size}; choose a divisor of the batch size, e.g. 1, 2 or 4")
        world = variant_world(cfg, name)
        if world > 1 and cfg.train.batch_size % (world * v.accum_steps):
            raise ConfigError(
                f"params.yaml: train.batch_size = {cfg.train.batch_size} does not split into "
                f"distributed.nproc_per_node = {nproc} processes x variants.{name}.accum_steps = {v.accum_steps} "
                f"equal micro-batches; choose a batch size that is a multiple of {world * v.accum_steps}")
    t = cfg.train
    if t.optimizer == "adamw" and t.lr > ADAMW_MAX_LR:
        raise ConfigError(f"params.yaml: train.lr = {t.lr:g} is an SGD learning rate; AdamW diverges at it: set "
                          f"train.lr to about {OPTIMIZER_DEFAULTS['adamw']['lr']:g} (at most {ADAMW_MAX_LR:g}), "
                          "or delete it for AdamW's default")
    d = cfg.data
    url = urlparse(d.url)
    if d.url and (url.scheme not in ("http", "https", "file") or not (url.netloc or url.path)):
        raise ConfigError(f"{_where('data.url', d.url)} is not a download URL; use http://, https:// or file:// "
                          "(a mirror of the archive), or \"\" for the official one")
    if d.md5 and not re.fullmatch(r"[0-9a-f]{32}", d.md5):
        raise ConfigError(f"{_where('data.md5', d.md5)} is not an MD5 checksum (32 hex digits); "
                          "use \"\" for the official archive's")
    if d.source == "folder" and not d.path:
        raise ConfigError("params.yaml: data.source = 'folder' needs data.path, the image folder "
                          "(path/<class>/<image>); set data.path")
    m = cfg.model
    if m.factory and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", m.factory):
        raise ConfigError(f"{_where('model.factory', m.factory)} is not 'package.module:function'; e.g. "
                          "'models.my_net:build' for a function build(num_classes) in models/my_net.py")
    if not (m.arch in ARCH_NAMES or (m.arch.startswith("tv:") and len(m.arch) > 3)):
        raise ConfigError(f"{_where('model.arch', m.arch)} is not allowed; choose one of: "
                          f"{' | '.join(ARCH_NAMES)} | tv:<torchvision model>, e.g. tv:resnet50")


def project_root(cwd: Path) -> Path:
    """The repository a stage belongs to: $DVC_ROOT, which DVC sets to the repository an experiment was queued
    from when it runs in a temporary workspace (``dvc exp run --queue``, ``--temp``), else ``cwd``."""
    return Path(os.environ.get("DVC_ROOT") or cwd).resolve()


def redact(uri: str) -> str:
    """A tracking URI fit to print or log: a password in it (``postgresql://user:secret@host/db``, ``?password=``)
    replaced by ***."""
    parts = urlsplit(uri)
    netloc = parts.netloc
    if parts.password:
        netloc = netloc.replace(f":{parts.password}@", ":***@", 1)
    query = re.sub(r"(?i)((?:password|passwd|pwd|token|secret)=)[^&]*", r"\1***", parts.query)
    return urlunsplit(parts._replace(netloc=netloc, query=query)) if (netloc, query) != (parts.netloc, parts.query) \
        else uri


def redact_text(text: str) -> str:
    """Any ``scheme://user:password@`` in a message (an error naming the URI it failed on) with *** for the
    password."""
    return re.sub(r"(://[^:/@\s]+:)[^@\s]+@", r"\1***@", text)


def tracking_uri(cfg: MlflowConfig, repo_root: Path) -> str:
    """Where MLflow runs go: $MLFLOW_TRACKING_URI, else params.yaml's, else this repository's own store (the
    queuing repository's for a queued experiment: a temporary workspace's store would be deleted with it)."""
    env = os.environ.get("MLFLOW_TRACKING_URI", "")
    if env:
        return env
    if cfg.tracking_uri:
        return cfg.tracking_uri
    return f"sqlite:///{project_root(repo_root) / 'mlflow.db'}"


def _migrate(raw: dict) -> dict:
    """An older params.yaml, brought up to date with one line on stderr per change.

    ``train.allow_tf32`` is gone: TF32 is a precision of its own (a variant's ``precision: tf32``), so strict
    fp32 and TF32 can be measured side by side. ``allow_tf32: true`` made the fp32 variants TF32: they become
    ``precision: tf32``.
    """
    train = raw.get("train")
    if not isinstance(train, dict) or "allow_tf32" not in train:
        return raw
    _check_scalar("train.allow_tf32", train["allow_tf32"], bool, {})
    raw = {**raw, "train": {k: v for k, v in train.items() if k != "allow_tf32"}}
    variants = raw.get("variants") if isinstance(raw.get("variants"), dict) else dict(
        (n, to_dict(v)) for n, v in _default_variants().items())
    has_tf32 = any(isinstance(v, dict) and v.get("precision") == "tf32" for v in variants.values())
    if train["allow_tf32"] is True and not has_tf32:
        raw["variants"] = {**variants, "tf32": {"precision": "tf32", "accum_steps": 1}} if "tf32" not in variants \
            else variants
        print("params.yaml: train.allow_tf32 is replaced by the precision tf32: a tf32 variant now runs beside the "
              "fp32 ones, which are strict IEEE fp32; write `tf32: {precision: tf32, accum_steps: 1}` under variants "
              "and delete train.allow_tf32", file=sys.stderr)
    else:
        print("params.yaml: train.allow_tf32 is replaced by the precision tf32 (fp32 stays strict IEEE fp32); "
              "delete train.allow_tf32, and add `tf32: {precision: tf32, accum_steps: 1}` to variants to measure "
              "TF32", file=sys.stderr)
    return raw


def _optimizer_defaults(raw: dict) -> dict:
    """``train.lr`` and ``train.weight_decay`` left out: the chosen optimizer's own defaults."""
    train = raw.get("train")
    if not isinstance(train, dict) or train.get("optimizer") not in OPTIMIZER_DEFAULTS:
        return raw
    return {**raw, "train": {**OPTIMIZER_DEFAULTS[train["optimizer"]], **train}}


def from_dict(raw: Any) -> Config:
    """Validate a parsed params mapping and return the frozen ``Config``."""
    if raw is None:
        raise ConfigError("params.yaml is empty; copy the committed params.yaml and edit it")
    if isinstance(raw, dict):
        raw = _optimizer_defaults(_migrate(raw))
    cfg = _build(Config, raw, "")
    _cross_check(cfg)
    return cfg


def load(path: str | Path = "params.yaml") -> Config:
    """Read and validate params.yaml."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such file; run from the repository root, where params.yaml lives")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or "not valid YAML"
        raise ConfigError(f"{path}: broken YAML{where}: {problem}; fix the indentation or quoting there") from None
    return from_dict(raw)


def to_dict(cfg: Any) -> dict:
    """A plain nested dict of a config dataclass."""
    return dataclasses.asdict(cfg)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """``{"train": {"lr": 0.1}}`` -> ``{"train.lr": 0.1}``, for MLflow params and tables."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def variant_world(cfg: Config, variant: str) -> int:
    """Processes per machine the variant trains in: distributed.nproc_per_node, or 1 with ddp: false."""
    return cfg.distributed.nproc_per_node if cfg.variants[variant].ddp else 1


def resolve_workers(workers: int, cpu_count: int | None, nproc: int) -> int:
    """data.workers with -1 resolved: this machine's cores shared among the training processes, at least one."""
    return workers if workers >= 0 else max(1, (cpu_count or 1) // nproc)


def resolve_optimizer_impl(impl: str, device: str) -> str:
    """train.optimizer_impl with auto resolved: fused on CUDA (one kernel for the whole update, and a GradScaler
    that steps it with no host sync), foreach elsewhere."""
    if impl != "auto":
        return impl
    return "fused" if device == "cuda" else "foreach"


def resolve_backend(cfg: DistributedConfig, device: str) -> str:
    """distributed.backend with auto resolved: nccl on CUDA, gloo on a CPU."""
    if cfg.backend != "auto":
        return cfg.backend
    return "nccl" if device == "cuda" else "gloo"
