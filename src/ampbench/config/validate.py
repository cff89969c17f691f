"""params.yaml checked and built: each value against its field's rules, the sections against each other, an
older params.yaml migrated; every refusal one ``ConfigError`` line naming the key, the bad value and the fix."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import reprlib
import sys
import types
import typing
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

from ampbench import precision
from ampbench.config import optim
from ampbench.config.schema import (
    ARCH_NAMES,
    Config,
    Variant,
    _default_variants,
    to_dict,
    variant_world,
)
from ampbench.errors import ConfigError

_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_VARIANT_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")


# a list or mapping quoted in a refusal: its first values, one level deep (an alias bomb's repr would be billions long)
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 1, 60, 60
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 8


def _where(path: str, value: Any) -> str:
    shown = _SHORT.repr(value) if isinstance(value, list | tuple | dict | set) else repr(value)
    return f"params.yaml: {path} = {shown}"


def _check_scalar(path: str, value: Any, typ: Any, meta: dict) -> Any:
    if isinstance(typ, types.UnionType):  # one of several types (bool | str: true, false or a word from choices)
        typ = next((t for t in typ.__args__ if isinstance(value, t) and (t is bool or not isinstance(value, bool))),
                   None)
        if typ is None:
            allowed = " | ".join(str(c).lower() if isinstance(c, bool) else c for c in meta["choices"])
            raise ConfigError(f"{_where(path, value)} is not allowed; choose one of: {allowed}")
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, typ) and (typ is bool or not isinstance(value, bool))
    if not ok:
        raise ConfigError(f"{_where(path, value)} is not {_TYPE_NAMES[typ]}; set it to {_TYPE_NAMES[typ]}")
    if typ is float and not math.isfinite(value):  # YAML's .nan and .inf: every range check passes a NaN
        raise ConfigError(f"{_where(path, value)} is not a finite number; set it to a number")
    choices = meta.get("choices")
    choices = choices() if callable(choices) else choices  # a registry's names, read when checked
    if choices and not any(value == c and type(value) is type(c) for c in choices):
        allowed = " | ".join(str(c).lower() if isinstance(c, bool) else c if c != "" else '""' for c in choices)
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
    if not isinstance(raw, dict) and not path:  # the file itself
        raise ConfigError(f"params.yaml is not a mapping (it holds {_SHORT.repr(raw)}); write it as sections, e.g. "
                          "'train:' followed by indented keys, as the committed params.yaml does")
    if not isinstance(raw, dict):
        raise ConfigError(f"{_where(path, raw)} is not a mapping; write it as '{path}:' followed by indented keys")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in raw:
        if key not in fields:
            name = f"{path}.{key}" if path else str(key)
            raise ConfigError(f"params.yaml: unknown key {name!r}; allowed here: {', '.join(fields)}")
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
        raise ConfigError(f"{_where(path, raw)} is not a non-empty mapping of name -> {{precision, accum_steps}}; "
                          "write one variant a line, e.g. 'fp32: {precision: fp32, accum_steps: 1}'")
    out = {}
    for name, spec in raw.items():
        if not isinstance(name, str) or not _VARIANT_NAME.match(name):
            raise ConfigError(f"params.yaml: variant name {name!r} is not allowed; use letters, digits, "
                              "'_' or '-', starting with a letter")
        out[name] = _build(Variant, spec, f"{path}.{name}")
    return out


def path_is(path: str | Path, kind: str) -> bool:
    """Whether ``path``, a path params.yaml names, is a ``kind`` ("file", "folder" or "any") there; False for one the
    file system cannot look up (a name longer than it allows), which Path's own checks raise on."""
    try:
        path = Path(path)
        return path.is_file() if kind == "file" else path.is_dir() if kind == "folder" else path.exists()
    except (OSError, ValueError):  # ENAMETOOLONG; a NUL in the name
        return False


def micro_batch(batch_size: int, world: int, accum_steps: int, variant: str = "") -> int:
    """The micro-batch one process runs: ``batch_size`` images per optimizer step over ``world`` processes x
    ``accum_steps`` micro-batches, in equal parts, or a ConfigError naming the fix (``variant``: whose)."""
    if batch_size % (world * accum_steps) == 0:
        return batch_size // (world * accum_steps)
    steps = f"variants.{variant}.accum_steps" if variant else "accum_steps"
    if world == 1:
        raise ConfigError(f"params.yaml: {steps} = {accum_steps} does not divide train.batch_size = {batch_size}; "
                          "choose a divisor of the batch size, e.g. 1, 2 or 4")
    raise ConfigError(f"params.yaml: train.batch_size = {batch_size} does not split into distributed.nproc_per_node = "
                      f"{world} processes x {steps} = {accum_steps} equal micro-batches; choose a batch size that is a "
                      f"multiple of {world * accum_steps}")


