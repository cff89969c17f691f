"""Fine-tuning: pretrained weights (``model.weights``) and frozen layers (``model.freeze``, ``model.freeze_bn``).

``model.weights`` is, for a ``tv:`` model, the name of one of torchvision's weights for it (``DEFAULT``,
``IMAGENET1K_V1``, ...), loaded from torch hub's cache (``$TORCH_HOME/hub/checkpoints``, downloaded there when
absent); or, for any model, the path of a state dict file (read with ``weights_only=True``). Either loads strictly,
except the model's final classification layer when the weights were trained for another number of classes: that
layer is made anew for the data's classes, and one line says so. ``model.freeze`` then freezes parameters by module
name prefix (``[features]``), or ``[backbone]``: everything but the final classification layer, the last Linear the
forward pass runs (torchvision calls it ``fc``, ``classifier.3``, ``heads.head``, ``head``...). With
``model.freeze_bn`` the frozen BatchNorm layers stay in eval mode through every ``model.train()``: their running
statistics stay those of the weights, as fine-tuning recipes keep them.
"""

from __future__ import annotations

import contextlib
import hashlib
import socket
import sys
from pathlib import Path
from urllib.parse import urlparse

import torch
from torch import nn

from ampbench.config import ModelConfig, path_is
from ampbench.errors import ConfigError, first_line

BACKBONE = "backbone"  # model.freeze: [backbone] freezes everything but the final classification layer
DOWNLOAD_TIMEOUT_S = 30  # a machine without internet fails in seconds, not at the socket's default (never)


def is_file(weights: str) -> bool:
    """Whether ``model.weights`` names a file (a path) rather than torchvision weights (an enum name)."""
    return "/" in weights or "\\" in weights or weights.endswith((".pt", ".pth", ".bin", ".ckpt")) \
        or path_is(Path(weights).expanduser(), "any")


def identity(cfg: ModelConfig, root: Path | None = None) -> str:
    """What the weights are, for the plans and the model's source record: the enum's full name, or the file's
    SHA-256 (its first 16 hex digits); "" without weights."""
    if not cfg.weights:
        return ""
    if is_file(cfg.weights):
        path = _path(cfg, root)
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return f"sha256:{h.hexdigest()[:16]}"
    return str(tv_weights(cfg))


def _path(cfg: ModelConfig, root: Path | None = None) -> Path:
    path = Path(cfg.weights).expanduser()
    if not path.is_absolute():
        path = (root or Path.cwd()) / path
    if not path_is(path, "file"):
        raise ConfigError(f"params.yaml: model.weights = {cfg.weights!r}: no such file ({str(path)!r}); give the path "
                          "of a state dict saved with torch.save(model.state_dict(), path), or a torchvision weights "
                          "name for a tv: model (e.g. DEFAULT)")
    return path


def tv_weights(cfg: ModelConfig):
    """The torchvision weights enum member ``model.weights`` names for the ``tv:`` model ``model.arch``."""
    from torchvision.models import get_model_weights
    tv_name = cfg.arch.removeprefix("tv:")
    if not cfg.arch.startswith("tv:") or cfg.factory:
        raise ConfigError(f"params.yaml: model.weights = {cfg.weights!r} names torchvision weights, which only a tv: "
                          "model has; give the path of a state dict file instead (e.g. weights/my_model.pt)")
    try:
        enum = get_model_weights(tv_name)
    except (ValueError, KeyError):
        raise ConfigError(f"params.yaml: model.weights = {cfg.weights!r}: torchvision has no pretrained weights for "
                          f"{tv_name}; give the path of a state dict file, or remove model.weights") from None
    name = cfg.weights.split(".")[-1]  # "IMAGENET1K_V1" or "ResNet18_Weights.IMAGENET1K_V1"
    if name not in enum.__members__:
        raise ConfigError(f"params.yaml: model.weights = {cfg.weights!r}: {tv_name}'s weights are "
                          f"{', '.join(enum.__members__)}; pick one of them, or give a state dict file's path")
    return enum[name]


