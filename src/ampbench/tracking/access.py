"""Whether a tracking server takes this machine's runs, and why it refused, in one line a user can act on:
credentials (401), a right on the experiment (403), a certificate this machine does not trust. Asked and read
through MLflow's own client, so its settings (MLFLOW_TRACKING_USERNAME / PASSWORD / TOKEN,
MLFLOW_TRACKING_SERVER_CERT_PATH, MLFLOW_TRACKING_INSECURE_TLS) are the ones that apply."""

from __future__ import annotations

import os

from ampbench.config import one_line, redact_text
from ampbench.errors import first_line

HOST_REFUSED = "Invalid Host header"  # MLflow's guard against DNS rebinding: a name not in --allowed-hosts


def _user() -> str:
    """The account MLflow's client sends: MLFLOW_TRACKING_USERNAME, else ~/.mlflow/credentials."""
    from mlflow.utils.credentials import read_mlflow_creds
    return read_mlflow_creds().username or ""


def status(err: BaseException) -> int | None:
    """The HTTP status MLflow's client saw, if any."""
    code = getattr(err, "get_http_status_code", None)
    return code() if code else None


def for_status(code: int, experiment: str = "", body: str = "") -> str | None:
    """The cause of a refusal with this HTTP status (and body), or None if it is not about credentials or
    rights."""
    user = _user()
    if code == 403 and HOST_REFUSED in body:
        return ("the server refuses the name it was reached by: start it with --allowed-hosts naming the host:port "
                "in MLFLOW_TRACKING_URI")
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
    if "CERTIFICATE_VERIFY_FAILED" in text and ("Hostname mismatch" in text or "doesn't match" in text):
        return ("its TLS certificate is for another name than the one in MLFLOW_TRACKING_URI: use a name the "
                "certificate lists")
    if "CERTIFICATE_VERIFY_FAILED" in text:
        return ("its TLS certificate is not one this machine trusts: set MLFLOW_TRACKING_SERVER_CERT_PATH to the "
                "CA certificate (PEM) that signed it")
    if "WRONG_VERSION_NUMBER" in text or "wrong version number" in text:
        return "it does not speak TLS on that port: use http:// in MLFLOW_TRACKING_URI, or the server's TLS port"
    code = status(err)
    return for_status(code, experiment, text) if code else None


def describe(err: BaseException, experiment: str = "") -> str:
    """``cause`` if there is one, else what a request MLflow's client gave up on means (``gave_up``), else the
    error's type and first line."""
    return cause(err, experiment) or gave_up(err) or redact_text(first_line(err))


def gave_up(err: BaseException) -> str | None:
    """A request MLflow's client gave up on after its retries, in one line: the server not answering, a
    connection it cut, or an HTTP 5xx answer; a file it could not store names the likely cause, a disk that is full
    or not writable (the server's log says which; a full disk answers an upload with HTTP 500, or cuts it). None
    for any other error. The whole chain is read: a LoggedModel's failure reaches here wrapped, its text cut
    short."""
    import re
    from urllib.parse import urlsplit
    text = " ".join(str(e) for e in _chain(err))
    asked = re.search(r"API request to (\S+) failed with (?:timeout )?exception", text)
    if not asked:
        return None
    path = urlsplit(asked.group(1)).path
    tries = f"after {_retries()} retries"
    code = re.search(r"too many (\d{3}) error responses", text)
    cut = any(w in text for w in ("RemoteDisconnected", "Connection aborted", "Connection reset", "ConnectionReset"))
    if "/mlflow-artifacts/artifacts/" in path and (code or cut):  # an upload: a full disk answers 500, or cuts it
        name = path.rsplit("/", 1)[-1]
        how = (f"could not store {name} (HTTP {code.group(1)} {tries}):" if code
               else f"closed the connection while storing {name} {tries}: did it stop, or")
        return f"the server {how} is its artifact disk full or not writable? its log says which"
    if code:
        return (f"the server answered HTTP {code.group(1)} to {path} {tries}: is its database up? its log says why")
    if "Connection refused" in text or "NewConnectionError" in text:
        return f"the server did not answer (connection refused {tries}): is it running?"
    if cut:
        return f"the server closed the connection mid-request {tries} (it stopped or restarted?)"
    if "timed out" in text or "Timeout" in text:
        return f"the server did not answer in time {tries}"
    return None


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and the errors it was raised from."""
    out: list[BaseException] = []
    while err is not None and err not in out:
        out.append(err)
        err = err.__cause__ or err.__context__
    return out


def _retries() -> int:
    from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_MAX_RETRIES
    return MLFLOW_HTTP_REQUEST_MAX_RETRIES.get()


def check_server(uri: str, timeout: float, experiment: str = "") -> str | None:
    """``env.check_tracking_server`` for an http(s) server, asked through MLflow's own HTTP client."""
    from mlflow.exceptions import MlflowException
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    creds = get_default_host_creds(uri)

    def get(endpoint: str, **params):
        return http_request(creds, endpoint, "GET", max_retries=0, timeout=timeout, raise_on_status=False,
                            params=params or None)
    try:
        health = get("/health")
        if health.status_code != 200:
            return f"answered HTTP {health.status_code}"
        found = get("/api/2.0/mlflow/experiments/search", max_results=1)
        if found.status_code == 200 and experiment:
            return _right(get, experiment)
    except MlflowException as err:  # refused, timed out, a bad host, a certificate not trusted
        text = str(err)
        if "timed out" in text or "Timeout" in text:
            return f"did not answer within {timeout:g}s"
        return cause(err) or _reason(text)
    if found.status_code == 200:
        return None
    return for_status(found.status_code, "", found.text) or (
        f"answers, but not for its runs (HTTP {found.status_code}"
        + (f": {one_line(found.text[:300])}" if found.text else "") + "): is its database up?")


def _right(get, experiment: str) -> str | None:
    """Under MLflow's basic-auth app: whether this account may log to ``experiment`` (EDIT or MANAGE); None where
    it may, where the experiment does not exist yet (the first run makes it), or where the server has no accounts."""
    exp = get("/api/2.0/mlflow/experiments/get-by-name", experiment_name=experiment)
    if exp.status_code in (401, 403):
        return for_status(exp.status_code, experiment, exp.text)
    me = get("/api/2.0/mlflow/users/current")
    if exp.status_code != 200 or me.status_code != 200:  # no such experiment yet (the first run makes it), or no
        return None                                       # basic-auth app: every client may write
    user = me.json().get("user", {})
    if user.get("is_admin"):
        return None
    exp_id = exp.json()["experiment"]["experiment_id"]
    right = get("/api/3.0/mlflow/users/permissions/get", username=user.get("username", ""),
                resource_type="experiment", resource_id=exp_id)
    if right.status_code != 200:
        return None
    permission = right.json().get("permission", "")
    if permission in ("EDIT", "MANAGE"):
        return None
    return for_status(403, experiment).replace("may not write", f"has {permission or 'no right'} and may not "
                                                                "write", 1)


def _reason(text: str) -> str:
    """The cause inside requests' "Max retries exceeded ... (Caused by NewConnectionError(...: [Errno 111]
    Connection refused))": its last words."""
    import re
    found = re.findall(r"\[Errno -?\d+\] ([^'\")]+)", text)
    return found[-1].strip() if found else one_line(text)[:200]
