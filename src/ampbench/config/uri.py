"""Where MLflow runs go, and a tracking URI fit to print: the repository a stage belongs to, passwords
redacted."""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from ampbench.config.schema import MlflowConfig


def project_root(cwd: Path) -> Path:
    """The repository a stage belongs to: $DVC_ROOT, which DVC sets to the repository an experiment was queued
    from when it runs in a temporary workspace (``dvc exp run --queue``, ``--temp``), else ``cwd``."""
    return Path(os.environ.get("DVC_ROOT") or cwd).resolve()


def redact(uri: str) -> str:
    """A tracking URI fit to print or log: a password in it (``postgresql://user:secret@host/db``, ``?password=``)
    replaced by ***."""
    parts = urlsplit(uri)
    netloc = parts.netloc
    if parts.password:
        netloc = netloc.replace(f":{parts.password}@", ":***@", 1)
    query = re.sub(r"(?i)((?:password|passwd|pwd|token|secret)=)[^&]*", r"\1***", parts.query)
    return urlunsplit(parts._replace(netloc=netloc, query=query)) if (netloc, query) != (parts.netloc, parts.query) \
        else uri


def redact_text(text: str) -> str:
    """Any ``scheme://user:password@`` in a message (an error naming the URI it failed on), and any
    ``password=``, ``token=`` or ``secret=`` value (a URI's query, a connection string), with *** for the secret."""
    text = re.sub(r"(://[^:/@\s]+:)[^@\s]+@", r"\1***@", text)
    return re.sub(r"(?i)((?:password|passwd|pwd|token|secret)=)[^&\s'\"]*", r"\1***", text)


def tracking_uri(cfg: MlflowConfig, repo_root: Path) -> str:
    """Where MLflow runs go: $MLFLOW_TRACKING_URI, else params.yaml's, else this repository's own store (the
    queuing repository's for a queued experiment: a temporary workspace's store would be deleted with it)."""
    env = os.environ.get("MLFLOW_TRACKING_URI", "")
    if env:
        return env
    if cfg.tracking_uri:
        return cfg.tracking_uri
    return f"sqlite:///{project_root(repo_root) / 'mlflow.db'}"


def one_line(text: str) -> str:
    """``text`` (a server's answer, a driver's error) on one line, passwords redacted."""
    return redact_text(" ".join(text.split()))
