"""The params schema: frozen dataclasses, one per section of params.yaml, each field with its default, its
comment and its validation rules (``_opt``), and the helpers that read a built ``Config``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ampbench import precision
from ampbench.config import optim  # the optimizer registry (imports no torch)


def _recipes() -> tuple[str, ...]:
    """Every registered rung's recipes (each rung checks that a variant's is one of its own)."""
    return tuple(dict.fromkeys(r for rung in precision.RUNGS.values() for r in rung.recipes))


DATA_SOURCES = ("cifar10", "cifar100", "folder", "synthetic")  # each is a source in data.SOURCES
ARCH_NAMES = ("resnet18", "small_cnn", "vit_tiny")  # built in; "tv:<name>" is any torchvision classifier
BAD_FILES = ("skip", "stop")
PLACEMENTS = ("auto", "device", "stream")  # auto: device when the set fits beside the model, else stream
OPTIMIZER_IMPLS = ("auto", *optim.IMPLS)  # auto: fused on CUDA where it skips cleanly, foreach elsewhere


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
    sha256: str = ""              # checked too when given (64 hex digits): a checksum no one can forge a match for
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
    convert_ends: bool = False    # fp8, mxfp8: convert the first layer and classifier head too (torchao advises not)
    # fine-tuning: pretrained weights (a tv: model's torchvision weights name, e.g. DEFAULT, or a state dict file),
    # then frozen parameters (module-name prefixes, or [backbone]: all but the final classification layer)
    weights: str = ""
    freeze: tuple[str, ...] = ()
    freeze_bn: bool = False       # frozen BatchNorm layers stay in eval mode (running statistics as loaded)


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = _opt(10, lo=1)              # passes over the training set
    batch_size: int = _opt(256, lo=1)         # images per optimizer step (the effective batch)
    optimizer: str = _opt("sgd", choices=optim.names)  # sgd (Nesterov momentum) | adamw | adafactor
    lr: float = _opt(0.1, lo=0, lo_open=True)  # peak learning rate of the warm-up + cosine schedule
    momentum: float = _opt(0.9, lo=0, hi=1, hi_open=True)  # SGD momentum
    weight_decay: float = _opt(5e-4, lo=0)    # SGD: L2 penalty; AdamW, Adafactor: decoupled weight decay
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
    # torch.compile the model (first steps compile: raise warmup_steps); auto: the rungs only fast compiled (fp8,
    # mxfp8) on CUDA, the others eager; a run plan holds what it resolved to (true or false)
    compile: bool | str = _opt("auto", choices=(True, False, "auto"))
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
class PairedConfig:
    enabled: bool = True          # time the variants in turns in one process (A B C, C A B, ...): a drift between
    # the train stages cannot fake a speedup there; the verdict claims one from it when train.repeats is 1
    rounds: int = _opt(8, lo=1)   # turns per variant; 8 or more for a claim (every round must agree: a sign test)
    steps: int = _opt(20, lo=1)   # at least this many timed optimizer steps per turn, at train.batch_size
    window_s: float = _opt(0.2, lo=0.0)  # and at least this many seconds of them (sized once per variant)


@dataclass(frozen=True)
class DebugConfig:
    detect_anomaly: bool = False  # run training under torch.autograd.detect_anomaly (slow; finds the NaN's origin)


GRAD_COMMS = ("none", "fp16", "bf16")
STRATEGIES = ("ddp", "fsdp")


@dataclass(frozen=True)
class DistributedConfig:
    nproc_per_node: int = _opt(1, lo=1)  # training processes per machine (torchrun --nproc-per-node); 1 = one process
    backend: str = _opt("auto", choices=("auto", "nccl", "gloo"))  # auto = nccl on CUDA, gloo on a CPU
    grad_comm: str = _opt("none", choices=GRAD_COMMS)  # gradients all-reduced as fp32 (none), fp16 or bf16
    find_unused_parameters: bool = False  # DDP's own flag: for models with parameters the loss does not use
    strategy: str = _opt("ddp", choices=STRATEGIES)  # ddp (each rank holds the model) | fsdp (FSDP2: sharded)
    fsdp_reduce_dtype: str = _opt("fp32", choices=("fp32", "bf16"))  # bf16 under fsdp: its gradients' reduce-scatter


@dataclass(frozen=True)
class Variant:
    precision: str = _opt("fp32", choices=precision.names)  # a rung: fp32 (strict) | tf32 | fp16 | bf16 | fp8
    accum_steps: int = _opt(1, lo=1)                   # micro-batches per optimizer step
    ddp: bool = True              # false: one process even when distributed.nproc_per_node > 1 (the scaling baseline)
    strategy: str = _opt("", choices=("", *STRATEGIES))  # "" = distributed.strategy
    grad_comm: str = _opt("", choices=("", *GRAD_COMMS))  # "" = distributed.grad_comm
    recipe: str = _opt("", choices=lambda: ("", *_recipes()))  # fp8, mxfp8: its recipe; "" = its default
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
    seed: int = _opt(0, lo=0, hi=2 ** 31 - 1)  # seed for weights, data order and augmentation (a 31-bit number)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    amp: AmpConfig = field(default_factory=AmpConfig)
    variants: dict[str, Variant] = field(default_factory=_default_variants)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    paired: PairedConfig = field(default_factory=PairedConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)


def sweep_precisions(cfg: Config) -> tuple[str, ...]:
    """sweep.precisions, else the variants' precisions in their order."""
    return cfg.sweep.precisions or tuple(dict.fromkeys(v.precision for v in cfg.variants.values()))


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


def resolve_backend(cfg: DistributedConfig, device: str) -> str:
    """distributed.backend with auto resolved: nccl on CUDA, gloo on a CPU."""
    if cfg.backend != "auto":
        return cfg.backend
    return "nccl" if device == "cuda" else "gloo"
