"""Tensor-parallel rank workers as Ray actors in the engine replica's placement group.

The engine deployment reserves N bundles on one node (STRICT_PACK, deployments.app); the
replica actor (rank 0) sits in bundle 0 and this launcher puts rank r in bundle r, with
that bundle's resources. The actors are owned by the replica: they die with it, and
Serve removing the replica's placement group kills them too.

GPU ranks see every GPU of the node (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, set by
deployments.app) and each picks its own by Ray's assignment: NCCL's P2P/NVLS paths
expect peers to be visible; one GPU per process has hit NCCL bugs on NVSwitch nodes.
"""

from __future__ import annotations

import concurrent.futures
import os

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine.tp.launcher import RankLauncher
from engine.tp.rendezvous import RankSpec

NOSET_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def assigned_cuda_device() -> str:
    """This process's Ray-assigned GPU as a torch device string."""
    gpu_id = str(ray.get_gpu_ids()[0])
    if os.environ.get(NOSET_VISIBLE_DEVICES) != "1":
        return "cuda:0"  # Ray masked CUDA_VISIBLE_DEVICES to that one GPU
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f"cuda:{visible.split(',').index(gpu_id) if visible else int(gpu_id)}"


class RankActor:
    def device(self, want_cuda: bool) -> str:
        return assigned_cuda_device() if want_cuda else "cpu"

    def run(self, spec: RankSpec) -> None:
        from engine.tp.worker import run_rank

        run_rank(spec)


class RayRankLauncher(RankLauncher):
    def __init__(self) -> None:
        self._actors: list = []
        self._ranks: list[int] = []
        self._done: list[concurrent.futures.Future] = []

    def place(self, world_size: int, device: str) -> list[str]:
        pg = get_current_placement_group()
        if pg is None or pg.bundle_count < world_size:
            raise ValueError(f"tensor_parallel_size {world_size} needs the engine replica in a placement group of "
                             f"{world_size} bundles (build_app reserves it); found "
                             f"{'none' if pg is None else pg.bundle_count}")
        bundles = pg.bundle_specs
        want_cuda = bundles[0].get("GPU", 0) > 0
        if want_cuda != device.startswith("cuda") and device != "auto":
            raise ValueError(f"device {device!r} does not match the replica's bundles {bundles[0]}")
        actor_class = ray.remote(RankActor)
        for rank in range(1, world_size):
            self._actors.append(actor_class.options(
                num_cpus=bundles[rank].get("CPU", 0), num_gpus=bundles[rank].get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
            ).remote())
            self._ranks.append(rank)
        rank0 = assigned_cuda_device() if want_cuda else "cpu"
        return [rank0] + ray.get([a.device.remote(want_cuda) for a in self._actors])

    def start(self, specs: list[RankSpec]) -> None:
        by_rank = dict(zip(self._ranks, self._actors))
        self._done = [by_rank[spec.rank].run.remote(spec).future() for spec in specs]

    def dead(self) -> dict[int, str]:
        return {rank: _why(done) for rank, done in zip(self._ranks, self._done) if done.done()}

    def stop(self, timeout_s: float) -> None:
        if self._done:
            concurrent.futures.wait(self._done, timeout=timeout_s)
        for actor in self._actors:  # an actor whose loop ended still holds its bundle's resources
            ray.kill(actor)


def _why(done: concurrent.futures.Future) -> str:
    exc = done.exception()
    return "its loop returned" if exc is None else f"{type(exc).__name__}: {str(exc)[:300]}"
