"""A team's server, without one: what `ampbench team-server` refuses before it starts, the auth ini it writes
(read back as MLflow reads it), and the one-line causes ampbench gives for a server's refusals."""

from __future__ import annotations

import argparse
import configparser

import pytest

from ampbench.errors import ConfigError
from ampbench.tracking import access, server


def _args(**kw) -> argparse.Namespace:
    base = {"artifacts": "a", "host": "0.0.0.0", "port": 5000, "allowed_hosts": "tracking-host:5000", "workers": 1,
            "tls_cert": "c.pem", "tls_key": "k.pem", "no_tls": False, "default_permission": "NO_PERMISSIONS",
            "auth_cache_s": 60, "wait": 1}
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("change,words", [
    ({"tls_cert": "", "tls_key": ""}, "give --tls-cert and --tls-key"),
    ({"tls_cert": "", "tls_key": "", "no_tls": True}, "--no-tls on --host 0.0.0.0 would send every password"),
    ({"no_tls": True}, "--no-tls with --tls-cert"),
    ({"allowed_hosts": ""}, "--host 0.0.0.0 needs --allowed-hosts"),
    ({"default_permission": "EDIT"}, "--default-permission EDIT: give NO_PERMISSIONS"),
    ({}, "--tls-cert c.pem: no such file"),
])
def test_the_team_server_refuses_what_would_leave_it_open_before_starting(monkeypatch, tmp_path, change, words):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(server.STORE_ENV, "postgresql://mlflow@db/mlflow")
    monkeypatch.setenv(server.AUTH_DB_ENV, "postgresql://mlflow@db/mlflow_auth")
    with pytest.raises(ConfigError, match=words):
        server.team_server(_args(**change))
    assert not (tmp_path / "a").exists()  # nothing made


def test_the_auth_ini_keeps_a_percent_encoded_password_and_is_readable_by_its_user_alone(tmp_path):
    uri = "postgresql://mlflow:p%40ss%25w0rd@db:5432/mlflow_auth"
    path = server.auth_ini(tmp_path, uri, "READ", cache_s=30)
    assert path.stat().st_mode & 0o777 == 0o600
    read = configparser.ConfigParser()  # as mlflow.server.auth.config reads it
    read.read(path)
    assert read["mlflow"]["database_uri"] == uri and read["mlflow"]["default_permission"] == "READ"
    assert read["mlflow"]["auth_cache_ttl_seconds"] == "30"
    with pytest.raises(ConfigError, match="line break"):
        server.auth_ini(tmp_path, uri + "\nadmin_password = x", "READ")


@pytest.mark.parametrize("text,words", [
    ("SSLError(SSLCertVerificationError(1, '[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed "
     "certificate'))", "set MLFLOW_TRACKING_SERVER_CERT_PATH"),
    ("[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: Hostname mismatch, certificate is not valid for "
     "'tracking'", "for another name than the one in MLFLOW_TRACKING_URI"),
    ("SSLError(SSLError(1, '[SSL: WRONG_VERSION_NUMBER] wrong version number'))", "does not speak TLS"),
])
def test_each_tls_failure_gets_its_own_fix(text, words):
    assert words in access.cause(RuntimeError(text))


def test_refusals_are_named_by_their_cause(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_TOKEN", raising=False)
    monkeypatch.setenv("HOME", "/nonexistent")  # no ~/.mlflow/credentials
    assert access.for_status(401).startswith("the server wants credentials: set MLFLOW_TRACKING_USERNAME")
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "bob")
    assert "refused the credentials of MLFLOW_TRACKING_USERNAME=bob" in access.for_status(401)
    assert access.for_status(403, "team").startswith("this account (bob) may not write to experiment 'team'")
    assert "--allowed-hosts" in access.for_status(403, "team", "Invalid Host header - possible DNS rebinding")
    assert access.for_status(500) is None


def test_a_server_on_an_ipv6_address_is_probed_and_told_at_a_bracketed_url():
    """``--host ::1`` is loopback: the readiness probe must reach it (``http://::1:5000`` is no URL: requests refuses
    it, and the probe would wait its whole timeout, then stop a healthy server)."""
    import http.server
    import socket
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    class V6(http.server.HTTPServer):
        address_family = socket.AF_INET6

    httpd = V6(("::1", 0), Health)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port = httpd.server_address[1]

    class Running:
        def poll(self):
            return None

    try:
        told, probe = server.base_urls("http", "::1", port)
        assert told == probe == f"http://[::1]:{port}"
        assert server._wait_until_up(Running(), probe, 10)
    finally:
        httpd.shutdown()
    assert server.base_urls("https", "::", 5000) == ("https://[::]:5000", "https://[::1]:5000")
    assert server.base_urls("http", "0.0.0.0", 5000) == ("http://0.0.0.0:5000", "http://127.0.0.1:5000")