def cached_file(weights) -> Path:
    """Where torch hub keeps a torchvision weights file (the name fixed by its URL)."""
    return Path(torch.hub.get_dir()) / "checkpoints" / Path(urlparse(weights.url).path).name


def _fetch(cfg: ModelConfig, weights) -> Path:
    """The weights' file in torch hub's cache, downloaded there when absent; offline, one line naming the file."""
    path = cached_file(weights)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    was = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)
    try:
        print(f"model: downloading {weights} from {weights.url} to {path}", file=sys.stderr, flush=True)
        # the digest's start its file name carries (resnet18-f37072fd.pth), checked as torch hub checks it
        named = torch.hub.HASH_REGEX.search(path.name)
        torch.hub.download_url_to_file(weights.url, str(path), hash_prefix=named.group(1) if named else None,
                                       progress=True)
    except Exception as err:
        path.unlink(missing_ok=True)
        raise ConfigError(f"params.yaml: model.weights = {cfg.weights!r}: {weights} is not in torch hub's cache and "
                          f"could not be downloaded ({first_line(err)}); place {path.name} (from {weights.url}) at "
                          f"{path} (TORCH_HOME moves the cache), or remove model.weights") from None
    finally:
        socket.setdefaulttimeout(was)
    return path


HEADS = (nn.Linear, nn.Conv2d)  # a classification layer: a Linear, or a convolution (SqueezeNet's 1x1 classifier)


def final_linear(model: nn.Module, image_size: int) -> str:
    """The name of the model's final classification layer: the last ``nn.Linear`` or ``nn.Conv2d`` its forward pass
    runs (found by hooks on one image; a convolution is SqueezeNet's classifier), else the last one it holds."""
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, HEADS)]
    if not layers:
        raise ConfigError("params.yaml: model.freeze = [backbone] needs the model's final classification layer, an "
                          "nn.Linear or nn.Conv2d, and the model has none; name the prefixes to freeze instead")
    called: list[str] = []
    handles = [m.register_forward_hook(lambda mod, i, o, n=n: called.append(n)) for n, m in layers]
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    was = model.training
    try:
        with torch.no_grad():
            model.eval()(torch.zeros(1, 3, image_size, image_size, device=device))
    except Exception:  # a model that cannot take this size here: the last such layer it holds
        called = []
    finally:
        model.train(was)
        for h in handles:
            h.remove()
    return called[-1] if called else layers[-1][0]


def _replace(model: nn.Module, name: str, num_classes: int) -> None:
    """The layer ``name`` made anew (freshly initialised, as torchvision's builder would) for ``num_classes``."""
    old = model.get_submodule(name)
    parent, _, child = name.rpartition(".")
    like = {"bias": old.bias is not None, "device": old.weight.device, "dtype": old.weight.dtype}
    if isinstance(old, nn.Linear):
        new = nn.Linear(old.in_features, num_classes, **like)
    else:
        new = nn.Conv2d(old.in_channels, num_classes, old.kernel_size, old.stride, old.padding, old.dilation,
                        padding_mode=old.padding_mode, **like)
    setattr(model.get_submodule(parent) if parent else model, child, new)


