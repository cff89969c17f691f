"""Imported first by every stage: ``ampbench`` from the ``src`` of the repository the stage runs in.

``make install`` installs this repository editable, so ``import ampbench`` would otherwise find the main
workspace's code wherever a stage runs: under ``dvc exp run --queue`` (or ``--temp``) DVC runs each experiment
in a copy of the repository under ``.dvc/tmp/exps/``, records that copy's ``src`` as the stages' dependencies and
files the results under it, so its stages must run that code, not the workspace's.
"""

import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")
if SRC in sys.path:
    sys.path.remove(SRC)
sys.path.insert(0, SRC)
