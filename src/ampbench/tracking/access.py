"""Why a tracking server refused, in one line a user can act on: credentials (401), a right on the experiment
(403), a certificate this machine does not trust. Read from MLflow's own client errors, so its settings
(MLFLOW_TRACKING_USERNAME / PASSWORD / TOKEN, MLFLOW_TRACKING_SERVER_CERT_PATH, MLFLOW_TRACKING_INSECURE_TLS) are
the ones that applied."""

from __future__ import annotations

import os

from ampbench.config import redact_text

TLS_MARKS = ("CERTIFICATE_VERIFY_FAILED", "SSLCertVerificationError", "SSLError", "certificate verify failed")


def status(err: BaseException) -> int | None:
    """The HTTP status MLflow's client saw, if any."""
    code = getattr(err, "get_http_status_code", None)
    return code() if code else None


def for_status(code: int, experiment: str = "") -> str | None:
    """The cause of a refusal with this HTTP status, or None if it is not about credentials or rights."""
    user = os.environ.get("MLFLOW_TRACKING_USERNAME", "")
    where = f"experiment {experiment!r}" if experiment else "its experiments"
    if code == 401:
        if not user and not os.environ.get("MLFLOW_TRACKING_TOKEN"):
            return ("the server wants credentials: set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (your "
                    "account on it)")
        return (f"the server refused the credentials of MLFLOW_TRACKING_USERNAME={user}: check "
                "MLFLOW_TRACKING_PASSWORD")
    if code == 403:
        return (f"this account ({user or 'anonymous'}) may not write to {where}: ask the server's admin for EDIT "
                f"(`ampbench team-user {user or 'NAME'} --permission EDIT`)")
    return None


def cause(err: BaseException, experiment: str = "") -> str | None:
    """What the user can do about ``err`` (a credential, a right, a CA), or None if it is none of these."""
    text = str(err)
    if any(mark in text for mark in TLS_MARKS):
        return ("its TLS certificate is not one this machine trusts: set MLFLOW_TRACKING_SERVER_CERT_PATH to the "
                "CA certificate (PEM) that signed it")
    code = status(err)
    return for_status(code, experiment) if code else None


def first(err: BaseException) -> str:
    """The error's first line, passwords redacted, at most 200 characters."""
    return redact_text((str(err).strip().splitlines() or [""])[0])[:200]


def describe(err: BaseException, experiment: str = "") -> str:
    """``cause`` if there is one, else the error's type and first line."""
    return cause(err, experiment) or f"{type(err).__name__}: {first(err)}"