def load(model: nn.Module, cfg: ModelConfig, num_classes: int, image_size: int, said: list[str]) -> nn.Module:
    """``model`` with ``model.weights`` loaded from a state dict file: strictly, but for a final classification
    layer trained for another number of classes, which is left as built (new) and said in ``said``."""
    path = _path(cfg)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ConfigError(f"params.yaml: model.weights = {cfg.weights!r} cannot be read as a state dict "
                          f"({first_line(err)}); save it with torch.save(model.state_dict(), path)") from None
    state = state.get("state_dict", state) if isinstance(state, dict) else state  # ampbench's model.pt too
    if not isinstance(state, dict):
        raise ConfigError(f"params.yaml: model.weights = {cfg.weights!r} holds a {type(state).__name__}, not a "
                          "state dict; save it with torch.save(model.state_dict(), path)")
    odd = [k for k, v in state.items() if not isinstance(k, str)
           or not (torch.is_tensor(v) or k.endswith("_extra_state"))]  # a module's extra state may be any object
    if odd:
        raise ConfigError(f"params.yaml: model.weights = {cfg.weights!r} is not a state dict (no tensor under "
                          f"{_names([repr(k) for k in odd])}); save it with torch.save(model.state_dict(), path)")
    own = model.state_dict()
    state = _unwrapped(state, own)
    differ = [k for k, v in state.items() if k in own and torch.is_tensor(v) and v.shape != own[k].shape]
    head = _head(model, cfg, image_size) if differ else ""
    if differ and all(k.startswith(head + ".") for k in differ):
        theirs = state.get(f"{head}.weight")
        classes = theirs.shape[0] if torch.is_tensor(theirs) else "other"
        state = {k: v for k, v in state.items() if not k.startswith(head + ".")}
        said.append(f"model: the weights' final layer {head} ({classes} classes) made anew for the data's "
                    f"{num_classes} classes")
    elif differ:
        raise ConfigError(f"params.yaml: model.weights = {cfg.weights!r} does not fit {cfg.factory or cfg.arch}: "
                          f"{_names(differ)} have other shapes; load weights saved from this model")
    missing = [k for k in own if k not in state and not (k.startswith(head + ".") and differ)]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        raise ConfigError(f"params.yaml: model.weights = {cfg.weights!r} does not fit {cfg.factory or cfg.arch}: "
                          + "; ".join(f"{what} {_names(keys)}" for what, keys in
                                      (("missing", missing), ("unexpected", unexpected)) if keys)
                          + "; load weights saved from this model")
    try:
        model.load_state_dict(state, strict=not differ)
    except RuntimeError as err:  # a tensor that does not copy in (a meta or sparse one): torch's lines, as one
        why = " ".join(str(err).split()).removeprefix("Error(s) in loading state_dict for ")
        raise ConfigError(f"params.yaml: model.weights = {cfg.weights!r} does not load into {cfg.factory or cfg.arch} "
                          f"({why[:300]}); load weights saved from this model") from None
    return model


# what DDP, torch.compile and Lightning put before every key of a model's state dict
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "model.")


def _unwrapped(state: dict, own: dict) -> dict:
    """``state`` with a wrapper's prefix taken off every key, when all its keys carry it and ours do not."""
    for prefix in WRAPPER_PREFIXES:
        if state and all(k.startswith(prefix) for k in state) and not any(k.startswith(prefix) for k in own):
            return {k[len(prefix):]: v for k, v in state.items()}
    return state


def _head(model: nn.Module, cfg: ModelConfig, image_size: int) -> str:
    """The final classification layer, for weights trained for another number of classes; the fix when the model
    has no Linear to make anew."""
    if not any(isinstance(m, HEADS) for m in model.modules()):
        raise ConfigError(f"params.yaml: model.weights = {cfg.weights!r} has a final layer for another number of "
                          f"classes, and {cfg.factory or cfg.arch} has no Linear or Conv2d classification layer that "
                          "ampbench can make anew; load the weights in a factory (model.factory) and replace the head "
                          "there")
    return final_linear(model, image_size)


def _names(keys: list[str]) -> str:
    return ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")


@contextlib.contextmanager
def _weights_only_loads():
    """torchvision's weights read with ``weights_only=True``, tensors and nothing a pickle could run: its builders
    load them with torch hub's default, a full unpickle of whatever file sits in the cache."""
    from torchvision.models import _api
    real = _api.load_state_dict_from_url

    def load(url, *args, **kwargs):
        return real(url, *args, **{**kwargs, "weights_only": True})

    _api.load_state_dict_from_url = load
    try:
        yield
    finally:
        _api.load_state_dict_from_url = real


