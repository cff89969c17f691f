"""Models by name: the built-in ones, any torchvision classification model, or the user's own factory.

``model.arch`` in params.yaml picks one of ``ARCHS`` (``resnet18`` with a CIFAR
stem, ``small_cnn``, ``vit_tiny``) or ``tv:<name>``, built with
``torchvision.models.get_model(name, weights=None, num_classes=...)``; GoogLeNet
and Inception v3 without their auxiliary heads (``NO_AUX``), so that every model
returns one tensor of logits in training and the step, the profile and the
roofline follow one graph. ``model.factory: "package.module:function"``
(importable from the repository root) builds the user's own ``nn.Module``
instead. ``check`` builds the model once on the CPU and pushes two images
through it, so a broken factory or an input size the model cannot take stops
env_check with one line (``input_size_fix`` finds the size it takes), before any
training.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib
import inspect
import io
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ampbench.config import DistributedConfig, ModelConfig
from ampbench.errors import ConfigError, first_line
from ampbench.models import finetune
from ampbench.models.cifar import resnet18_cifar, small_cnn
from ampbench.models.vit import PATCH, vit_tiny

ARCHS: dict[str, Callable[..., nn.Module]] = {"resnet18": resnet18_cifar, "small_cnn": small_cnn,
                                              "vit_tiny": vit_tiny}
TV_PREFIX = "tv:"
# torchvision models that return auxiliary logits in training mode, built without those heads (their papers add the
# auxiliary losses to help a deep network train from scratch; the precision comparison needs one graph per step)
NO_AUX = {"googlenet": {"aux_logits": False, "init_weights": True},
          "inception_v3": {"aux_logits": False, "init_weights": True}}
# sides tried, in order, for a model that does not take the data's: the smallest that works, then between it and the
# size below it (a model with a minimum size), ending with ImageNet's sizes (a model built for one size)
_SIDES = (32, 48, 64, 96, 128, 160, 192, 224, 256, 299, 320, 384, 448, 512, 518)

__all__ = ["ARCHS", "NO_AUX", "build", "build_meta", "check", "describe", "input_size_fix", "name", "resnet18_cifar",
           "small_cnn", "source_hash", "source_record", "takes", "torchvision_names", "vit_tiny"]


def torchvision_names() -> list[str]:
    """torchvision's classification models (not detection, segmentation or video ones)."""
    import torchvision.models  # imported where used: a second or two that a small_cnn run need not pay
    return torchvision.models.list_models(module=torchvision.models)


def name(cfg: ModelConfig) -> str:
    """What the report calls the model: the factory when there is one, else ``arch``."""
    return cfg.factory or cfg.arch


def _import_factory(spec: str) -> Callable:
    module_name, _, attr = spec.partition(":")
    root = str(Path.cwd())
    if root not in sys.path:  # the factory lives in the repository, e.g. models/my_net.py
        sys.path.insert(0, root)
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # any error in the user's module: say which, and where
        raise ConfigError(f"params.yaml: model.factory = {spec!r}: importing {module_name} failed "
                          f"({first_line(err)}); the module must "
                          f"be importable from the repository root ({root})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"params.yaml: model.factory = {spec!r}: {module_name} has no function {attr!r}; "
                          "name a function that takes num_classes and returns an nn.Module")
    return fn


