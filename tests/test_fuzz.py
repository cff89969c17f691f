"""Bad input, generated: params.yaml edited by hypothesis (every key of the schema, misspelled and unknown keys, YAML
oddities) through the env_check stage, each edit accepted or refused in one line naming the key and the fix; the
image folders, archives and weights files the fuzz benchmark (benchmarks/fuzz.py) found refused with a traceback,
kept here as regression tests."""

from __future__ import annotations

import copy
import hashlib
import http.server
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from PIL import Image

from ampbench import data, models
from ampbench.config import DataConfig, ModelConfig
from ampbench.data import folder
from ampbench.env import services
from ampbench.errors import ConfigError, DataError
from ampbench.sandbox import REPO_ROOT, merge
from tests import outcomes, params_edits
from tests.conftest import SHRINK

# the committed params.yaml shrunk as the suite shrinks it: an edit that is accepted runs env_check in a tenth of a s
BASE = merge(yaml.safe_load((REPO_ROOT / "params.yaml").read_text()), SHRINK)
EXAMPLES = 150  # 6 s on an idle 2-core EPYC, 11 s beside other work; benchmarks/fuzz.py runs 2,000


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(edit=params_edits.edits(copy.deepcopy(BASE), max_value_bytes=10**4))
def test_every_generated_params_edit_is_accepted_or_refused_in_one_line(edit):
    outcome = outcomes.env_check(edit.text, edit.keys)
    assert outcome.verdict != "bug", f"{edit.kind} of {edit.keys}: {outcome.trace or outcome.why()}"


def test_every_key_of_the_schema_refuses_a_wrong_type_or_range_in_one_line_naming_it():
    """Each key the schema has (config.schema, a variant's under each variant), not a hand-picked list: a mapping
    where its value goes, a value below its range, a word not among its choices."""
    checked = 0
    for leaf in params_edits.leaves(sorted(BASE["variants"])):
        lo, choices = leaf.meta.get("lo"), leaf.meta.get("choices")
        bad = [{"a": 1}] + ([lo - 1] if lo is not None else []) + (["not-a-choice"] if choices else [])
        for value in bad:
            params = copy.deepcopy(BASE)
            params_edits._set(params, leaf.path, value)
            outcome = outcomes.env_check(yaml.safe_dump(params).encode(), [leaf.path])
            assert outcome.verdict == "refused", f"{leaf.path} = {value!r}: {outcome.verdict} {outcome.why()}"
            assert leaf.path in outcome.line or leaf.path + "[0]" in outcome.line, outcome.line
            checked += 1
    assert checked > 100


