"""Every bad params.yaml, through the env_check stage that DVC runs first: exit code 2, one line naming the
key and the fix, no traceback, and reports/ and data/ byte for byte as they were."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import yaml

from ampbench.errors import run_cli
from tests.test_config import BAD, SOURCE_BAD, _set

CASES = [(f"{k}={v!r}", k, v, words) for k, v, words in BAD] + [
    ("empty file", None, None, ["params.yaml is empty"]),
    ("broken YAML", None, "train:\n  epochs: [1,\n", ["broken YAML at line"]),
    ("not a mapping", None, "- 1\n- 2\n", ["params.yaml is not a mapping (it holds [1, 2])", "write it as sections"]),
    ("a byte that is not UTF-8", None, b"seed: 0\ndevice: caf\xe9\n", ["line 2, column 12", "0xe9", "as UTF-8"]),
    ("UTF-16", None, "seed: 0\n".encode("utf-16"), ["line 1, column 1", "0xff", "save the file as UTF-8"]),
    ("nested too deeply", None, "seed: " + "[" * 5000 + "]" * 5000 + "\n", ["line 1", "nested too deeply"]),
    ("a key twice", None, "seed: 0\ndevice: cpu\nseed: 1\n", ["line 3: key 'seed' is written twice", "line 1"]),
    ("a NUL", None, "seed: 0\ndevice: c\0pu\n", ["broken YAML at line 2", "special characters"]),
    ("a key with a line break", "train.a\nb", 1, ["unknown key 'train.a\\nb'"]),
]


def _stage():
    from tests.conftest import load_stage
    return load_stage("env_check")


def _snapshot(root):
    return {p.relative_to(root): p.read_bytes() for d in ("reports", "data") for p in (root / d).rglob("*")
            if p.is_file()}


@pytest.mark.parametrize(("name", "key", "value", "words"), CASES, ids=[c[0] for c in CASES])
def test_bad_params_exit_2_with_one_line_and_change_nothing(tmp_path, monkeypatch, capsys, real_params,
                                                            name, key, value, words):
    if key is not None:
        params = copy.deepcopy(real_params)
        _set(params, key, value)
        text = yaml.safe_dump(params)
    else:
        text = value or ""  # str or bytes
    _assert_rejected(tmp_path, monkeypatch, capsys, text, words)


@pytest.mark.parametrize(("changes", "words"), SOURCE_BAD, ids=[next(reversed(c)) for c, _ in SOURCE_BAD])
def test_a_missing_archive_or_folder_exits_2_from_its_data_source(tmp_path, monkeypatch, capsys, real_params,
                                                                  changes, words):
    params = copy.deepcopy(real_params)
    for key, value in changes.items():
        _set(params, key, value)
    _assert_rejected(tmp_path, monkeypatch, capsys, yaml.safe_dump(params), words)


# What this machine cannot run (a CPU here): stopped by env_check before anything starts.
MACHINE = [
    ({"distributed.backend": "nccl"}, ["distributed.backend = 'nccl' needs CUDA GPUs", "backend: gloo"]),
    ({"distributed.nproc_per_node": 4096, "train.batch_size": 16384}, ["nproc_per_node = 4096", "CPU cores"]),
]


@pytest.mark.parametrize(("changes", "words"), MACHINE, ids=[next(iter(c)) for c, _ in MACHINE])
def test_distributed_params_this_machine_cannot_run_exit_2(tmp_path, monkeypatch, capsys, real_params, changes,
                                                           words):
    params = copy.deepcopy(real_params)
    for key, value in {"device": "cpu", **changes}.items():
        _set(params, key, value)
    _assert_rejected(tmp_path, monkeypatch, capsys, yaml.safe_dump(params), words)


SPARE = """
from torch import nn

