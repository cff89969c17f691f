"""params.yaml edited by generated input: every key of the params schema (``config.schema``) given values of
its own, near misses and the wrong types; keys deleted, misspelled, unknown; sections that are not mappings; and
YAML oddities (aliases, merges, alias bombs, duplicate keys, tabs, bytes that are not UTF-8, large values, deep
nesting, files that are not a mapping). Shared by tests/test_fuzz.py and benchmarks/fuzz.py.

    edits(base) -> a hypothesis strategy of ``Edit``: the bytes of an edited params.yaml, and the keys it touched
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass

import yaml
from hypothesis import strategies as st

from ampbench.config import Config, Variant

DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # libyaml's: the generated files are written fast


@dataclass(frozen=True)
class Leaf:
    path: str   # dotted, as the refusals name it: train.lr, variants.amp.precision
    typ: object
    meta: dict


def leaves(variants: typing.Iterable[str], cls: type = Config, prefix: str = "") -> list[Leaf]:
    """Every key of the params schema (``config.schema``), each variant's keys under each of ``variants``."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        if f.name == "variants":
            out += [leaf for v in variants for leaf in leaves((), Variant, f"{path}.{v}.")]
        elif dataclasses.is_dataclass(hints[f.name]):
            out += leaves(variants, hints[f.name], path + ".")
        else:
            out.append(Leaf(path, hints[f.name], dict(f.metadata)))
    return out


def sections(variants: typing.Iterable[str]) -> list[str]:
    """The mappings of params.yaml: "" (the file), each section, each variant."""
    return ["", *(f.name for f in dataclasses.fields(Config) if f.name not in ("device", "seed")),
            *(f"variants.{v}" for v in variants)]


@dataclass
class Edit:
    kind: str                 # what was done, for the benchmark's table
    keys: list[str]           # the keys it touched (dotted); [] for the file as a whole
    text: bytes               # the edited params.yaml


def _get(d, dotted: str):
    for k in [k for k in dotted.split(".") if k]:
        d = d.get(k) if isinstance(d, dict) else None
    return d


def _set(d: dict, dotted: str, value) -> None:
    *path, last = dotted.split(".")
    for key in path:
        if not isinstance(d.get(key), dict):
            d[key] = {}
        d = d[key]
    d[last] = value


ANY = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=12),
                st.lists(st.integers(-3, 3), max_size=3),
                st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
WORDS = st.text(st.characters(codec="utf-8", categories=("L", "N", "P", "Zs", "Cc")), max_size=24)
SPECIAL = {  # free-text keys: values near what each one means (paths relative, so none walks the file system)
    "data.url": ["https://example.invalid/c.tgz", "file:///nonexistent.tgz", "ftp://x/y", "http://", "file://"],
    "data.md5": ["0" * 32, "A" * 32, "g" * 32, "0" * 31],
    "data.sha256": ["0" * 64, "F" * 64, "0" * 63, "z" * 64],
    "data.archive": ["missing.tgz", "params.yaml", "reports", ".", "x" * 300, "a/" * 3000],
    "data.path": ["missing", "reports", ".", "params.yaml", "x" * 300, "a/" * 3000],
    "model.weights": ["missing.pt", "params.yaml", "DEFAULT", "IMAGENET1K_V1", "w/x.pt", "~", "x" * 300, "a/" * 3000],
    "model.factory": ["math:sqrt", "math:pi", "no_such_module_xyz:build", "models/my_net.py", "a.b:", ":c"],
    "mlflow.tracking_uri": ["sqlite:///x.db", "http://127.0.0.1:1", "postgresql://u:secret@h/db", "file:./m"],
    "model.arch": ["resnet18", "vit_tiny", "tv:", "tv:no_such_net", "RESNET18"],
}


def _number(meta: dict, integer: bool):
    edges = [b + d for b in (meta.get("lo"), meta.get("hi")) if b is not None for d in (-1, -1e-9, 0, 1e-9, 1)]
    near = [int(e) if integer else e for e in edges]
    huge = [2**31, 2**63, 2**64, 10**30, -2**63] if integer else [1e308, -1e308, 5e-324, math.inf, -math.inf, math.nan]
    # sizes a model check runs in a few GB (vit_tiny at 600 px attends over 22,500 patches: more than 23 GB)
    small = st.integers(-10, 160) if integer else st.floats(-10, 600)
    return st.one_of(st.sampled_from(near or [0]), small, st.sampled_from(huge))


