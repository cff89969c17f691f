"""The modes files get: what a plain ``open`` (or ``mkdir``) gives under this process's umask, read without
setting it: every stage's writes, the data stage's prepared set among them."""

from __future__ import annotations

import os


def process_umask() -> int:
    """This process's umask, read from ``/proc/self/status`` (Linux 4.7 and later), never by setting it: ``os.umask(0)``
    and back would, for that moment, give any file another thread makes (the system monitor's, MLflow's, Inductor's)
    mode 0666 or 0777. Only where the system has no such line is it set and restored."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o077)  # the strictest for the moment it is set
    os.umask(umask)
    return umask


def plain_mode(folder: bool = False) -> int:
    """The mode a plain ``open`` (or ``mkdir``) gives under this process's umask: what a team's other users read
    (mkstemp's own 0600, and mkdtemp's 0700, would hide the file from them)."""
    return (0o777 if folder else 0o666) & ~process_umask()
