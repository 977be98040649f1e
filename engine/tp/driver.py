"""Rank 0's side of tensor parallelism: starts the other ranks, sends them every step,
watches them and stops them. Owned by LLMEngine when ``tensor_parallel_size`` > 1."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.memory import DraftFootprint
from engine.model import ModelArch
from engine.model.gpu_quant import resolve_scheme
from engine.model.quant_checkpoint import check_tp_cuts
from engine.parallel import check_tp_shapes
from engine.runner import ModelRunner
from engine.tp.channel import LORA, STEP, STOP
from engine.tp.launcher import ProcessLauncher, RankLauncher
from engine.tp.messages import StepEncoder
from engine.tp.rendezvous import RankSpec, StartupWatch, join, leave, open_store
from engine.tp.worker import head_reads_embedding

logger = logging.getLogger(__name__)
STOP_TIMEOUT_S = 10.0


class TensorParallelDriver:
    def __init__(self, config: EngineConfig, model_path: Path, arch: ModelArch, max_model_len: int,
                 launcher: RankLauncher | None = None, timings: dict | None = None) -> None:
        world = config.parallel.tensor_parallel_size
        check_tp_shapes(arch.num_heads, arch.num_kv_heads, arch.intermediate_size, arch.vocab_size, world)
        scheme = resolve_scheme(model_path, config.model.quantization)
        if scheme is not None:
            check_tp_cuts(scheme, arch, world)
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process: one tensor-parallel "
                               "engine per process (shut the other one down first)")
        self.world_size = world
        self.launcher = launcher or ProcessLauncher()
        devices = self.launcher.place(world, config.model.device)
        self.device = devices[0]
        backend = "nccl" if self.device.startswith("cuda") else "gloo"
        threads = config.num_threads
        if threads is None and backend == "gloo":  # N ranks must not each spin a team over every core
            threads = max(1, (os.cpu_count() or 1) // world)
            torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(torch.device(self.device))
        self.encoder = StepEncoder(config.cache.block_size)
        self.rank_param_bytes: list[int] = []
        self._lock = threading.Lock()  # the step channel: the engine loop and shutdown may both send
        self._failed: str | None = None
        self._closed = False
        self._serving = False  # the workers are in their step loop (they read the channel)
        self._backend = backend
        self.store = open_store(0, world)
        self.watch = StartupWatch(self.store, world, self.launcher.dead)
        try:
            self.launcher.start([RankSpec(r, world, self.store.port, backend, devices[r], config, str(model_path),
                                          max_model_len, threads) for r in range(1, world)])
            self.watch.go()
            self.group, self.channel = join(self.store, 0, world, backend, config.parallel.distributed_timeout_s,
                                            timings)
        except BaseException:
            self.shutdown(timeout_s=0.0)
            raise

    def agree_blocks(self, blocks: int, param_bytes: int) -> int:
        agreed, self.rank_param_bytes = self.watch.agree_blocks(blocks, param_bytes)
        return agreed

    def attach(self, runner: ModelRunner) -> None:
        """After every rank has loaded: bring the model's collectives up, then feed each step."""
        self.group.all_reduce(torch.zeros(1, device=runner.device))
        runner.send_step = self.send_step
        self._serving = True
        logger.info("tensor parallel: %d ranks (%s), parameter bytes per rank %s", self.world_size, self._backend,
                    self.rank_param_bytes)

    # ------------------------------------------------------------------ steps and health
    def send_step(self, chunks: list) -> None:
        self.check()
        payload = self.encoder.encode(chunks)
        with self._lock:
            self.channel.send(STEP, payload)

    def send_lora(self, slot: int, info) -> None:
        """Every other rank puts adapter ``info`` (engine.lora.AdapterInfo) in ``slot``, reading its shard."""
        self.check()
        with self._lock:
            self.channel.send(LORA, [slot, *info.to_json().encode()])

    def check(self) -> None:
        """Raise EngineDeadError when a rank is gone or a collective has failed."""
        if self._failed is None and not self._closed:
            dead = self.launcher.dead()
            if dead:
                self._failed = "tensor-parallel rank(s) died: " + ", ".join(
                    f"rank {r} ({why})" for r, why in sorted(dead.items()))
        if self._failed is not None:
            raise EngineDeadError(self._failed)
        if self._closed:
            raise EngineDeadError("tensor-parallel engine was shut down")

    def fail(self, exc: BaseException) -> EngineDeadError:
        """A step failed (a collective broke or timed out): the ranks are out of step for good."""
        if isinstance(exc, EngineDeadError):
            return exc
        if self._failed is None:
            dead = self.launcher.dead()
            why = (", ".join(f"rank {r} died ({w})" for r, w in sorted(dead.items())) if dead
                   else str(exc).split(". ")[0][:300])  # gloo appends paragraphs of advice
            self._failed = f"tensor-parallel step failed: {type(exc).__name__}: {why}"
        return EngineDeadError(self._failed)

    # ------------------------------------------------------------------ shutdown
    def shutdown(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop every worker: STOP over the channel, then the launcher kills what has not ended."""
        if self._closed:
            return
        self._closed = True
        if self._serving and self._failed is None and not self.launcher.dead():
            if self._lock.acquire(timeout=1.0):  # the loop may be stuck mid-send: then just kill
                try:
                    self.channel.send(STOP, [])
                    self.channel.flush()
                except Exception:  # noqa: BLE001 - a worker died meanwhile; killing follows
                    logger.warning("could not send STOP to the tensor-parallel ranks", exc_info=True)
                finally:
                    self._lock.release()
        self.launcher.stop(timeout_s if self._failed is None else 0.0)  # broken ranks get no grace
        if self._failed is None or self._backend == "gloo":  # NCCL teardown after a failure may hang
            try:
                leave()
            except Exception:  # noqa: BLE001
                logger.warning("tearing down the process group failed", exc_info=True)


def start_tensor_parallel(config: EngineConfig, model_path: Path, arch: ModelArch, max_model_len: int,
                          launcher: RankLauncher | None, timings: dict | None,
                          aux_layers: tuple[int, ...] = (), draft: DraftFootprint | None = None,
                          ) -> tuple[TensorParallelDriver, ModelRunner]:
    """Start the workers and rank 0's runner (loading in parallel); all or nothing. ``aux_layers`` and
    ``draft``: rank 0's, for what drafts beside it (engine.runner.ModelRunner); the ranks agree on
    the smallest pool."""
    driver = TensorParallelDriver(config, model_path, arch, max_model_len, launcher, timings)
    try:
        runner = ModelRunner(config, model_path, arch, max_model_len, driver.group, driver.device,
                             agree_blocks=driver.agree_blocks, aux_layers=aux_layers, draft=draft)
        driver.attach(runner)
        if head_reads_embedding(config):
            runner.whole_embedding = runner.model.embed_tokens.gathered()
    except BaseException:
        driver.shutdown(timeout_s=0.0)
        raise
    return driver, runner
