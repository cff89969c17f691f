"""Every ampbench module a stage script reaches is a dependency of its DVC stage, so editing it reruns the stage.

The imports are read from the source (function-level ones too), and followed from module to module.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from ampbench import results
from ampbench.sandbox import REPO_ROOT

STAGES = yaml.safe_load((REPO_ROOT / "dvc.yaml").read_text())["stages"]
# Modules that change no output DVC tracks: the version, error messages and exit codes, MLflow logging and the
# tracking server's check (a warning printed, never written to a stage's outputs).
EXEMPT = {"src/ampbench/__init__.py", "src/ampbench/errors.py", "src/ampbench/tracking/__init__.py",
          "src/ampbench/tracking/access.py"}


def reached(script: Path) -> set[str]:
    skip = frozenset(REPO_ROOT / f for f in EXEMPT)
    return {f.relative_to(REPO_ROOT).as_posix() for f in results.source_files(script, skip)}


@pytest.mark.parametrize("name", list(STAGES))
def test_a_stage_depends_on_every_ampbench_module_its_script_reaches(name):
    stage = STAGES[name].get("do", STAGES[name])
    script = REPO_ROOT / re.search(r"stages/\w+\.py", stage["cmd"]).group(0)
    deps = [d.rstrip("/") for d in stage["deps"] if d.startswith("src/")]
    files = reached(script) - EXEMPT
    assert len(files) >= 3  # the walk found the stage's library
    missing = sorted(f for f in files if not any(f == d or f.startswith(d + "/") for d in deps))
    assert not missing, f"{name} reaches {missing} but dvc.yaml does not list them under its deps"


def test_the_report_stage_reaches_and_depends_on_no_training_code():
    """Editing the training loop, the step, a precision or the profiler reruns the train stages, not the report."""
    training = ("src/ampbench/train", "src/ampbench/step.py", "src/ampbench/train/policy.py",
                "src/ampbench/profiling.py")
    assert not [f for f in reached(REPO_ROOT / "stages" / "report.py") if f.startswith(training)]
    assert not [d for d in STAGES["report"]["deps"] if d.startswith(training)]


def test_the_report_stage_starts_without_torch():
    """The report reads files and logs to MLflow: the modules it runs load no torch (about 2 s a process)."""
    import subprocess
    import sys
    text = (REPO_ROOT / "stages" / "report.py").read_text()
    modules = ["ampbench." + m for m in ("config", "report", "tracking") if re.search(rf"\b{m}\b", text)]
    assert len(modules) == 3, modules  # what the stage imports (tracking inside main, when MLflow is on)
    code = f"import sys\nfor m in {modules!r}: __import__(m)\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False"], modules


def test_the_data_stage_depends_on_what_makes_the_set_not_on_how_training_reads_it():
    """Editing the device feed or the streaming workers does not prepare the set again."""
    feeds = {"src/ampbench/data/batches.py", "src/ampbench/data/stream.py"}
    assert not feeds & reached(REPO_ROOT / "stages" / "data.py")
    deps = STAGES["data"]["deps"]
    assert not [d for d in deps if any(f == d or f.startswith(d.rstrip("/") + "/") for f in feeds)], deps


def test_a_sandbox_an_older_ampbench_made_gives_dvc_the_outputs_it_now_caches(tmp_path):
    """`make demo` again after an upgrade: the old demo committed reports/report.html, which the pipeline now
    caches with DVC, and DVC refuses to write an output git tracks. The sandbox takes it out of git's index."""
    import subprocess

    from ampbench import sandbox
    dest = tmp_path / "demo"
    (dest / "reports").mkdir(parents=True)
    (dest / "reports" / "report.html").write_text("<p>an older run's page</p>")
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    sandbox.commit(dest, "an older ampbench's demo")
    sandbox.create(dest, {"device": "cpu"})
    tracked = subprocess.run(["git", "ls-files", "reports"], cwd=dest, capture_output=True, text=True).stdout
    assert "reports/report.html" not in tracked.split()
    assert (dest / "reports" / "report.html").is_file()  # left on disk for DVC to replace
    assert "reports/report.html" in sandbox.cached_outs(REPO_ROOT / "dvc.yaml")
