"""The run plan: everything one ``train@<variant>`` stage reads, written by env_check as reports/plans/<v>.json.

    plan = runplan.make_plan(cfg, "amp", "cuda")   # from a validated Config
    runplan.write_plan(plan, path); runplan.read_plan(path)
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from ampbench.config import (
    AmpConfig,
    Config,
    DebugConfig,
    ModelConfig,
    ProfileConfig,
    TrainConfig,
    optim,
    resolve_backend,
    to_dict,
)
from ampbench.errors import ConfigError
from ampbench.precision import amp_settings, recipe_for, rung  # GradScaler settings where used; TF32 by precision


@dataclass(frozen=True)
class RunPlan:
    """Everything one ``train@<variant>`` stage reads, and nothing else.

    env_check writes one plan file per variant; a train stage depends on its own
    file, so editing ``amp.init_scale`` changes (and reruns) only the fp16 plans.
    """

    variant: str
    precision: str
    accum_steps: int
    device: str                   # resolved: cuda or cpu
    seed: int
    model: ModelConfig
    train: TrainConfig
    amp: AmpConfig | None         # None unless the precision uses a GradScaler (fp16)
    debug: DebugConfig = field(default_factory=DebugConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    model_source: str = ""        # hash of model.factory's source: editing it reruns the train stages
    ddp: bool = True              # train on every process torchrun starts (false: rank 0 alone)
    backend: str = "gloo"         # resolved process-group backend: nccl or gloo
    grad_comm: str = "none"       # the variant's gradient communication: none (fp32) | fp16 | bf16
    find_unused_parameters: bool = False  # DDP's find_unused_parameters (only where ddp is true)
    strategy: str = "ddp"         # data parallelism: ddp | fsdp (FSDP2, train/fsdp.py)
    fsdp_reduce_dtype: str = "fp32"  # fsdp, bf16: the gradients' reduce-scatter dtype
    recipe: str | None = None     # a rung with recipes (fp8, mxfp8) only: its recipe (absent from other plans' files)
    placement: str = "device"     # resolved data.placement: device | stream
    workers: int = 0              # stream only: DataLoader worker processes (both absent from a device plan's file)

    def __post_init__(self):
        # a plan holds whether it compiles (true or false): train.compile auto resolved for its precision and device,
        # however the plan was made (a benchmark's own TrainConfig too)
        if not isinstance(self.train.compile, bool):
            object.__setattr__(self, "train", dataclasses.replace(
                self.train, compile=resolve_compile(self.train.compile, self.precision, self.device)))


def make_plan(cfg: Config, variant: str, device: str, model_source: str = "", placement: str = "device",
              workers: int = 0) -> RunPlan:
    if variant not in cfg.variants:
        raise ConfigError(f"variant {variant!r} is not in params.yaml variants; "
                          f"defined: {', '.join(cfg.variants)}")
    v = cfg.variants[variant]
    # target_acc is read by the report only, not a reason to retrain; TF32 follows the precision; the optimizer's
    # implementation is the variant's own where it sets one, resolved for the device
    train = dataclasses.replace(cfg.train, target_acc=0.0, allow_tf32=rung(v.precision).tf32,
                                optimizer_impl=optimizer_impl(cfg, v.optimizer_impl, v.precision, device),
                                compile=compiled(cfg, v.precision, device))
    plan = RunPlan(variant=variant, precision=v.precision, accum_steps=v.accum_steps, device=device,
                   seed=cfg.seed, model=cfg.model, train=train, profile=cfg.profile,
                   amp=amp_settings(v.precision, cfg.amp), debug=cfg.debug,
                   model_source=model_source, ddp=v.ddp, backend=resolve_backend(cfg.distributed, device),
                   grad_comm=v.grad_comm or cfg.distributed.grad_comm,
                   find_unused_parameters=v.ddp and cfg.distributed.find_unused_parameters,
                   strategy=v.strategy or cfg.distributed.strategy, fsdp_reduce_dtype=cfg.distributed.fsdp_reduce_dtype,
                   recipe=recipe_for(v.precision, v.recipe),
                   placement=placement, workers=workers if placement == "stream" else 0)
    if plan.strategy == "fsdp" and plan.ddp:  # (ddp: false trains in one process: nothing to shard)
        plan = _check_fsdp(plan, v.optimizer_impl or cfg.train.optimizer_impl,
                           f"variant {variant!r} (strategy: fsdp): ")
    return plan


def _check_fsdp(plan: RunPlan, impl_setting: str, where: str = "") -> RunPlan:
    """What FSDP does not run here yet, refused in one line that names the fix; ``plan`` with the optimizer's
    implementation FSDP's DTensor parameters take (SGD's fused kernel has no DTensor rule: auto is foreach)."""
    if plan.train.optimizer == "adafactor":
        raise ConfigError(f"{where}adafactor's factored state does not run over FSDP's sharded parameters; use "
                          "train.optimizer: sgd or adamw, or give this variant strategy: ddp")
    if plan.train.optimizer_impl == "fused" and plan.train.optimizer == "sgd":
        if impl_setting == "fused":
            raise ConfigError(f"{where}optimizer_impl fused has no kernel for FSDP's sharded parameters with "
                              "sgd; use optimizer_impl: foreach (or auto)")
        plan = dataclasses.replace(plan, train=dataclasses.replace(plan.train, optimizer_impl="foreach"))
    if plan.grad_comm != "none":
        raise ConfigError(f"{where}grad_comm {plan.grad_comm} is DDP's gradient compression; FSDP reduce-scatters "
                          "the gradients in distributed.fsdp_reduce_dtype: set grad_comm: none for it")
    r = rung(plan.precision)
    why = r.fsdp_refuses(plan.recipe)
    if why:
        fix = f"set recipe: {r.fsdp_recipes[0]}, or" if r.fsdp_recipes else "use another precision, or"
        raise ConfigError(f"{where}{why}; {fix} give this variant strategy: ddp")
    return plan


def fsdp_refusal(cfg: Config, precision: str) -> str | None:
    """Why ``precision`` with params.yaml's settings would not train under FSDP on a GPU (``_check_fsdp``'s
    refusal, said without a variant: the roofline for N GPUs), or None."""
    plan = dataclasses.replace(for_precision(cfg, precision, "cuda"), strategy="fsdp", ddp=True)
    try:
        _check_fsdp(plan, cfg.train.optimizer_impl)
    except ConfigError as err:
        return str(err)
    return None


def for_precision(cfg: Config, precision: str, device: str) -> RunPlan:
    """The plan of a batch-size sweep point's short run: ``precision`` with params.yaml's model, training
    settings and loss scale, in one process; compiled only where the rung is fast only compiled and training
    compiles it (each swept batch size compiles anew)."""
    return RunPlan(variant=f"sweep-{precision}", precision=precision, accum_steps=1, device=device, seed=cfg.seed,
                   model=cfg.model, train=dataclasses.replace(
                       cfg.train, compile=rung(precision).fast_compiled and compiled(cfg, precision, device),
                       allow_tf32=rung(precision).tf32,
                       optimizer_impl=optimizer_impl(cfg, "", precision, device)),
                   amp=amp_settings(precision, cfg.amp), ddp=False,
                   recipe=recipe(cfg, precision))


def compiled(cfg: Config, precision: str, device: str) -> bool:
    """Whether ``precision`` trains compiled under params.yaml's train.compile."""
    return resolve_compile(cfg.train.compile, precision, device)


