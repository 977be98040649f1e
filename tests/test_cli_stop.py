"""`slotserve serve` from the command line stops cleanly however it is stopped: a signal to
its whole process group (`timeout`, a shell's job control) or a SIGKILL of the command.

The command runs the driver and the local Ray in a session of their own (``cli.supervise``):
before that, SIGTERM to the group killed Ray's GCS with the driver, the drain waited 60 s
for it, and Ray's HAProxy was left holding the client ports. Real processes here: the
command, a local Ray, HAProxy, the app on a tiny model; every process of the session must
be gone once the command has stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.ray_cluster import free_port

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]

UP_TIMEOUT_S = 180
GONE_TIMEOUT_S = 60


def _config(tmp_path: Path, model_dir: Path) -> Path:
    app = {"model": str(model_dir), "served_model_name": "tiny", "num_replicas": 1, "drain_timeout_s": 2,
           "engine": {"device": "cpu", "dtype": "float32", "max_num_seqs": 2, "num_kv_blocks": 64,
                      "block_size": 16, "max_model_len": 256},
           "replica_resources": {"num_cpus": 0.5}, "ingress": {"num_cpus": 0.25}}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({
        "http_options": {"host": "127.0.0.1", "port": free_port()},
        "grpc_options": {"port": free_port(), "grpc_servicer_functions": [
            "deployments.grpc_registration.add_slotserve_servicer",
            "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server"]},
        "applications": [{"name": "slotserve", "route_prefix": "/", "import_path": "deployments.app:build_app",
                          "args": app}]}))
    return path


def _session(sid: int) -> list[tuple[int, str]]:
    """(pid, name) of every live process in session ``sid``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if int(rest[3]) == sid and rest[0] != "Z":  # fields after the name: state ppid pgrp session
            found.append((int(entry.name), name))
    return found


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("stop", ["SIGTERM to the group", "SIGKILL to the command"])
def test_serve_drains_and_leaves_no_process(stop, tmp_path, tiny_model_dir):
    log = tmp_path / "serve.log"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
           "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port())}  # not 8404 / 9101: another HAProxy may hold them
    env.pop("SLOTSERVE_SERVE_OWN_SESSION", None)
    with open(log, "w") as out:
        command = subprocess.Popen(
            [sys.executable, "-m", "deployments.cli", "serve", "--config", str(_config(tmp_path, tiny_model_dir)),
             "--num-cpus", "2"], stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + UP_TIMEOUT_S
        while "slotserve is up" not in log.read_text():
            assert command.poll() is None, f"serve exited early:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"not up in {UP_TIMEOUT_S} s:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
        (driver,) = _children(command.pid)
        assert {name for _, name in _session(driver)} >= {"gcs_server", "raylet", "haproxy"}
        if stop == "SIGTERM to the group":
            os.killpg(command.pid, signal.SIGTERM)  # what `timeout` sends
        else:
            command.kill()
        stopped = time.monotonic()
        while _session(driver) and time.monotonic() - stopped < GONE_TIMEOUT_S:
            time.sleep(0.5)
        took = time.monotonic() - stopped
        left = _session(driver)
        text = log.read_text()
        assert not left, f"{stop}: still running {took:.0f} s later: {left}\n{text[-3000:]}"
        assert "shutting down (draining running requests)" in text, text[-3000:]
        assert "Failed to connect to GCS" not in text, text[-3000:]
        assert command.wait(10) == (0 if stop == "SIGTERM to the group" else -signal.SIGKILL)
        print(f"{stop}: the session was gone {took:.1f} s later")
    finally:
        if command.poll() is None:
            os.killpg(command.pid, signal.SIGKILL)
