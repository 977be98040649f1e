"""How rank workers are started, watched and stopped.

The engine never imports ray, so it defines the interface and a local implementation;
deployments.tp_launcher implements it with Ray actors in the replica's placement group.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

from engine.tp.rendezvous import RankSpec


class RankLauncher(ABC):
    @abstractmethod
    def place(self, world_size: int, device: str) -> list[str]:
        """The torch device of every rank (rank 0 first), from the configured ``device``."""

    @abstractmethod
    def start(self, specs: list[RankSpec]) -> None:
        """Start one worker running ``engine.tp.worker.run_rank(spec)`` per spec (ranks 1..N-1)."""

    @abstractmethod
    def dead(self) -> dict[int, str]:
        """Ranks whose worker has ended, with why. Cheap: called on every step."""

    @abstractmethod
    def stop(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the workers to end, then kill what is left."""


class ProcessLauncher(RankLauncher):
    """Workers as local processes (spawned, daemonic: they die with this process at exit)."""

    def __init__(self) -> None:
        self.processes: list[tuple[int, object]] = []

    def place(self, world_size: int, device: str) -> list[str]:
        import torch

        from engine.runner import resolve_device

        dev = resolve_device(device)
        if dev.type != "cuda":
            return [dev.type] * world_size
        first, count = dev.index or 0, torch.cuda.device_count()
        if first + world_size > count:
            raise ValueError(f"tensor_parallel_size {world_size} needs GPUs cuda:{first}..cuda:{first + world_size - 1}"
                             f"; {count} visible")
        return [f"cuda:{first + r}" for r in range(world_size)]

    def start(self, specs: list[RankSpec]) -> None:
        import torch.multiprocessing as mp

        from engine.tp.worker import run_rank

        ctx = mp.get_context("spawn")
        for spec in specs:
            proc = ctx.Process(target=run_rank, args=(spec,), name=f"slotserve-tp-rank{spec.rank}", daemon=True)
            proc.start()
            self.processes.append((spec.rank, proc))

    @property
    def pids(self) -> list[int]:
        return [proc.pid for _, proc in self.processes]

    def dead(self) -> dict[int, str]:
        return {rank: f"exit code {proc.exitcode}" for rank, proc in self.processes if proc.exitcode is not None}

    def stop(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for _, proc in self.processes:
            proc.join(max(0.0, deadline - time.monotonic()))
        for _, proc in self.processes:
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