def build_tv(cfg: ModelConfig, tv_name: str, num_classes: int, image_size: int, extra: dict,
             said: list[str]) -> nn.Module:
    """A ``tv:`` model with torchvision's weights ``model.weights``, built as torchvision builds it for them (at
    their classes, loaded strictly from torch hub's cache), its final classification layer made anew when the
    data has another number of classes."""
    import torchvision.models
    weights = tv_weights(cfg)
    _fetch(cfg, weights)
    # torchvision sets what its weights need (GoogLeNet's input transform, its aux heads then dropped)
    extra = {k: v for k, v in extra.items() if k != "init_weights"}
    try:
        with _weights_only_loads():
            model = torchvision.models.get_model(tv_name, weights=weights, **extra)
    except Exception as err:  # a file placed in the cache by hand: checked by nobody's hash
        raise ConfigError(f"params.yaml: model.weights = {cfg.weights!r}: {cached_file(weights)} does not load as "
                          f"{weights} ({first_line(err)}); delete it to download it again, or place the right "
                          "file there") from None
    classes = len(weights.meta.get("categories") or [])
    if classes != num_classes:
        head = _head(model, cfg, image_size)
        _replace(model, head, num_classes)
        said.append(f"model: {tv_name} with {weights} ({classes} classes): its final layer {head} made anew for "
                    f"the data's {num_classes} classes")
    return model


def structure(cfg: ModelConfig, tv_name: str) -> dict:
    """What torchvision's builder sets for ``model.weights`` beyond the weights (GoogLeNet's and Inception's input
    transform), for the same model built without loading them (a meta copy, a LoggedModel)."""
    if cfg.weights and not is_file(cfg.weights) and tv_name in ("googlenet", "inception_v3"):
        return {"transform_input": True}
    return {}


def input_note(cfg: ModelConfig, image_size: int) -> str | None:
    """A note when torchvision weights were trained on larger images than the model is fed here."""
    if not cfg.weights or is_file(cfg.weights):
        return None
    weights = tv_weights(cfg)
    try:
        side = int(weights.transforms().crop_size[0])
    except Exception:
        return None
    if image_size >= side:
        return None
    where = "model.input_size" if cfg.input_size else "the data's size"
    return (f"{cfg.arch}'s {weights} were trained on {side}x{side} images and are fed {image_size}x{image_size} "
            f"here ({where}): set model.input_size: {side} to fine-tune at their size")


def freeze(model: nn.Module, cfg: ModelConfig, image_size: int) -> nn.Module:
    """Freeze ``model.freeze``'s parameters (after the weights load); with ``model.freeze_bn`` keep the frozen
    BatchNorm layers in eval mode."""
    if not cfg.freeze and not cfg.freeze_bn:
        return model
    names = [n for n, _ in model.named_parameters()]
    if not cfg.freeze:
        chosen = set()  # freeze_bn alone: a factory froze its own
    elif BACKBONE in cfg.freeze:
        head = final_linear(model, image_size)
        chosen = {n for n in names if not _under(n, head)}
    else:
        prefixes = list(cfg.freeze)
        for p in prefixes:
            if not any(_under(n, p) for n in names):
                tops = sorted({n.split(".")[0] for n in names})
                raise ConfigError(f"params.yaml: model.freeze names {p!r}, which holds no parameter of "
                                  f"{cfg.factory or cfg.arch}; name a module, e.g. one of {', '.join(tops[:8])}")
        chosen = {n for n in names if any(_under(n, p) for p in prefixes)}
    for n, p in model.named_parameters():
        if n in chosen:
            p.requires_grad_(False)
    if cfg.freeze_bn:
        for m in model.modules():
            own = list(m.parameters(recurse=False))
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and own and not any(p.requires_grad for p in own):
                m.register_forward_pre_hook(keep_eval)
    return model


def keep_eval(module: nn.Module, args) -> None:
    """A frozen BatchNorm's forward pre-hook: eval mode, whatever ``model.train()`` set (a module-level function,
    so the model still pickles for MLflow)."""
    module.training = False


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def trained(model: nn.Module) -> tuple[int, int]:
    """(parameters trained, parameters in all)."""
    return (sum(p.numel() for p in model.parameters() if p.requires_grad),
            sum(p.numel() for p in model.parameters()))