def scalar(leaf: Leaf, typ) -> st.SearchStrategy:
    """Values of one scalar key: its own (choices, the range's edges), near misses, and the wrong types."""
    meta, choices = leaf.meta, leaf.meta.get("choices")
    choices = choices() if callable(choices) else choices
    own = []
    if choices:
        own += [st.sampled_from(list(choices)), st.sampled_from(list(choices)).map(lambda c: str(c).upper() + " ")]
    if leaf.path in SPECIAL or leaf.path.endswith(tuple(SPECIAL)):
        own.append(st.sampled_from(SPECIAL[next(k for k in SPECIAL if leaf.path.endswith(k))]))
    if typ is bool:
        own += [st.booleans(), st.sampled_from(["yes", "no", "on", "True", 1, 0])]
    elif typ is int:
        own.append(_number(meta, True))
    elif typ is float:
        own += [_number(meta, False), _number(meta, True)]
    elif typ is str or isinstance(typ, types.UnionType):
        own.append(WORDS.filter(lambda s: not s.startswith(("/", "~")) and ".." not in s))
    return st.one_of(*own, ANY)


def values(leaf: Leaf) -> st.SearchStrategy:
    if typing.get_origin(leaf.typ) is tuple:
        item = scalar(leaf, typing.get_args(leaf.typ)[0])
        return st.one_of(st.lists(item, max_size=6), item)
    return scalar(leaf, leaf.typ)


def misspell(word: str) -> st.SearchStrategy:
    i = st.integers(0, max(0, len(word) - 1))
    return st.one_of(i.map(lambda k: word[:k] + word[k + 1:]), i.map(lambda k: word[:k] + word[k] * 2 + word[k + 1:]),
                     i.map(lambda k: word[:k] + word[k + 1:k + 2] + word[k:k + 1] + word[k + 2:]),
                     st.just(word.upper()), st.just(word + "s"), st.just(word.replace("_", "-")),
                     st.just(word.replace("_", " ")), st.just(word + " "))


@st.composite
def key_edit(draw, params: dict, variants: list[str]) -> tuple[str, str]:
    """One edit of ``params`` in place, by key; (what was done, the key)."""
    all_leaves = leaves(variants)
    kind = draw(st.sampled_from(["value"] * 6 + ["delete", "unknown key", "misspelled key", "section", "variant"]))
    if kind == "value":
        leaf = draw(st.sampled_from(all_leaves))
        _set(params, leaf.path, draw(values(leaf)))
        return kind, leaf.path
    if kind == "delete":
        key = draw(st.sampled_from([leaf.path for leaf in all_leaves] + sections(variants)[1:]))
        *up, last = key.split(".")
        with contextlib.suppress(KeyError, TypeError, AttributeError):
            del _get(params, ".".join(up))[last]
        return kind, key
    where = draw(st.sampled_from(sections(variants)))
    mapping = _get(params, where)
    if not isinstance(mapping, dict):
        return "value", where
    if kind == "unknown key":
        key = draw(st.one_of(WORDS.filter(bool), st.integers(), st.none(), st.booleans()))
        if key not in mapping:
            mapping[key] = draw(ANY)
        return kind, f"{where}.{key}".lstrip(".")
    if kind == "misspelled key" and mapping:
        old = draw(st.sampled_from(sorted(mapping, key=str)))
        new = draw(misspell(str(old)))
        if new and new not in mapping:
            mapping[new] = mapping.pop(old)
        return kind, f"{where}.{old}".lstrip(".")
    if kind == "variant":
        name = draw(st.one_of(WORDS, st.sampled_from(["bf16", "x-1", "1st", "a b"])))
        params.setdefault("variants", {})
        if isinstance(params["variants"], dict):
            params["variants"][name] = draw(st.one_of(
                st.fixed_dictionaries({"precision": values(Leaf("p", str, Variant.__dataclass_fields__[
                    "precision"].metadata))}, optional={"accum_steps": _number({"lo": 1}, True)}), ANY))
        return kind, f"variants.{name}"
    if where:  # a section: a list, a scalar, nothing where a mapping goes
        _set(params, where, draw(st.one_of(st.lists(st.integers(), max_size=3), st.sampled_from([0, "x", None, {}]))))
    return "section", where


LINE = re.compile(r"^( *)([A-Za-z_][\w-]*): (\S.*)$", re.M)  # a key with a one-line value, as safe_dump writes it


def _lines(text: str) -> list[re.Match]:
    return list(LINE.finditer(text))