def _builder(cfg: ModelConfig) -> Callable[[int, int], nn.Module]:
    """A function (num_classes, image_size) -> nn.Module for this config."""
    if cfg.factory:
        fn = _import_factory(cfg.factory)
        takes_size = "image_size" in inspect.signature(fn).parameters

        def call(num_classes: int, image_size: int) -> nn.Module:
            try:
                model = fn(num_classes=num_classes, image_size=image_size) if takes_size \
                    else fn(num_classes=num_classes)
            except Exception as err:
                raise ConfigError(f"params.yaml: model.factory = {cfg.factory!r} raised {first_line(err)}; "
                                  "fix the factory, or call it "
                                  "by hand to see the traceback") from None
            if not isinstance(model, nn.Module):
                raise ConfigError(f"params.yaml: model.factory = {cfg.factory!r} returned a "
                                  f"{type(model).__name__}, not a torch.nn.Module; return the model itself")
            return model
        return call
    if cfg.arch.startswith(TV_PREFIX):
        tv_name = cfg.arch[len(TV_PREFIX):]
        known = torchvision_names()
        if tv_name not in known:
            some = ", ".join(n for n in ("resnet50", "mobilenet_v3_small", "efficientnet_b0", "convnext_tiny",
                                         "vit_b_16") if n in known)
            raise ConfigError(f"params.yaml: model.arch = {cfg.arch!r}: torchvision has no classification model "
                              f"{tv_name!r}; use one of torchvision.models.list_models(), e.g. {some}")
        extra = {**NO_AUX.get(tv_name, {}), **finetune.structure(cfg, tv_name)}
        import torchvision.models
        return lambda num_classes, image_size: torchvision.models.get_model(tv_name, weights=None,
                                                                            num_classes=num_classes, **extra)
    if cfg.arch == "vit_tiny":
        return lambda num_classes, image_size: vit_tiny(num_classes, image_size)
    return lambda num_classes, image_size: ARCHS[cfg.arch](num_classes)


def input_size(cfg: ModelConfig, data_size: int) -> int:
    """The side the model is fed: model.input_size, or the data's own (0)."""
    return cfg.input_size or data_size


def _make(cfg: ModelConfig, num_classes: int, image_size: int, pretrained: bool = True,
          said: list[str] | None = None) -> nn.Module:
    """The model for ``cfg``: built, its pretrained weights loaded (``pretrained``; without, the same structure, for
    a meta copy or for weights loaded next), its frozen parameters frozen. What the loading did goes to ``said``."""
    said = [] if said is None else said
    tv = cfg.arch.startswith(TV_PREFIX) and not cfg.factory
    if pretrained and cfg.weights and not finetune.is_file(cfg.weights):
        finetune.tv_weights(cfg)  # a name torchvision has for this model, or the fix
    if pretrained and cfg.weights and tv and not finetune.is_file(cfg.weights):
        tv_name = cfg.arch[len(TV_PREFIX):]
        _builder(cfg)  # an unknown name stops here
        model = finetune.build_tv(cfg, tv_name, num_classes, image_size, NO_AUX.get(tv_name, {}), said)
    else:
        model = _builder(cfg)(num_classes, image_size)
        if pretrained and cfg.weights:
            finetune.load(model, cfg, num_classes, image_size, said)
    model = finetune.freeze(model, cfg, image_size)
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"params.yaml: model {name(cfg)!r} has no parameter left to train"
                          + (f" with model.freeze = {list(cfg.freeze)}" if cfg.freeze else " (its factory froze them "
                             "all)") + "; leave at least the final classification layer trainable (freeze: [backbone])")
    return model


def build(cfg: ModelConfig, *, num_classes: int, image_size: int, device: str | torch.device,
          pretrained: bool = True) -> nn.Module:
    """The model for ``cfg``, on ``device``, in channels_last if asked (``pretrained=False``: without loading
    ``model.weights``, for a state dict loaded next)."""
    model = _make(cfg, num_classes, image_size, pretrained).to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


# torch's warning for each tensor a factory's load_state_dict copies onto a meta parameter (a no-op there)
META_COPY_WARNING = r".*copying from a non-meta parameter in the checkpoint to a meta parameter.*"


def build_meta(cfg: ModelConfig, *, num_classes: int, image_size: int) -> nn.Module:
    """The model with shapes and no values, on the meta device: built there (no memory, no initialisation time), or
    on the CPU and moved when its constructor reads values (RegNet: "Cannot copy out of meta tensor"). Frozen as
    trained, without ``model.weights`` (shapes only); a factory that loads its own weights loads them onto meta
    tensors without a warning per tensor, and what it prints was shown by the model check already."""
    _builder(cfg)  # an unknown name or a factory that does not import stops here, with its message
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.filterwarnings("ignore", message=META_COPY_WARNING)
        try:
            with torch.device("meta"):
                model = _make(cfg, num_classes, image_size, pretrained=False)
        except ConfigError:
            raise
        except Exception:  # the constructor (or a factory) computes with values: build it for real, then drop them
            model = _make(cfg, num_classes, image_size, pretrained=False)
    model = model.to("meta")
    return model.to(memory_format=torch.channels_last) if cfg.channels_last else model


