"""torchvision's weights as torch hub fetches them: a download checked against the digest its file name carries,
and a file read as tensors only, whatever sits in the cache."""

from __future__ import annotations

import pytest
import torch

from ampbench import models
from ampbench.config import ModelConfig
from ampbench.errors import ConfigError
from ampbench.models import finetune
from tests.test_finetune import hub  # noqa: F401  the fixture: torch hub's cache in tmp_path, offline

CFG = ModelConfig(arch="tv:resnet18", weights="IMAGENET1K_V1")


class _Runs:
    """What a pickle runs when it is unpickled in full: here, a file made."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_weights_file_in_the_cache_is_read_as_tensors_never_run(hub, tmp_path):  # noqa: F811
    """A file in torch hub's cache that a pickle's code would run from (placed there by hand, or by anyone who
    can write the cache) is refused in one line, and its code never runs: torchvision's builders would read it
    with a full unpickle."""
    path, _ = hub
    marker = tmp_path / "ran"
    torch.save({"fc.weight": _Runs(marker)}, path)
    with pytest.raises(ConfigError, match=r"resnet18-f37072fd.pth does not load as ResNet18_Weights.IMAGENET1K_V1 "
                                          r"\(.*\); delete it to download it again"):
        models.build(CFG, num_classes=10, image_size=32, device="cpu")
    assert not marker.exists()


def test_a_download_is_checked_against_the_digest_its_file_name_carries(hub, monkeypatch):  # noqa: F811
    """As torch hub checks it (``hash_prefix``): a file whose SHA-256 does not start with the name's f37072fd is
    refused, not cached."""
    path, state = hub
    path.unlink()
    asked = []

    def download(url, dst, hash_prefix=None, progress=True):
        asked.append(hash_prefix)
        torch.save(state, dst)  # what a tampered mirror would send
        raise RuntimeError(f'invalid hash value (expected "{hash_prefix}", got "0123abcd")')

    monkeypatch.setattr(torch.hub, "download_url_to_file", download)
    with pytest.raises(ConfigError, match=r"could not be downloaded \(RuntimeError: invalid hash value"):
        models.build(CFG, num_classes=10, image_size=32, device="cpu")
    assert asked == ["f37072fd"] and not path.exists()
    assert finetune.cached_file(finetune.tv_weights(CFG)) == path
