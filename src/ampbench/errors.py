"""Errors a user can fix, and how a stage turns them into an exit code.

A user's mistake (a bad value in params.yaml, a missing archive, a machine that
cannot run what was asked) is reported as one line naming the value and the
fix, with a non-zero exit code and no traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


class AmpbenchError(Exception):
    """Base for errors whose message is written for the user."""

    exit_code = 1


class ConfigError(AmpbenchError):
    """params.yaml asks for something invalid: exit code 2."""

    exit_code = 2


class EnvironmentMismatch(AmpbenchError):
    """This machine cannot run what params.yaml asks for: exit code 2."""

    exit_code = 2


class DataError(AmpbenchError):
    """The data set could not be fetched, verified or read: exit code 1."""

    exit_code = 1


class NonFiniteTraining(AmpbenchError):
    """Training produced inf/NaN too many steps in a row: exit code 3."""

    exit_code = 3
    result = None  # what the completed epochs measured, set by the engine


def run_cli(main: Callable[[], None]) -> None:
    """Run a stage's ``main``; turn a user-facing error into one line and an exit code."""
    try:
        main()
    except AmpbenchError as err:
        under_torchrun = int(os.environ.get("WORLD_SIZE", 1)) > 1
        rank = f"rank {os.environ.get('RANK', '?')}: " if under_torchrun else ""
        print(f"error: {rank}{err}", file=sys.stderr)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
