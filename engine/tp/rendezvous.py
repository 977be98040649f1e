"""Bringing the ranks of one replica together.

Rank 0 hosts a TCPStore on 127.0.0.1 (the ranks of a replica share a node). Start-up is
a handshake on that store: each worker says hello, waits for ``go``, joins the process
groups, loads its shard and reports the KV blocks it can hold; rank 0 answers with the
pool size every rank uses (the smallest). Start-up waits are long (a rank may be loading
a 70B shard) but watched: rank 0 polls the store and the launcher, so a worker that fails
or dies while starting is reported at once, with its error. Collectives after start-up
time out after ``distributed_timeout_s``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from engine.config import EngineConfig
from engine.parallel import ParallelGroup
from engine.tp.channel import StepChannel

HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 1800.0
# The step channel's group: ranks wait on it between steps, however long the engine idles.
IDLE_TIMEOUT = timedelta(days=7)
POLL_S = 0.05


@dataclass(frozen=True)
class RankSpec:
    """What a rank worker needs to join its replica and load its shard (picklable)."""

    rank: int
    world_size: int
    port: int
    backend: str
    device: str
    config: EngineConfig
    model_path: str
    max_model_len: int
    num_threads: int | None = None


def open_store(rank: int, world_size: int, port: int = 0) -> dist.TCPStore:
    """Rank 0 (port 0: any free one, read back from ``.port``) or a client of it."""
    return dist.TCPStore(HOST, port, world_size, is_master=rank == 0, wait_for_workers=False,
                         timeout=timedelta(seconds=STARTUP_TIMEOUT_S))


def join(store: dist.TCPStore, rank: int, world_size: int, backend: str, timeout_s: float,
         timings: dict | None = None) -> tuple[ParallelGroup, StepChannel]:
    """The model's group (``backend``, default group) and the step channel's gloo group."""
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return ParallelGroup(rank, world_size, timings=timings), StepChannel(control)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------- worker side
def say(store: dist.TCPStore, stage: str, rank: int, value: str = "") -> None:
    store.set(f"tp/{stage}/{rank}", value)


def wait_go(store: dist.TCPStore) -> None:
    store.wait(["tp/go"])


def report_ready(store: dist.TCPStore, rank: int, blocks: int, param_bytes: int) -> int:
    """Tell rank 0 what this rank can hold; returns the pool size all ranks use."""
    say(store, "ready", rank, f"{blocks} {param_bytes}")
    store.wait(["tp/blocks"])
    return int(store.get("tp/blocks"))


def report_error(store: dist.TCPStore, rank: int, exc: BaseException) -> None:
    try:
        say(store, "error", rank, f"{type(exc).__name__}: {exc}"[:2000])
    except Exception:  # noqa: BLE001 - rank 0 is gone too; nothing to tell
        pass


# ---------------------------------------------------------------------- rank 0 side
class StartupWatch:
    """Rank 0 waiting for every worker to reach a stage, failing fast on an error or death."""

    def __init__(self, store: dist.TCPStore, world_size: int, dead: Callable[[], dict[int, str]]) -> None:
        self.store, self.world_size, self.dead = store, world_size, dead

    def wait(self, stage: str, timeout_s: float = STARTUP_TIMEOUT_S) -> list[str]:
        keys = [f"tp/{stage}/{r}" for r in range(1, self.world_size)]
        deadline = time.monotonic() + timeout_s
        while not self.store.check(keys):
            self._raise_failures()
            if time.monotonic() > deadline:
                missing = [k for k in keys if not self.store.check([k])]
                raise TimeoutError(f"tensor-parallel start-up: no {stage!r} from {', '.join(missing)} "
                                   f"within {timeout_s:.0f} s")
            time.sleep(POLL_S)
        return [self.store.get(k).decode() for k in keys]

    def _raise_failures(self) -> None:
        dead = self.dead()
        for r in range(1, self.world_size):  # a reported error says more than an exit code
            if self.store.check([f"tp/error/{r}"]):
                raise RuntimeError(f"tensor-parallel rank {r} failed to start: "
                                   f"{self.store.get(f'tp/error/{r}').decode()}")
        if dead:
            raise RuntimeError("tensor-parallel rank(s) exited while starting: "
                               + ", ".join(f"rank {r} ({why})" for r, why in sorted(dead.items())))

    def agree_blocks(self, blocks: int, param_bytes: int) -> tuple[int, list[int]]:
        """The pool size every rank can hold, and each rank's parameter bytes."""
        reports = [(blocks, param_bytes)] + [tuple(map(int, r.split())) for r in self.wait("ready")]
        agreed = min(b for b, _ in reports)
        self.store.set("tp/blocks", str(agreed))
        return agreed, [p for _, p in reports]

    def go(self) -> None:
        self.wait("hello")
        self.store.set("tp/go", "1")