class Spare(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.head, self.aux = nn.Sequential(nn.Flatten(), nn.LazyLinear(num_classes)), nn.Linear(4, num_classes)

    def forward(self, x):
        return self.head(x)  # self.aux: never in the loss
"""


def test_a_model_with_parameters_its_loss_does_not_use_under_ddp_exits_2(tmp_path, monkeypatch, capsys,
                                                                         real_params):
    (tmp_path / "spare_nets.py").write_text(SPARE)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "spare_nets", raising=False)
    params = copy.deepcopy(real_params)
    for key, value in {"device": "cpu", "model.factory": "spare_nets:Spare", "distributed.nproc_per_node": 2,
                       "data.source": "synthetic"}.items():
        _set(params, key, value)
    _assert_rejected(tmp_path, monkeypatch, capsys, yaml.safe_dump(params),
                     ["'spare_nets:Spare' has 2 parameter(s) its loss does not use (aux.weight, aux.bias)",
                      "set distributed.find_unused_parameters: true"])


def _assert_rejected(tmp_path, monkeypatch, capsys, text: str | bytes, words: list[str]) -> str:
    """env_check on ``text``: exit 2, one line holding ``words``, no traceback, reports/ and data/ untouched."""
    for rel, content in {"reports/env.json": "{}\n", "reports/plans/fp32.json": "{}\n",
                         "data/prepared/meta.json": "{}\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(content)
    (tmp_path / "params.yaml").write_bytes(text if isinstance(text, bytes) else text.encode())
    before = _snapshot(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["env_check.py", "--params", "params.yaml", "--env", "reports/env.json",
                                      "--plans", "reports/plans", "--data-source", "reports/data_source.json",
                                      "--model-source", "reports/model_source.json",
                                      "--roofline", "reports/roofline.json"])
    with pytest.raises(SystemExit) as exit_info:
        run_cli(_stage().main)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    for word in words:
        assert word in err, err
    assert _snapshot(tmp_path) == before
    return err


def test_there_are_at_least_25_cases():
    assert len(CASES) >= 25


@pytest.mark.parametrize("key", ["model.arch", "data.source", "variants.fp32.precision"])
def test_a_huge_bad_value_is_quoted_in_a_line_s_worth(tmp_path, monkeypatch, capsys, real_params, key):
    """A 10 MB value is refused in one short line: its start and its length, not the whole of it."""
    params = copy.deepcopy(real_params)
    _set(params, key, "HUGE")  # written in place: yaml's pure-Python emitter takes seconds over 10 MB
    text = yaml.safe_dump(params).replace("HUGE", "x" * 10_000_000)
    err = _assert_rejected(tmp_path, monkeypatch, capsys, text, [key, "(10,000,000 characters)"])
    assert len(err) < 600, err[:1000]


@pytest.mark.parametrize("key", ["model.weights", "data.archive", "data.path"])
def test_a_path_longer_than_the_file_system_allows_is_refused_in_one_line(tmp_path, monkeypatch, capsys,
                                                                          real_params, key):
    """A name the file system cannot look up (ENAMETOOLONG): once an OSError's traceback from Path.is_file."""
    params = copy.deepcopy(real_params)
    source = {"data.archive": "cifar10", "data.path": "folder"}.get(key, "synthetic")
    for k, v in {"device": "cpu", "model.arch": "small_cnn", "data.source": source, key: "x" * 300}.items():
        _set(params, k, v)
    _assert_rejected(tmp_path, monkeypatch, capsys, yaml.safe_dump(params), [key, "(300 characters)"])


def test_an_alias_bomb_is_quoted_in_a_line_s_worth(tmp_path, monkeypatch, capsys):
    """Aliases nested six deep stand for half a million values: the refusal quotes their start, not all of them
    (nine deep, the whole quote would be billions of characters, written for minutes)."""
    bomb = ", ".join(["&b0 [x, x, x, x, x, x, x, x, x]"] + [f"&b{i} [" + ", ".join([f"*b{i - 1}"] * 9) + "]"
                                                             for i in range(1, 6)])
    err = _assert_rejected(tmp_path, monkeypatch, capsys, f"device: cpu\nseed: [{bomb}]\n",
                           ["seed = [[", "is not an integer"])
    assert len(err) < 600, err[:1000]


def test_the_python_the_package_admits_has_tarfile_s_extraction_filters():
    """The data stage extracts with ``filter="data"`` (Python 3.11.4 and later): an older 3.11 must be refused at
    install, not end the data stage in a TypeError."""
    import tomllib

    spec = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["requires-python"]
    assert spec.replace(" ", "") == ">=3.11.4"