@st.composite
def text_edit(draw, text: str, max_value_bytes: int) -> tuple[str, bytes]:
    """A YAML oddity made of the dumped text: (what, the bytes)."""
    found = _lines(text)
    m = draw(st.sampled_from(found))
    at = draw(st.integers(0, len(text)))
    kind = draw(st.sampled_from(["alias", "merge", "alias bomb", "recursive alias", "duplicate key", "tab",
                                 "non-UTF-8 byte", "large value", "whole file", "deep nesting", "CRLF", "NUL byte"]))
    before, after = text[:m.start()], text[m.end():]
    if kind == "alias":
        other = draw(st.sampled_from(found))
        a, b = sorted((m, other), key=lambda x: x.start())
        if a.start() == b.start():
            return kind, text.encode()
        out = (text[:a.start(3)] + "&v " + text[a.start(3):b.start(3)] + "*v" + text[b.end(3):])
        return kind, out.encode()
    if kind == "merge":
        heads = [h for h in re.finditer(r"^([a-z_]+):\n", text, re.M)]
        if len(heads) < 2:
            return kind, text.encode()
        a, b = draw(st.sampled_from(heads)), draw(st.sampled_from(heads))
        out = text.replace(a.group(0), f"{a.group(1)}: &s\n", 1)
        return kind, out.replace(b.group(0), f"{b.group(1)}:\n  <<: *s\n", 1).encode()
    if kind in ("alias bomb", "recursive alias"):
        depth = draw(st.integers(2, 8))
        bomb = "[" + ", ".join(["&b0 [x, x, x, x, x, x, x, x, x]"] + [
            f"&b{i} [" + ", ".join([f"*b{i - 1}"] * 9) + "]" for i in range(1, depth)]) + "]"
        value = bomb if kind == "alias bomb" else "&r [*r, {k: *r}]"
        return kind, f"{before}{m.group(1)}{m.group(2)}: {value}{after}".encode()
    if kind == "duplicate key":
        return kind, f"{text[:m.end()]}\n{m.group(1)}{m.group(2)}: {draw(st.sampled_from(['1', 'x', '[]']))}{after}" \
            .encode()
    if kind == "tab":
        return kind, (f"{before}\t{m.group(0).lstrip(' ')}{after}" if draw(st.booleans())
                      else f"{before}{m.group(1)}{m.group(2)}:\t{m.group(3)}{after}").encode()
    if kind == "non-UTF-8 byte":
        return kind, text[:at].encode() + bytes([draw(st.integers(0x80, 0xFF))]) + text[at:].encode()
    if kind == "large value":
        size = draw(st.sampled_from([10**3, 10**5, max_value_bytes]))
        return kind, f"{before}{m.group(1)}{m.group(2)}: {'x' * size}{after}".encode()
    if kind == "deep nesting":
        depth = draw(st.sampled_from([10, 100, 1000, 10_000]))
        open_, close = draw(st.sampled_from([("[", "]"), ("{a: ", "}")]))
        return kind, f"{before}{m.group(1)}{m.group(2)}: {open_ * depth}1{close * depth}{after}".encode()
    if kind == "CRLF":
        return kind, text.replace("\n", "\r\n").encode()
    if kind == "NUL byte":
        return kind, (text[:at] + "\0" + text[at:]).encode()
    whole = [b"", b"\n", b"   \n", b"# only a comment\n", b"~\n", b"---\n", b"- 1\n- 2\n", b"42\n", b"just words\n",
             ("\ufeff" + text).encode(), (text + "---\nseed: 1\n").encode(), b"? [a, b]\n: 1\n",
             b"seed: !!python/object/apply:os.getpid []\n", b"train: {epochs: 1\n", b"'unterminated\n",
             text.encode("utf-16"), text.encode("latin-1", "replace") + "# caf\xe9\n".encode("latin-1")]
    return kind, draw(st.one_of(st.sampled_from(whole), st.binary(max_size=200)))


@st.composite
def edits(draw, base: dict, max_value_bytes: int = 10**5) -> Edit:
    """``base`` (a params mapping) with one to three key edits, and in a third of the examples a YAML oddity."""
    params = copy.deepcopy(base)
    done = [draw(key_edit(params, sorted(base["variants"]))) for _ in range(draw(st.integers(1, 3)))]
    text = yaml.dump(params, Dumper=DUMPER, sort_keys=False, default_flow_style=False, allow_unicode=True)
    kinds, keys = [kind for kind, _ in done], [key for _, key in done]
    if draw(st.integers(0, 2)) == 0:
        kind, blob = draw(text_edit(text, max_value_bytes))
        return Edit(f"yaml: {kind}", keys, blob)
    return Edit(kinds[-1], keys, text.encode())
