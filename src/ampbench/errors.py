"""Errors a user can fix, and how a stage turns them into an exit code.

A user's mistake (a bad value in params.yaml, a missing archive, a machine that
cannot run what was asked) is reported as one line naming the value and the
fix, with a non-zero exit code and no traceback.

An analysis around training (the roofline, the numerics audit, the accumulation
check, the profile, a sweep point, the figures, the MLflow LoggedModel) never
stops a stage: ``analysis`` runs one, and a failure becomes one warning line and
the reason its report section gives. ``AMPBENCH_FAIL_ANALYSIS`` (a test hook:
names from ``ANALYSES``, comma-separated, or ``all``) makes them fail on purpose.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import sys
from collections.abc import Callable

FAIL_ON_PURPOSE = "AMPBENCH_FAIL_ANALYSIS"
ANALYSES = {  # name -> what the warning calls it
    "roofline": "the roofline count", "audit": "the numerics audit", "accumulation": "the accumulation check",
    "activations": "the activation-memory meter", "flops": "the FLOP count", "profile": "the step profile",
    "sweep": "a sweep point", "largest_batch": "the largest-batch search", "figures": "the figures",
    "logged_model": "the MLflow LoggedModel", "fp8_census": "the census of what fp8 converts",
    "paired": "the paired check"}


QUOTE_MAX = 120  # characters of a quoted value an error line shows: a line's worth, not a 10 MB value

# a quoted string literal, as repr writes one: '...' or "...", escapes included, its quotes not a word's apostrophe
_QUOTED = re.compile("|".join(q % QUOTE_MAX for q in (r"(?<![\w'\"])'(?:[^'\\\n]|\\.){%d,}'(?!\w)",
                                                         r'(?<![\w\'"])"(?:[^"\\\n]|\\.){%d,}"(?!\w)')))


# what str.splitlines breaks a line at: a key or a file name holding one would make a refusal two lines
_BREAKS = re.compile("[\n\r\x0b\x0c\x1c-\x1e\x85\u2028\u2029]")


def _shorten(match: re.Match) -> str:
    text = match.group(0)
    return f"{text[:QUOTE_MAX - 20]}...{text[0]} ({len(text) - 2:,} characters)"


def _one_line(text: str) -> str:
    text = _QUOTED.sub(_shorten, text) if len(text) > QUOTE_MAX else text
    return _BREAKS.sub(lambda m: repr(m.group(0))[1:-1], text)


class AmpbenchError(Exception):
    """Base for errors whose message is written for the user; a value quoted in it longer than ``QUOTE_MAX`` is
    shortened to its start and its length, and a line break in it is written as its escape (``\\n``), so a refusal
    stays a line whatever the user handed over."""

    exit_code = 1

    def __init__(self, *args):
        super().__init__(*(_one_line(a) if isinstance(a, str) else a for a in args))


class Aborted(KeyboardInterrupt):
    """A second SIGTERM while a stop was under way: abort at once, as a second Ctrl-C does, with exit code 128 + the
    signal (143), not Ctrl-C's 130."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = int(signum)


class NotTheAnalysis(Exception):  # noqa: N818  a reason, not an error of the analysis
    """What an analysis needed went away under it (the tracking server, mid-call): not the analysis's failure, so
    ``analysis`` passes it on to its caller, which has failed with it."""


class ConfigError(AmpbenchError):
    """params.yaml asks for something invalid: exit code 2."""

    exit_code = 2


class EnvironmentMismatch(AmpbenchError):
    """This machine cannot run what params.yaml asks for: exit code 2."""

    exit_code = 2


class DataError(AmpbenchError):
    """The data set could not be fetched, verified or read: exit code 1."""

    exit_code = 1


class AnalysisError(AmpbenchError):
    """An analysis cannot be made for this model (the roofline cannot count an op): not the user's mistake; an
    analysis's caller warns of it, a command that is only that analysis exits 1 with its line."""

    exit_code = 1


class NonFiniteTraining(AmpbenchError):
    """Training produced inf/NaN too many steps in a row: exit code 3."""

    exit_code = 3
    result = None  # what the completed epochs measured, set by the engine


RANK_ERRORS_ENV = "AMPBENCH_RANK_ERRORS"  # a folder where each rank under torchrun leaves the message it stopped with


_PARENT: list[int] = []  # the process that started this one, as it was at the start


