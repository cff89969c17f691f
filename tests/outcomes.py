"""A stage run in this process and judged: accepted, refused in one line that names the key and the fix, or a
bug (a traceback, a refusal of several lines or none, a half-written output). Shared by tests/test_fuzz.py and
benchmarks/fuzz.py.

    run_stage(main, argv, cwd) -> Outcome: a stage's ``main`` under ``run_cli``, as its process runs it
    env_check(text, keys) -> Outcome: ``text`` as params.yaml through the env_check stage, its outputs checked
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import math
import os
import re
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from ampbench.errors import run_cli
from tests.params_edits import leaves, sections


@dataclass
class Outcome:
    verdict: str          # accepted | refused (one "error:" line, last, a user error's exit code) | bug
    code: int
    out: str
    err: str
    trace: str = ""       # the traceback of an exception that escaped run_cli
    problems: list[str] = field(default_factory=list)  # what else broke the property (outputs, naming)

    @property
    def line(self) -> str:
        return (self.err.strip().splitlines() or [""])[-1]

    def why(self) -> str:
        return self.trace.strip().splitlines()[-1] if self.trace else "; ".join(self.problems) or self.err[-500:]


def judge(code: int, out: str, err: str, trace: str = "") -> Outcome:
    """Accepted (exit 0), refused (a user error's exit code, one line starting "error:" and last on stderr, no
    traceback), or a bug."""
    if code == 130:
        raise KeyboardInterrupt
    lines = err.strip().splitlines()
    said = [line for line in lines if line.startswith("error: ")]
    if trace or "Traceback (most recent call last)" in out + err:
        return Outcome("bug", code, out, err, trace or err)
    try:
        out.encode("utf-8")  # a terminal's stdout, or a pipe's: strict UTF-8 (stderr escapes what it cannot write)
    except UnicodeEncodeError as bad:
        return Outcome("bug", code, out, err, problems=[f"stdout cannot print {out[bad.start - 40:bad.end + 10]!r}"])
    if code == 0:
        return Outcome("accepted", code, out, err)
    if code in (1, 2, 3) and len(said) == 1 and lines[-1] == said[0]:
        return Outcome("refused", code, out, err)
    return Outcome("bug", code, out, err, problems=[f"exit {code} without one error line: {err[-300:]!r}"])


def run_stage(main, argv: list[str], cwd: Path) -> Outcome:
    """A stage's ``main`` under ``run_cli`` in this process, in ``cwd``, its output captured."""
    out, err = io.StringIO(), io.StringIO()
    here, argv_was = os.getcwd(), sys.argv
    code, trace = 0, ""
    try:
        os.chdir(cwd)
        sys.argv = argv
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            run_cli(main)
    except SystemExit as stop:
        code = 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
    except Exception:
        trace = traceback.format_exc()
    finally:
        os.chdir(here)
        sys.argv = argv_was
        gc.unfreeze()  # run_cli freezes what is alive at its end: thousands of runs in one process would keep it all
    return judge(code, out.getvalue(), err.getvalue(), trace)


OUTPUTS = {"--env": "reports/env.json", "--plans": "reports/plans", "--data-source": "reports/data_source.json",
           "--model-source": "reports/model_source.json", "--roofline": "reports/roofline.json"}


def stage(name: str):
    """A stage's module (stages/<name>.py), loaded once."""
    if name not in _STAGES:
        from tests.conftest import load_stage
        _STAGES[name] = load_stage(name)
    return _STAGES[name]


_STAGES: dict = {}


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in (root / "reports").rglob("*") if p.is_file()}


def env_check(text: bytes, keys: list[str] | None = None, root: Path | None = None) -> Outcome:
    """``text`` as params.yaml through the env_check stage, in ``root`` (else a fresh folder) holding an earlier
    run's outputs. The property: accepted (every output whole, no temporary left, every number finite) or refused in
    one line naming a key and the fix, the earlier outputs byte for byte as they were; ``keys``: the keys edited."""
    with tempfile.TemporaryDirectory(prefix="ampbench-fuzz-") as tmp:
        root = Path(root or tmp)
        for rel in ("reports/env.json", "reports/plans/fp32.json", "reports/data_source.json"):
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text("{}\n")
        (root / "params.yaml").write_bytes(text)
        before = _files(root)
        argv = ["env_check.py", "--params", "params.yaml", *(a for kv in OUTPUTS.items() for a in kv)]
        outcome = run_stage(stage("env_check").main, argv, root)
        after = _files(root)
        if outcome.verdict == "refused":
            if after != before:
                outcome.problems.append("a refusal changed reports/")
            if not names_a_key(outcome.line, keys or []):
                outcome.problems.append(f"the refusal names no key or no fix: {outcome.line[:300]!r}")
        elif outcome.verdict == "accepted":
            outcome.problems += _whole(root, after)
    if outcome.problems and outcome.verdict != "bug":
        outcome.verdict = "bug"
    return outcome


def _whole(root: Path, after: dict[str, bytes]) -> list[str]:
    from ampbench import config
    problems = [f"{rel} is a temporary left behind" for rel in after if Path(rel).name.startswith(".")]
    for rel in [r for flag, r in OUTPUTS.items() if flag != "--plans"]:
        if rel not in after:
            problems.append(f"{rel} was not written")
    for rel, blob in after.items():
        try:
            json.loads(blob)
        except ValueError:
            problems.append(f"{rel} is not whole JSON")
    with contextlib.redirect_stderr(io.StringIO()):  # an old key's migration notice, said once by the stage already
        cfg = config.load(root / "params.yaml")
    bad = {k: v for k, v in config.flatten(config.to_dict(cfg)).items()
           if any(isinstance(x, float) and not math.isfinite(x) for x in (v if isinstance(v, tuple) else (v,)))}
    return problems + ([f"accepted non-finite numbers: {bad}"] if bad else [])


# any key of the schema, a variant's under any name
KEY = re.compile("|".join(re.escape(k).replace("<v>", r"[^ .']+") for k in
                          [leaf.path for leaf in leaves(["<v>"])] + sections(["<v>"])[1:]))
WHERE_IN_FILE = re.compile(r"params\.yaml(: line \d+|: broken YAML| is empty| is not a mapping|: no such file)")


FIX = re.compile(r"; |\b(set|use|run|give|delete|remove|choose|save|write)\b")


def names_a_key(line: str, keys: list[str]) -> bool:
    """Whether a refusal's line names a key (one edited, its last part as a variant name, any of the schema's, or
    where in the file) and the fix."""
    last = [str(k).rpartition(".")[2] for k in keys]
    named = any(str(k) in line for k in keys) or any(repr(k) in line or (k and k in line) for k in last) \
        or KEY.search(line) or WHERE_IN_FILE.search(line)
    return bool(named) and bool(FIX.search(line))
