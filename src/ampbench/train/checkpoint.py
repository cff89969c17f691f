"""Checkpoints: a training run's whole state, saved atomically, resumed only under the same settings.

A checkpoint is written after every epoch (and on Ctrl-C, at a step boundary)
to the train stage's DVC ``persist`` output, and deleted once the run's results
are on disk. It carries a fingerprint of the run plan and the data; one made
under other settings is discarded with a message, never resumed silently.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from ampbench import results

CHECKPOINT = "last.pt"
FORMAT = 4  # the layout of the saved state (4: gradient norms); a checkpoint of another layout is not resumed


def fingerprint(plan_dict: dict, data_meta: dict) -> str:
    """A hash of everything that makes two runs the same run."""
    blob = json.dumps({"plan": plan_dict, "data": data_meta, "format": FORMAT}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


TEMPORARY = ".last."  # a checkpoint being written: what a crash mid-save leaves


def save(folder: Path, state: dict) -> Path:
    """Write ``state`` to ``folder/last.pt`` durably: a temporary file, flushed to disk, renamed."""
    with results.durable(Path(folder) / CHECKPOINT, prefix=TEMPORARY, suffix=".pt") as tmp:
        torch.save(state, tmp)
    return Path(folder) / CHECKPOINT


def load(folder: Path | None, expected_fingerprint: str, discard: bool = True) -> dict | None:
    """The checkpoint in ``folder`` if it was made under the same settings, else None (saying why).

    With ``discard`` (the process that writes them), a foreign or unreadable checkpoint is also deleted.
    """
    if folder is None:
        return None
    if discard:  # a save a crash cut short: never resumed from, never left behind
        results.remove_temporaries(Path(folder), (TEMPORARY,))
    path = Path(folder) / CHECKPOINT
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated or foreign file
        if discard:
            print(f"checkpoint {path} is unreadable ({type(err).__name__}); discarding it and starting over")
            path.unlink(missing_ok=True)
        return None
    if state.get("fingerprint") != expected_fingerprint:
        if discard:
            print(f"checkpoint {path} was made with different params or data (or by an older ampbench); discarding "
                  "it and starting over")
            path.unlink(missing_ok=True)
        return None
    return state


def clear(folder: Path) -> None:
    """Delete every checkpoint under ``folder`` (the run is complete), leaving a note for DVC's output."""
    folder = Path(folder)
    if folder.is_dir():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    (folder / "COMPLETE").write_text("The run finished and its results are on disk: nothing to resume.\n")


def plain_state(state_dict: dict) -> dict:
    """A model's state with its tensors plain: a weight a rung wraps in a tensor subclass (MX training's) is saved
    as the plain tensor it holds, so the file loads with ``weights_only`` and into an unconverted model."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    def plain(t):
        if not is_traceable_wrapper_subclass(t):
            return t
        names, _ = t.__tensor_flatten__()
        inner = [getattr(t, n) for n in names]
        return inner[0].detach() if len(inner) == 1 and inner[0].shape == t.shape else t
    return {k: plain(v) if isinstance(v, torch.Tensor) else v for k, v in state_dict.items()}