def stop_with_parent() -> None:
    """SIGTERM to this process when the process that started it dies (Linux's PR_SET_PDEATHSIG), even by SIGKILL,
    which no handler sees. DVC runs a stage with Popen and forwards it no signal: behind ``docker stop``'s SIGTERM
    (tini or a shell as PID 1 passes it to DVC, which dies of it) the stage would train on, orphaned, until the
    container's SIGKILL. It hears its parent's death as a scheduler's SIGTERM instead: the train stage stops at a
    step boundary with a checkpoint."""
    _PARENT[:] = [os.getppid()]
    if sys.platform.startswith("linux"):
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def supervise(cmd: list[str], **popen) -> int:
    """Run ``cmd`` (`dvc repro`) as a container's PID 1 must: a SIGTERM passed on to it, and every process it
    leaves waited for; its exit code (128 + the signal that ended it).

    ``docker stop`` and Kubernetes send SIGTERM to PID 1 alone, and the kernel delivers no signal to a PID 1 that has
    no handler for it: DVC as PID 1 ignores it, and the container's SIGKILL ends the stage without a checkpoint.
    Here this process takes it and passes it to DVC, which dies of it; the stage DVC runs hears that
    (``stop_with_parent``) and stops at a step with a checkpoint. The orphaned stage is this process's child then
    (PR_SET_CHILD_SUBREAPER), and is waited for: a PID 1 that exits takes everything in its container with it. A
    second SIGTERM reaches the stage too (it aborts at once). Ctrl-C reaches every process of the terminal's group
    already (DVC ignores it, the stage stops): it is not passed on again, unless this process is PID 1."""
    import ctypes
    import signal
    import subprocess

    import psutil
    linux = sys.platform.startswith("linux")
    if linux:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
    me = psutil.Process()
    before = {c.pid for c in me.children()}  # a caller's own children (a test's servers): never waited for here
    child: list[subprocess.Popen] = []
    early: list[int] = []

    def forward(signum, frame) -> None:
        if not child:  # before DVC started: passed on once it has
            early.append(signum)
        elif child[0].returncode is None:
            child[0].send_signal(signal.SIGTERM)  # (Popen's: never a pid reaped and reused since)
        else:  # DVC is gone: the stage it left behind
            for c in me.children():
                if c.pid not in before:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(c.pid, signal.SIGTERM)

    # the handlers first, so that no signal falls between the start and them
    keep = {signal.SIGTERM: signal.signal(signal.SIGTERM, forward),
            signal.SIGINT: signal.signal(signal.SIGINT, forward if os.getpid() == 1 else lambda *a: None)}
    try:
        child.append(subprocess.Popen(cmd, **popen))
        if early:
            forward(early[0], None)
        code = child[0].wait()
        while left := [c for c in me.children() if c.pid not in before]:  # the orphans reparented here, alone
            for c in left:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(c.pid, 0)
    finally:
        for signum, handler in keep.items():
            signal.signal(signum, handler)
        if linux:  # a caller that goes on (a test) is nobody's reaper from here
            ctypes.CDLL(None, use_errno=True).prctl(36, 0)
    return 128 - code if code < 0 else code


def quiet_if_orphaned() -> None:
    """Where the parent that read this process's output has died (its pipes have no reader: the next write would
    raise BrokenPipeError mid-stop), send stdout and stderr to /dev/null; otherwise nothing."""
    if _PARENT and os.getppid() != _PARENT[0]:
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            os.dup2(devnull, fd)
        os.close(devnull)


def run_cli(main: Callable[[], None]) -> None:
    """Run a stage's ``main``; turn a user-facing error into one line and an exit code.

    A stage DVC runs stops with DVC (``stop_with_parent``). Whatever the outcome, the objects alive at the end are
    frozen (``gc.freeze``): the interpreter's last collection then skips the millions that torch, dynamo and MLflow
    leave, which took about 2 s at each stage's exit, once the stage's files are written and closed."""
    # a stage DVC runs (DVC sets DVC_STAGE): not a server a user started with nohup, nor a rank torchrun started
    # (its launcher, the stage itself, hears DVC's death and stops its ranks as it stops them on any SIGTERM)
    if os.environ.get("DVC_STAGE") and "TORCHELASTIC_RUN_ID" not in os.environ:
        stop_with_parent()
    try:
        main()
    except AmpbenchError as err:
        under_torchrun = int(os.environ.get("WORLD_SIZE", 1)) > 1
        rank = f"rank {os.environ.get('RANK', '?')}: " if under_torchrun else ""
        print(f"error: {rank}{err}", file=sys.stderr)
        said = os.environ.get(RANK_ERRORS_ENV)
        if said and under_torchrun:  # the launcher says it again, last (train.distributed.torchrun)
            # its exit code first: the agent may stop this process (SIGTERM) before it exits with it
            with open(os.path.join(said, f"rank{os.environ.get('RANK', '0')}"), "w") as f:
                f.write(f"{err.exit_code}\n{rank}{err}")
        sys.exit(err.exit_code)
    except KeyboardInterrupt as err:
        signum = getattr(err, "signum", 2)  # Ctrl-C: SIGINT
        print("interrupted" if signum == 2 else f"aborted by a second {_signal_name(signum)}", file=sys.stderr)
        sys.exit(128 + signum)
    finally:
        gc.freeze()


def _signal_name(signum: int) -> str:
    import signal
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def first_line(err: BaseException) -> str:
    """``Type: the message's first line`` (an ampbench error's message alone: it is written for the user): what a
    one-line warning says of an exception."""
    text = str(err).strip().splitlines()
    if isinstance(err, AmpbenchError) and text:
        return text[0][:300]
    return f"{type(err).__name__}: {text[0][:300]}" if text else type(err).__name__


def analysis(name: str, model: str, fn: Callable, *args, **kwargs) -> tuple[object, str | None]:
    """Run the analysis ``name`` (a key of ``ANALYSES``) of ``model``: ``(its result, None)``, or, when it raises,
    ``(None, why)`` after one warning line (the analysis, the model, the error's first line). Training is the
    product; an analysis that cannot be made for a model is said, never a stopped pipeline. A user's mistake (a bad
    value, a machine that cannot run what is asked) and Ctrl-C still stop.

    Under DDP every rank runs the profile's collectives: a failure on one rank alone (the same code on the same
    model fails on all of them, as the tests' hook does) leaves the others to the process group's timeout."""
    try:
        asked = {n.strip() for n in os.environ.get(FAIL_ON_PURPOSE, "").split(",") if n.strip()}
        if name in asked or "all" in asked:
            raise RuntimeError(f"failed on purpose ({FAIL_ON_PURPOSE}={os.environ[FAIL_ON_PURPOSE]})")
        return fn(*args, **kwargs), None
    except (ConfigError, EnvironmentMismatch, NotTheAnalysis):
        raise
    except Exception as err:  # an analysis's own failure, whatever it is: the stage goes on
        why = first_line(err)
        print(f"warning: {ANALYSES[name]} could not be made for {model} ({why})", flush=True)
        return None, why