def _cross_check(cfg: Config) -> None:
    from ampbench.config.uri import redact
    uri = cfg.mlflow.tracking_uri
    if redact(uri) != uri:  # params.yaml is in git, in the report's changed params and in summary.json
        raise ConfigError(f"params.yaml: mlflow.tracking_uri = {redact(uri)!r} holds a password; params.yaml is "
                          "committed and copied into the report: leave tracking_uri empty and set the URI in the "
                          "environment (export MLFLOW_TRACKING_URI=...), the password in ~/.pgpass for a database "
                          "or in MLFLOW_TRACKING_PASSWORD for a server")
    for name, v in cfg.variants.items():
        own = precision.rung(v.precision).recipes
        if v.recipe and v.recipe not in own:
            raise ConfigError(f"{_where(f'variants.{name}.recipe', v.recipe)} is not a recipe of precision "
                              f"{v.precision}; " + (f"choose one of: {' | '.join(own)}, or \"\" for {own[0]}" if own
                                                    else "it takes none: delete recipe"))
        micro_batch(cfg.train.batch_size, variant_world(cfg, name), v.accum_steps, name)
        if (v.strategy or cfg.distributed.strategy) == "fsdp" and v.ddp and cfg.distributed.nproc_per_node == 1:
            said = f"variants.{name}.strategy" if v.strategy else "distributed.strategy"
            raise ConfigError(f"params.yaml: {said} = 'fsdp' shards the model over processes, but "
                              "distributed.nproc_per_node = 1: set nproc_per_node to 2 or more, or strategy: ddp")
    t = cfg.train
    opt = optim.info(t.optimizer)
    if opt.max_lr is not None and t.lr > opt.max_lr:
        raise ConfigError(f"params.yaml: train.lr = {t.lr:g} is an SGD learning rate; {opt.cls} diverges at it: set "
                          f"train.lr to about {opt.defaults['lr']:g} (at most {opt.max_lr:g}), "
                          f"or delete it for {opt.cls}'s default")
    for where, impl in [("train.optimizer_impl", t.optimizer_impl),
                        *((f"variants.{n}.optimizer_impl", v.optimizer_impl) for n, v in cfg.variants.items())]:
        if impl not in ("", "auto", *opt.impls):
            raise ConfigError(f"{_where(where, impl)} does not exist for train.optimizer = {t.optimizer!r}; choose "
                              f"one of {' | '.join(opt.impls)}, or auto")
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


def _migrate_recipe(raw: dict) -> dict:
    """``variants.<v>.fp8_recipe`` is now ``recipe`` (it names mxfp8's recipes too): renamed, with one line on
    stderr; both at once is refused."""
    variants = raw.get("variants")
    if not isinstance(variants, dict):
        return raw
    renamed = {}
    for name, v in variants.items():
        if isinstance(v, dict) and "fp8_recipe" in v:
            if "recipe" in v:
                raise ConfigError(f"params.yaml: variants.{name} sets both fp8_recipe and recipe; delete fp8_recipe "
                                  "(recipe replaces it)")
            renamed[name] = {("recipe" if k == "fp8_recipe" else k): x for k, x in v.items()}
            print(f"params.yaml: variants.{name}.fp8_recipe is now variants.{name}.recipe (it names mxfp8's recipes "
                  "too); rename it", file=sys.stderr)
    return {**raw, "variants": {**variants, **renamed}} if renamed else raw


def _optimizer_defaults(raw: dict) -> dict:
    """``train.lr`` and ``train.weight_decay`` left out: the chosen optimizer's own defaults."""
    train = raw.get("train")
    if not isinstance(train, dict) or train.get("optimizer") not in optim.names():
        return raw
    return {**raw, "train": {**optim.info(train["optimizer"]).defaults, **train}}


def from_dict(raw: Any) -> Config:
    """Validate a parsed params mapping and return the frozen ``Config``."""
    if raw is None:
        raise ConfigError("params.yaml is empty; copy the committed params.yaml and edit it")
    if isinstance(raw, dict):
        raw = _optimizer_defaults(_migrate_recipe(_migrate(raw)))
    cfg = _build(Config, raw, "")
    _cross_check(cfg)
    return cfg


class _Twice(yaml.YAMLError):
    """A key written twice in one mapping: (the key, the line of each)."""


class _Loader(yaml.SafeLoader):
    """yaml's safe loader, refusing a key written twice in one mapping (yaml itself keeps the last one silently, so
    an edit above a forgotten line would be ignored)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # << merges keys an explicit key may override
                continue
            key = self.construct_object(key_node, deep=deep)
            with contextlib.suppress(TypeError):  # an unhashable key: the base class says so
                if key in seen:
                    raise _Twice(key, seen[key] + 1, key_node.start_mark.line + 1)
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def _parse(path: Path) -> Any:
    """params.yaml's bytes as YAML, or a ConfigError naming where in the file it breaks and the fix."""
    blob = path.read_bytes()
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as err:
        line = blob.count(b"\n", 0, err.start) + 1
        column = err.start - blob.rfind(b"\n", 0, err.start)
        raise ConfigError(f"{path}: line {line}, column {column} holds the byte 0x{blob[err.start]:02x}, which is not "
                          "UTF-8; save the file as UTF-8") from None
    loader = None
    try:
        loader = _Loader(text)  # its reader refuses a character YAML does not admit (a NUL) here
        return loader.get_single_data()
    except _Twice as err:
        key, first, again = err.args
        raise ConfigError(f"{path}: line {again}: key {key!r} is written twice in one mapping (first at line {first}); "
                          "YAML would keep only the last: delete one of them") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = getattr(err, "position", None)  # a character YAML does not admit (a NUL) has a position, not a mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else \
            f" at line {text.count(chr(10), 0, at) + 1}" if isinstance(at, int) else ""
        problem = getattr(err, "problem", None) or getattr(err, "reason", None) or "not valid YAML"
        raise ConfigError(f"{path}: broken YAML{where}: {problem}; fix the indentation or quoting there") from None
    except RecursionError:
        raise ConfigError(f"{path}: line {loader.get_mark().line + 1}: a value is nested too deeply to read (lists or "
                          "mappings inside each other, hundreds of levels); a value of params.yaml is at most a list: "
                          "remove the nesting") from None
    finally:
        if loader is not None:
            loader.dispose()


def load(path: str | Path = "params.yaml") -> Config:
    """Read and validate params.yaml."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such file; run from the repository root, where params.yaml lives")
    return from_dict(_parse(path))