def resolve_compile(value: bool | str, precision: str, device: str) -> bool:
    """train.compile with auto resolved: a rung fast only under torch.compile, on CUDA (a CPU runs it eager, since
    compiling would cost minutes there)."""
    if value == "auto":
        return device == "cuda" and rung(precision).fast_compiled
    return bool(value)


def optimizer_impl(cfg: Config, impl: str, precision: str, device: str) -> str:
    """A variant's optimizer implementation (``impl``: its own, "" for train.optimizer_impl) with auto resolved
    by the optimizer's registry entry for the device and whether ``precision`` steps it through a GradScaler."""
    impl = impl or cfg.train.optimizer_impl
    return optim.info(cfg.train.optimizer).auto_impl(device, rung(precision).grad_scaler) if impl == "auto" else impl


def recipe(cfg: Config, precision: str) -> str | None:
    """The recipe ``precision`` runs with where no variant names one (the sweep, the roofline, the census): that
    of its first variant, else the rung's default; None for a rung that takes no recipe."""
    return recipe_for(precision, next((v.recipe for v in cfg.variants.values() if v.precision == precision),
                                      None))


def write_plan(plan: RunPlan, path: Path) -> None:
    """The plan as JSON; ``recipe`` only in a plan of a rung with recipes, the data placement only when it
    streams, the FSDP keys only under FSDP, and ``model.convert_ends`` and the fine-tuning keys only when set, so
    the other plans' files (train-stage deps) stay as they were before these existed and their stages do not
    rerun."""
    path.parent.mkdir(parents=True, exist_ok=True)
    d = to_dict(plan)
    if d["recipe"] is None:
        del d["recipe"]
    if d["placement"] == "device":
        del d["placement"], d["workers"]
    if d["strategy"] == "ddp":  # FSDP's keys only in an FSDP plan
        del d["strategy"], d["fsdp_reduce_dtype"]
    d["model"] = model_dict(plan.model)
    if not d["model"]["convert_ends"]:
        del d["model"]["convert_ends"]
    from ampbench.results import atomic_write
    atomic_write(path, json.dumps(d, indent=2, sort_keys=True) + "\n")  # a train stage's dep: never half-written


def model_dict(model: ModelConfig) -> dict:
    """The model's settings as a plan and a checkpoint's fingerprint hold them: the fine-tuning keys only where
    set, so what was written before they existed still matches."""
    d = to_dict(model)
    for key in ("weights", "freeze", "freeze_bn"):
        if not d[key]:
            del d[key]
    return d


def read_plan(path: str | Path) -> RunPlan:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no run plan; run the env_check stage first (dvc repro)")
    raw = json.loads(path.read_text())
    raw["train"]["betas"] = tuple(raw["train"].get("betas", TrainConfig.betas))  # JSON gives a list
    raw["model"]["freeze"] = tuple(raw["model"].get("freeze", ()))
    return RunPlan(
        variant=raw["variant"], precision=raw["precision"], accum_steps=raw["accum_steps"],
        device=raw["device"], seed=raw["seed"], model=ModelConfig(**raw["model"]),
        train=TrainConfig(**raw["train"]), amp=AmpConfig(**raw["amp"]) if raw["amp"] else None,
        debug=DebugConfig(**raw.get("debug", {})),  # a plan's "mlflow" (older plans) is not read
        profile=ProfileConfig(**raw.get("profile", {})),
        model_source=raw.get("model_source", ""), ddp=raw.get("ddp", True), backend=raw.get("backend", "gloo"),
        grad_comm=raw.get("grad_comm", "none"), find_unused_parameters=raw.get("find_unused_parameters", False),
        strategy=raw.get("strategy", "ddp"), fsdp_reduce_dtype=raw.get("fsdp_reduce_dtype", "fp32"),
        recipe=raw.get("recipe", raw.get("fp8_recipe")),  # an older plan's name for it
        placement=raw.get("placement", "device"), workers=raw.get("workers", 0))