def takes(model: nn.Module, side: int, num_classes: int | None = None) -> bool:
    """Whether ``model`` (on the meta device) turns a training batch of two side x side images into logits."""
    try:
        out = model.train()(torch.empty(2, 3, side, side, device="meta"))
    except Exception:
        return False
    return torch.is_tensor(out) and (num_classes is None or tuple(out.shape) == (2, num_classes))


def input_size_fix(cfg: ModelConfig, num_classes: int, side: int,
                   model: nn.Module | None = None) -> tuple[int, str] | None:
    """None when the model takes side x side inputs; otherwise the side to set and the sentence that says so
    (e.g. "needs 224x224 inputs (the data's 32): set model.input_size: 224").

    The size is found by trying sides on meta tensors in training mode (what the step runs): ``_SIDES`` upwards,
    the model's own ``image_size`` (torchvision's ViT), ``_SIDES`` downwards, then the smallest side between the
    first that works and the side tried before it; never the default weights' transforms, which say how ImageNet
    was fed, not what the model takes (518 for vit_h_14, built for 224). None too when no side works: the caller's
    own error says what failed (``takes`` tells the two apart).
    """
    probe = model if model is not None else build_meta(cfg, num_classes=num_classes, image_size=side)
    if takes(probe, side, num_classes):
        return None
    own = getattr(probe, "image_size", None)
    tried = [s for s in _SIDES if s > side] + ([own] if isinstance(own, int) else []) \
        + [s for s in reversed(_SIDES) if s < side]
    first = next((s for s in tried if takes(probe, s, num_classes)), None)
    if first is None:
        return None
    lo = max([side] + [s for s in _SIDES if side < s < first]) if first > side else first - 1
    hi = first  # the smallest side in (lo, first] that works, by bisection
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if takes(probe, mid, num_classes) else (mid, hi)
    where = "model.input_size = " if cfg.input_size else "the data's "
    if takes(probe, hi + 32, num_classes) and takes(probe, 2 * hi, num_classes):  # a minimum, not one size
        size = next((s for s in range(-(-hi // 8) * 8, 2 * hi, 8) if takes(probe, s, num_classes)), hi)
        return size, f"takes inputs of at least {hi}x{hi} ({where}{side}): set model.input_size: {size}"
    return first, f"needs {first}x{first} inputs ({where}{side}): set model.input_size: {first}"


def check(cfg: ModelConfig, *, num_classes: int, image_size: int) -> dict:
    """Build the model on the CPU and run two images through it, forward and backward; its name, parameter count,
    the parameters the loss leaves without a gradient ("unused", which DDP must be told of) and the shapes of the
    trainable ones, or a ConfigError.
    """
    if cfg.arch == "vit_tiny" and not cfg.factory and image_size % PATCH:
        raise ConfigError(f"params.yaml: model.arch = 'vit_tiny' needs an input size divisible by its patch "
                          f"({PATCH}), got {image_size}; set model.input_size to a multiple of {PATCH}")
    said: list[str] = []
    model = _make(cfg, num_classes, image_size, said=said)
    for line in said:
        print(line, flush=True)
    try:
        x = torch.zeros(2, 3, image_size, image_size)
    except (RuntimeError, TypeError) as err:  # a side no memory holds (or torch cannot count): the key that set it
        key = "model.input_size" if cfg.input_size else "data.image_size"
        raise ConfigError(f"params.yaml: {key} = {image_size}: two images of that side do not fit in memory "
                          f"({first_line(err)}); set {key} to the side the model is fed, e.g. 224") from None
    try:
        out = model.train()(x)  # train mode: what the training step sees (aux heads, dropout)
    except Exception as err:
        fix = input_size_fix(cfg, num_classes, image_size, copy.deepcopy(model).to("meta"))
        if fix:
            raise ConfigError(f"params.yaml: model {name(cfg)!r} {fix[1]}") from None
        raise ConfigError(f"params.yaml: model {name(cfg)!r} cannot take {image_size}x{image_size} images "
                          f"({first_line(err)}); set "
                          "model.input_size to a size it takes (e.g. 224 for ImageNet models)") from None
    if not torch.is_tensor(out) or tuple(out.shape) != (2, num_classes):
        got = tuple(out.shape) if torch.is_tensor(out) else type(out).__name__
        raise ConfigError(f"params.yaml: model {name(cfg)!r} returns {got} for a batch of 2, expected logits of "
                          f"shape (2, {num_classes}); make it return one tensor of class scores")
    if out.requires_grad:  # a model with no trainable parameter has nothing to check
        out.float().sum().backward()
    unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]  # what the optimizer keeps state for
    frozen = [tuple(p.shape) for p in model.parameters() if not p.requires_grad]  # weights only: no gradient, no state
    from ampbench.train.fsdp import blocks  # what FSDP would shard on its own (strategy: fsdp)
    return {**describe(model, cfg), "unused": unused, "param_shapes": shapes, "frozen_shapes": frozen,
            "fsdp_blocks": [n for n, _ in blocks(model)]}


def check_unused(model: dict, cfg: ModelConfig, distributed: DistributedConfig, ddp: bool) -> None:
    """Stop when DDP would train a model whose loss leaves parameters without a gradient and DDP is not told.

    DDP waits for every parameter's gradient; without ``find_unused_parameters`` it fails at the second step
    ("Expected to have finished reduction in the prior iteration"). ``model``: what :func:`check` returned;
    ``ddp``: whether any variant trains in several processes.
    """
    unused = model["unused"]
    if not (ddp and distributed.nproc_per_node > 1 and unused) or distributed.find_unused_parameters:
        return
    names = ", ".join(unused[:3]) + (f" and {len(unused) - 3} more" if len(unused) > 3 else "")
    raise ConfigError(f"params.yaml: model {name(cfg)!r} has {len(unused)} parameter(s) its loss does not use "
                      f"({names}) and DDP over distributed.nproc_per_node = {distributed.nproc_per_node} "
                      "processes needs a gradient for each; set distributed.find_unused_parameters: true, or "
                      "remove those parameters (or set their requires_grad to False)")


def describe(model: nn.Module, cfg: ModelConfig) -> dict:
    trained, total = finetune.trained(model)
    return {"model": name(cfg), "param_count": total, "trainable_param_count": trained}


def source_record(cfg: ModelConfig) -> dict:
    """What the model's code is, for results that depend on it (the sweep's points): the factory's source hash,
    or torchvision's version for a ``tv:`` model; a built-in model's source is ampbench's own."""
    tv = cfg.arch.startswith(TV_PREFIX) and not cfg.factory
    if tv:
        import torchvision
    return {"model": name(cfg), "factory_source": source_hash(cfg),
            "torchvision": torchvision.__version__ if tv else None,
            **({"weights": finetune.identity(cfg)} if cfg.weights else {})}


def source_hash(cfg: ModelConfig, root: Path | None = None) -> str:
    """SHA-256 of the factory's source (its whole package when it lives in one under the repository) and of a
    ``model.weights`` file, or "".

    It goes into each variant's plan, so editing the factory's file or replacing the weights reruns the train
    stages.
    """
    weights = finetune.identity(cfg, root) if cfg.weights else ""  # a file's digest, or torchvision's full name
    factory = _factory_hash(cfg, root) if cfg.factory else ""
    if not weights:
        return factory
    return hashlib.sha256(f"{factory}|{weights}".encode()).hexdigest()[:16]  # a weights file's bytes too


def _factory_hash(cfg: ModelConfig, root: Path | None) -> str:
    module_name = cfg.factory.partition(":")[0]
    _import_factory(cfg.factory)
    module = sys.modules[module_name]
    path = Path(inspect.getfile(module)).resolve()
    root = (root or Path.cwd()).resolve()
    top = root / module_name.split(".")[0]
    files = sorted(top.rglob("*.py")) if top.is_dir() else [path]
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(root) if f.is_relative_to(root) else f).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]
