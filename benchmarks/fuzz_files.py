"""The files a user hands over, made bad for benchmarks/fuzz.py: image folders (corrupt, truncated, zero-byte,
greyscale, CMYK, 16-bit, animated and enormous images, symlink loops, names that are not UTF-8, a class folder with
no image) and weights files (truncated, of another architecture, an arbitrary pickle, a state dict mangled).

    bad_folder(root, kinds, rng)             an ImageFolder tree of two good classes, and one bad thing per kind
    weights_file(path, kind, rng, marker)    a model.weights file; unpickling it unsafely would create ``marker``
"""

from __future__ import annotations

import io
import os
import pickle
import random
import struct
import zlib
from functools import cache
from pathlib import Path

import numpy as np
import torch
from PIL import Image

IMAGE_KINDS = ("corrupt", "truncated", "zero-byte", "greyscale", "CMYK", "16-bit", "animated GIF", "enormous",
               "symlink loop", "name not UTF-8", "class without image")
WEIGHT_KINDS = ("truncated", "another architecture", "arbitrary pickle", "arbitrary torch.save", "random bytes",
                "mangled state dict")


def _image(rng: random.Random, side: int = 24, fmt: str = "PNG", mode: str = "RGB") -> bytes:
    pixels = np.random.default_rng(rng.getrandbits(32)).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buf, fmt)
    return buf.getvalue()


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` pixels, with almost no data after it."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


@cache
def _enormous() -> bytes:
    """A real 10,000 x 10,000 greyscale PNG (100 MP: above PIL's warning, below its refusal), made once."""
    buf = io.BytesIO()
    Image.new("L", (10_000, 10_000), 128).save(buf, "PNG")
    return buf.getvalue()


def _sixteen_bit(rng: random.Random) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(rng.getrandbits(32)).integers(0, 65536, (24, 24), dtype=np.uint16)) \
        .save(buf, "PNG")
    return buf.getvalue()


def _gif(rng: random.Random) -> bytes:
    frames = [Image.new("P", (24, 24), rng.randrange(256)) for _ in range(rng.randint(2, 5))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    return buf.getvalue()


def _add(root: Path, kind: str, rng: random.Random, n: int) -> None:
    cls = root / rng.choice(["cat", "dog"])
    name = f"bad{n}"
    if kind == "corrupt":
        blob = bytearray(_image(rng, fmt=rng.choice(["PNG", "JPEG"])))
        for _ in range(rng.randint(1, 20)):
            blob[rng.randrange(len(blob))] = rng.randrange(256)
        (cls / f"{name}.{rng.choice(['png', 'jpg'])}").write_bytes(bytes(blob) if rng.random() < 0.7
                                                                   else rng.randbytes(rng.randint(1, 3000)))
    elif kind == "truncated":
        fmt = rng.choice(["PNG", "JPEG", "GIF", "BMP", "TIFF", "WEBP"])
        blob = _image(rng, 64, fmt)
        (cls / f"{name}.{fmt.lower()}").write_bytes(blob[:rng.randrange(1, len(blob))])
    elif kind == "zero-byte":
        (cls / f"{name}.{rng.choice(['png', 'jpg', 'gif'])}").write_bytes(b"")
    elif kind == "greyscale":
        (cls / f"{name}.png").write_bytes(_image(rng, mode=rng.choice(["L", "LA", "1", "P"])))
    elif kind == "CMYK":
        fmt = rng.choice(["JPEG", "TIFF"])
        (cls / f"{name}.{fmt.lower()}").write_bytes(_image(rng, fmt=fmt, mode="CMYK"))
    elif kind == "16-bit":
        (cls / f"{name}.png").write_bytes(_sixteen_bit(rng))
    elif kind == "animated GIF":
        (cls / f"{name}.gif").write_bytes(_gif(rng))
    elif kind == "enormous":
        (cls / f"{name}.png").write_bytes(_png_claiming(40_000, 40_000) if rng.random() < 0.7 else _enormous())
    elif kind == "symlink loop":
        where = rng.choice(["file", "folder", "class"])
        if where == "file":
            os.symlink(f"{name}.png", cls / f"{name}.png")  # itself
        elif where == "folder":
            os.symlink("..", cls / name)  # the class folder's parent, inside it
        else:
            os.symlink(".", root / name)  # the whole set, as a class of its own
    elif kind == "name not UTF-8":
        raw = rng.choice([b"\xff\xfe", b"caf\xe9", b"new\nline", b"cr\rx", b"tab\tx", b"\x1b[31mred"])
        if rng.random() < 0.3:  # a class folder named so
            folder = root / os.fsdecode(raw)
            folder.mkdir(exist_ok=True)
            for i in range(2):
                (folder / f"{i}.png").write_bytes(_image(rng))
        else:
            (cls / os.fsdecode(raw + f"{n}.png".encode())).write_bytes(
                _image(rng) if rng.random() < 0.5 else b"not an image")
    elif kind == "class without image":
        folder = root / f"empty{n}"
        folder.mkdir(exist_ok=True)
        if rng.random() < 0.5:
            (folder / "notes.txt").write_text("no images here\n")
    else:
        raise ValueError(kind)


def bad_folder(root: Path, kinds: list[str], rng: random.Random) -> None:
    """Two classes of two to four good images each, then one bad thing for each of ``kinds``."""
    for cls in ("cat", "dog"):
        (root / cls).mkdir(parents=True, exist_ok=True)
        for i in range(rng.randint(2, 4)):
            (root / cls / f"{i}.{rng.choice(['png', 'jpg'])}").write_bytes(
                _image(rng, fmt="PNG" if i % 2 else "JPEG"))
    for n, kind in enumerate(kinds):
        _add(root, kind, rng, n)


class Trap:
    """Unpickled unsafely, it opens (creates) its marker file: a file a weights-only load never creates."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _anything(rng: random.Random, marker: Path, depth: int = 0):
    kinds = ["int", "float", "str", "bytes", "none", "tensor", "trap"] + (["list", "dict", "tuple", "set"]
                                                                           if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind in ("list", "tuple", "set"):
        items = [_anything(rng, marker, depth + 1) for _ in range(rng.randint(0, 4))]
        items = [x for x in items if kind != "set" or isinstance(x, int | str | bytes | float)]
        return {"list": list, "tuple": tuple, "set": set}[kind](items)
    if kind == "dict":
        return {rng.choice([rng.randrange(9), f"k{rng.randrange(9)}", None, (1, 2)]): _anything(rng, marker, depth + 1)
                for _ in range(rng.randint(0, 4))}
    return {"int": lambda: rng.randrange(-2**70, 2**70), "float": lambda: rng.choice([rng.random(), float("nan")]),
            "str": lambda: "".join(chr(rng.randrange(1, 0x3000)) for _ in range(rng.randrange(12))),
            "bytes": lambda: rng.randbytes(rng.randrange(12)), "none": lambda: None,
            "tensor": lambda: torch.randn(rng.randint(0, 4), rng.randint(1, 4)), "trap": lambda: Trap(marker)}[kind]()


@cache
def _state_dicts() -> dict[str, dict]:
    """small_cnn's own state dict (what the fuzz trains against) and others'."""
    from ampbench import models
    from ampbench.config import ModelConfig
    made = {arch: models.build(ModelConfig(arch=arch), num_classes=10, image_size=32, device="cpu").state_dict()
            for arch in ("small_cnn", "resnet18", "vit_tiny")}
    made["mlp"] = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3072, 10)).state_dict()
    return made


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _mangled(rng: random.Random, own: dict, marker: Path) -> dict:
    state = dict(own)
    key = rng.choice(sorted(state))
    how = rng.choice(["key not a string", "value not a tensor", "missing key", "extra key", "dtype", "shape",
                      "meta tensor", "sparse tensor", "nested", "wrapped", "nan"])
    if how == "key not a string":
        state[rng.choice([1, None, True, (1,)])] = state.pop(key)
    elif how == "value not a tensor":
        state[key] = _anything(rng, marker, 3)
    elif how == "missing key":
        del state[key]
    elif how == "extra key":
        state[f"extra.{rng.randrange(99)}"] = torch.zeros(rng.randint(1, 3))
    elif how == "dtype":
        state[key] = state[key].to(rng.choice([torch.int64, torch.float16, torch.bool, torch.complex64]))
    elif how == "shape":
        state[key] = torch.zeros([rng.randint(1, 5) for _ in range(rng.randint(0, 3))])
    elif how == "meta tensor":
        state[key] = state[key].to("meta")
    elif how == "sparse tensor":
        state = {k: v.to_sparse() if v.dim() == 2 and v.is_floating_point() else v for k, v in state.items()}
    elif how == "nested":
        state = {"state_dict": {"state_dict": state}} if rng.random() < 0.5 else {"model": state}
    elif how == "wrapped":
        state = {rng.choice(["module.", "_orig_mod.", "model.", "net."]) + k: v for k, v in state.items()}
    else:
        state[key] = torch.full_like(state[key], float("nan")) if state[key].is_floating_point() else state[key]
    return state


def weights_file(path: Path, kind: str, rng: random.Random, marker: Path) -> None:
    """A bad ``model.weights`` file for small_cnn."""
    dicts = _state_dicts()
    if kind == "truncated":
        blob = _saved(dicts["small_cnn"])
        path.write_bytes(blob[:rng.randrange(len(blob))])
    elif kind == "another architecture":
        path.write_bytes(_saved(dicts[rng.choice(["resnet18", "vit_tiny", "mlp"])]))
    elif kind == "arbitrary pickle":
        path.write_bytes(pickle.dumps(_anything(rng, marker), protocol=rng.randint(0, pickle.HIGHEST_PROTOCOL)))
    elif kind == "arbitrary torch.save":
        obj = _anything(rng, marker)
        try:
            path.write_bytes(_saved(obj))
        except Exception:  # an object torch.save cannot write: the pickle alone
            path.write_bytes(pickle.dumps(obj))
    elif kind == "random bytes":
        path.write_bytes(rng.randbytes(rng.randint(0, 5000)))
    elif kind == "mangled state dict":
        path.write_bytes(_saved(_mangled(rng, dicts["small_cnn"], marker)))
    else:
        raise ValueError(kind)
