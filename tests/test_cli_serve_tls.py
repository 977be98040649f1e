"""`slotserve serve` hands a config's http_options (HTTPS files included) to Serve, and refuses
misspelt or missing ones before Ray starts. Ray and Serve are stubbed: no cluster here."""

from __future__ import annotations

import pytest
import yaml

from deployments.cli import main
from tests.hostile_service import self_signed_cert

def build(args):  # the config's import_path: stands in for deployments.app:build_app
    return ("app built from", args)


@pytest.fixture
def stubbed_serve(monkeypatch):
    import os

    import ray
    from ray import serve

    # The CLI sets Ray's environment in this process: keep it from the tests that follow.
    for key in [k for k in os.environ if k.startswith("RAY_SERVE_")]:
        monkeypatch.delenv(key)
    monkeypatch.setattr(os, "environ", os.environ.copy())
    calls: dict = {"env": os.environ}
    monkeypatch.setattr(ray, "init", lambda **kw: calls.setdefault("init", kw))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray, "nodes", lambda: [{"MetricsExportPort": 0}])
    monkeypatch.setattr(serve, "start", lambda **kw: calls.setdefault("start", kw))
    monkeypatch.setattr(serve, "run", lambda app, **kw: calls.setdefault("run", (app, kw)))
    monkeypatch.setattr(serve, "delete", lambda name: None)
    monkeypatch.setattr(serve, "shutdown", lambda: None)
    monkeypatch.setattr("deployments.cli.signal.signal", lambda *a: None)  # keep pytest's handlers

    def stop(_):  # the serve loop's first sleep: as if Ctrl-C came
        raise KeyboardInterrupt

    monkeypatch.setattr("deployments.cli.time.sleep", stop)
    return calls


def _config(tmp_path, http_options: dict) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({
        "http_options": {"host": "127.0.0.1", "port": 8443, **http_options},
        "grpc_options": {"port": 9443, "grpc_servicer_functions": []},
        "applications": [{"name": "slotserve", "import_path": "tests.test_cli_serve_tls:build", "args": {}}]}))
    return str(path)


def test_serve_passes_tls_files_to_the_http_proxy(tmp_path, stubbed_serve, capsys):
    cert, key = self_signed_cert(tmp_path)
    config = _config(tmp_path, {"ssl_certfile": str(cert), "ssl_keyfile": str(key), "request_timeout_s": 30})
    assert main(["serve", "--config", config]) == 0
    http = stubbed_serve["start"]["http_options"]
    assert (http.host, http.port, http.ssl_certfile, http.ssl_keyfile, http.request_timeout_s) == \
        ("127.0.0.1", 8443, str(cert), str(key), 30)
    assert stubbed_serve["start"]["grpc_options"].port == 9443 and stubbed_serve["run"][0] == ("app built from", {})
    out = capsys.readouterr().out
    assert "https://127.0.0.1:8443/v1" in out and "ingress: Serve's proxy" in out  # HAProxy mode is plain HTTP
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in stubbed_serve["env"]


def test_haproxy_takes_the_client_ports_by_default(tmp_path, stubbed_serve, capsys):
    assert main(["serve", "--config", _config(tmp_path, {})]) == 0
    assert stubbed_serve["env"]["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    start = stubbed_serve["start"]  # HAProxy binds where Serve's proxy would
    assert (start["http_options"].port, start["grpc_options"].port) == (8443, 9443)
    assert "ingress: HAProxy" in capsys.readouterr().out


def test_haproxy_with_a_certificate_is_refused_naming_the_field(tmp_path, stubbed_serve, capsys):
    cert, key = self_signed_cert(tmp_path)
    config = _config(tmp_path, {"ssl_certfile": str(cert), "ssl_keyfile": str(key)})
    assert main(["serve", "--config", config, "--ingress", "haproxy"]) == 2
    err = capsys.readouterr().err
    assert "http_options.ssl_certfile" in err and "--ingress proxy" in err and "init" not in stubbed_serve


@pytest.mark.parametrize("http_options, error", [
    ({"ssl_cert_file": "x.pem"}, "unknown http_options key(s) ssl_cert_file"),
    ({"ssl_certfile": "/nonexistent/cert.pem", "ssl_keyfile": "/nonexistent/key.pem"},
     "http_options.ssl_certfile: /nonexistent/cert.pem is not a file"),
    ({"ssl_certfile": "cert.pem"}, "Both ssl_keyfile and ssl_certfile must be provided"),
], ids=["misspelt-key", "missing-file", "cert-without-key"])
def test_serve_refuses_bad_tls_options_before_ray_starts(tmp_path, stubbed_serve, capsys, http_options, error):
    assert main(["serve", "--config", _config(tmp_path, http_options)]) == 2
    assert error in capsys.readouterr().err and "init" not in stubbed_serve