def test_a_refusal_through_the_ampbench_command_is_one_line_on_stderr(tmp_path):
    """The real command in its own process: a params.yaml that is not UTF-8 (once a UnicodeDecodeError's traceback)
    ends in exit 2 and one line on stderr."""
    (tmp_path / "params.yaml").write_bytes(yaml.safe_dump(BASE).encode() + b"# caf\xe9\n")
    proc = subprocess.run([sys.executable, "-m", "ampbench.cli", "mlflow-sync"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: params.yaml: line ") and "0xe9" in proc.stderr and "UTF-8" in proc.stderr


# What the fuzz benchmark found, each once a traceback or a refusal of several lines.

def _folder(root: Path) -> None:
    for cls in ("a", "b"):
        (root / cls).mkdir(parents=True)
        for i in range(2):
            Image.fromarray(np.full((12, 12, 3), 40 * i + 10, np.uint8)).save(root / cls / f"{i}.png")


def test_a_folder_with_file_names_not_utf8_or_holding_a_line_break_is_read_and_named_in_one_line(tmp_path):
    """A name that is not UTF-8 (once a UnicodeEncodeError from the folder's fingerprint and its split) is read; a
    bad image whose name holds a line break is named in a one-line warning, escaped."""
    root = tmp_path / "images"
    _folder(root)
    Image.new("RGB", (12, 12)).save(root / "a" / os.fsdecode(b"caf\xe9.png"))
    (root / "b" / "new\nline.png").write_bytes(b"not an image")
    cfg = DataConfig(source="folder", path=str(root), image_size=8)
    desc = data.describe(cfg)
    assert desc["train_count"] + desc["test_count"] == 5
    (line,) = folder.bad_file_lines(desc)
    assert "b/new\\nline.png" in line and len(line.splitlines()) == 1
    for form in ("tensors", "files"):
        meta = data.prepare(cfg, 0, tmp_path / form, tmp_path / "raw", form=form)
        assert meta["train_count"] + meta["test_count"] == 5
        assert all(len(w.splitlines()) == 1 and w.encode() for w in folder.bad_file_lines(meta))
    assert folder.shown(os.fsdecode(b"caf\xe9.png")) == "caf\\xe9.png"


def test_a_16_bit_greyscale_image_keeps_its_values(tmp_path):
    """PIL's RGB of a 16-bit PNG clips every value above 255: the image came out white."""
    values = (np.arange(64 * 64).reshape(64, 64) * 16).astype(np.uint16)
    Image.fromarray(values).save(tmp_path / "deep.png")
    x = folder.decode_image(tmp_path / "deep.png", 64)
    assert torch.equal(x[0], torch.from_numpy((values >> 8).astype(np.uint8))) and torch.equal(x[0], x[2])


def _small_cnn_state() -> dict:
    return models.build(ModelConfig(arch="small_cnn"), num_classes=10, image_size=16, device="cpu").state_dict()


@pytest.mark.parametrize(("name", "mangle", "words"), [
    ("a key that is not a string", lambda s: {**s, 1: torch.zeros(1)}, ["no tensor under 1"]),
    ("values that are not tensors", lambda s: {k: 5 for k in s}, ["no tensor under '0.0.weight'"]),
    ("meta tensors", lambda s: {k: v.to("meta") for k, v in s.items()}, ["does not load into small_cnn"]),
], ids=lambda v: v if isinstance(v, str) else "")
def test_weights_that_are_not_a_state_dict_of_tensors_are_refused_in_one_line(tmp_path, name, mangle, words):
    torch.save(mangle(_small_cnn_state()), tmp_path / "w.pt")
    cfg = ModelConfig(arch="small_cnn", weights=str(tmp_path / "w.pt"))
    with pytest.raises(ConfigError) as err:
        models.check(cfg, num_classes=10, image_size=16)
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words), str(err.value)


def test_an_input_size_no_memory_holds_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"model.input_size = 1099511627776: two images of that side do not fit"):
        models.check(ModelConfig(arch="small_cnn", input_size=2**40), num_classes=10, image_size=2**40)


def test_an_archive_tarfile_cannot_open_is_refused_in_one_line(tmp_path):
    """An empty file with its MD5 given: tarfile's error lists each compression it tried, a line each."""
    (tmp_path / "empty.tar.gz").write_bytes(b"")
    cfg = DataConfig(source="cifar10", archive=str(tmp_path / "empty.tar.gz"), md5=hashlib.md5(b"").hexdigest())
    with pytest.raises(DataError) as err:
        data.prepare(cfg, 0, tmp_path / "prepared", tmp_path / "raw")
    assert "cannot be extracted (ReadError: file could not be opened successfully)" in str(err.value)
    assert not (tmp_path / "prepared").exists()


def test_a_tracking_server_answering_an_empty_body_is_a_problem_to_say_not_a_traceback():
    """200 with an empty body to every request (a proxy's placeholder): the account check read it as JSON."""
    class Empty(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802  http.server's name
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Empty)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        problem = services.check_tracking_server(f"http://127.0.0.1:{server.server_address[1]}", timeout=5,
                                                 experiment="ampbench")
    finally:
        server.shutdown()
    assert problem.startswith("answers what no MLflow server does (JSONDecodeError"), problem
