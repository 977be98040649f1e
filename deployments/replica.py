"""EngineReplica: one AsyncEngine per Serve replica (one per GPU, or CPUs on a laptop).

The class is plain Python (Serve wraps it in ``app.build_app``), so it is tested
in-process with a fake engine (tests/fake_engine.py). Requests arrive on its engine link
(``deployments.link``), which streams each through ``generate(request)``: an async generator,
one ``EngineMessage`` per engine output (``deployments.contract``: all of a step's tokens of one
choice); cancelling or closing it aborts the engine request. What Serve
calls on it:

- ``link_address(request)``: which replica takes a request, for an ingress whose router has
  not heard from any replica yet (routed and queued by Serve; the request then comes over the link).
- ``record_routing_stats()``: its ``router.policy.RoutingStats``, which the routers read.
- ``record_autoscaling_stats()``: ``slot_occupancy``, ``waiting`` and ``max_num_seqs`` for
  the autoscaler (router.autoscale).
- ``check_health()``: raises when the engine loop is dead or stuck; Serve replaces us.
- Prometheus metrics (deployments.metrics): gauges and counters from the engine's stats on a
  periodic task, each request's latencies when its stream ends; none in the step loop. On a
  GPU, which GPUs it holds and how much of their memory (deployments.nvml).
- Traces (deployments.tracing): each request's routing and engine spans, built from the
  engine's audit trail when the request ends; the last message carries that trail too.
- ``__del__`` (ServeEngineReplica): stop taking requests, drain running ones for up to
  ``drain_timeout_s``, then shut the engine down.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import sys
import time
from typing import Any, AsyncIterator

from deployments.contract import EngineMessage, EngineRequest
from deployments.link import LinkServer, LinkTls
from deployments.metrics import EngineMetrics, Recorder, recorder_for
from deployments.nvml import GpuMonitor
from deployments.tracing import Tracing
from engine.errors import EngineDeadError, UnknownAdapterError
from engine.kv.hashing import PREFIX_DIGEST_ENTRIES
from engine.outputs import StreamOutput
from engine.pooling import pooling_of
from router.policy import RoutingStats

logger = logging.getLogger(__name__)
serve_log = logging.getLogger("ray.serve")
"""The replica's Serve log: the drain's steps stand beside Serve's own ("Drained ongoing requests")."""

ABORT_GRACE_S = 2.0  # after the drain timeout: time for aborted streams to end before the engine stops
METRICS_PERIOD_S = 1.0  # gauges from the stats snapshot; Ray exports every metrics_report_interval_ms
_local_ids = itertools.count()


def show_engine_log() -> None:
    """The engine's INFO lines (the host's CPU, start-up phases, warm-up progress) on this Ray worker's
    stderr, which Ray forwards to the driver's terminal (`slotserve serve`): a worker's root logger
    passes on warnings only."""
    log = logging.getLogger("engine")
    if not any(getattr(handler, "slotserve", False) for handler in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s -- %(message)s"))
        handler.slotserve = True
        log.addHandler(handler)
    log.setLevel(logging.INFO)


def _replica_id() -> str:
    try:
        from ray import serve
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not inside a Serve replica (tests, local use)
        return f"local-{next(_local_ids)}"


class EngineReplica:
    def __init__(self, model: str, engine_options: dict[str, Any] | None = None,
                 engine_class: type | None = None, drain_timeout_s: float = 30.0,
                 model_name: str | None = None, metrics: Recorder | None = None,
                 tracing: Tracing | None = None, link_token: str | None = None,
                 link_host: str = "127.0.0.1", link_tls: LinkTls | None = None) -> None:
        """``engine_class``: the engine's class (default ``engine.async_engine.AsyncEngine``; tests
        pass a fake); ``model_name``: the served name, the metrics' ``model_name`` label (default ``model``);
        ``metrics``: where they go (default: Ray's metrics in a Ray worker, else nowhere);
        ``tracing``: where spans go (default: as the ``OTEL_*`` environment variables say);
        ``link_token``: serve engine links (deployments.link) on ``link_host``, with this token
        (and ``link_tls``, if given)."""
        if not isinstance(drain_timeout_s, (int, float)) or drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be a non-negative number, got {drain_timeout_s!r}")
        self._model = model
        options = dict(engine_options or {})
        if options.get("tensor_parallel_size", 1) > 1:  # rank workers in this replica's placement group
            from deployments.tp_launcher import RayRankLauncher
            options["launcher"] = RayRankLauncher()
        if engine_class is None:
            from engine.async_engine import AsyncEngine as engine_class
        self._engine = engine_class.from_options(model, **options)
        self._drain_timeout_s = float(drain_timeout_s)
        self._accepting = True
        self._active: set[str] = set()
        self.replica_id = _replica_id()
        self._shutdown_done = False
        self._model_name = model_name or model
        self._metrics = EngineMetrics(metrics if metrics is not None else recorder_for(self._model_name))
        self._metrics_task: asyncio.Task | None = None
        self._metrics_failed = False
        self._gpus = GpuMonitor.open() if self._metrics.enabled else None
        self._own_tracing = tracing is None  # flushed at shutdown; a given one belongs to its giver
        self.tracing = tracing if tracing is not None else Tracing.from_env()
        self._start_metrics_loop()  # Serve builds replicas on their event loop; else on the first request
        self._unloaded_adapters: set[str] = set()  # unloaded through the API: never read again on demand
        self._link = LinkServer(self, link_token, link_host, link_tls) if link_token else None
        self._link_started: asyncio.Task | None = None
        self._start_link()

    @property
    def engine(self):
        return self._engine

    @property
    def metrics(self) -> EngineMetrics:
        """What this replica records; ``metrics.recorder`` (like ``tracing``) may be swapped at run time."""
        return self._metrics

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineMessage]:
        """Stream one request through the engine."""
        if not self._accepting:
            raise EngineDeadError("this replica is shutting down and takes no new requests")
        received_ns = time.time_ns()
        rid = request.request_id
        if request.lora_path is not None and request.lora not in self._engine.stats().lora_paths:
            # Loaded at run time on other replicas (deployments.adapters): read it here too, unless it
            # was unloaded here (an ingress may still list it until its next poll).
            if request.lora in self._unloaded_adapters:
                raise UnknownAdapterError(f"adapter {request.lora!r} was unloaded")
            await self._engine.load_lora(request.lora, request.lora_path)
        stream = self._engine.generate(request.prompt_token_ids, request.params, request_id=rid,
                                       priority=request.priority, resume_token_ids=request.resume_token_ids,
                                       resume_choices=request.resume_choices, lora=request.lora,
                                       cache_salt=request.cache_salt, tenant=request.tenant,
                                       tenant_weight=request.tenant_weight)
        self._active.add(rid)
        self._start_metrics_loop()
        request_metrics = self._metrics.request()
        finished = False
        last: StreamOutput | None = None
        lead_timing = None  # choice 0's: the request's latencies (with n > 1 its siblings start later)
        try:
            async for out in stream:
                last = out
                first = out.index == 0 and lead_timing is None
                if out.index == 0:  # one choice's cadence: interleaved siblings are no inter-token gap
                    request_metrics.on_message(out)
                    lead_timing = out.timing
                finished = out.request_finished
                if finished:  # done here, even if the consumer never asks for more
                    self._active.discard(rid)
                    request_metrics.on_end(dataclasses.replace(out, timing=lead_timing or out.timing))
                    self._trace(request, out, received_ns)
                yield EngineMessage.of(out, first)
                if finished:
                    break
        except (GeneratorExit, asyncio.CancelledError):
            request_metrics.on_end(None)  # the caller went away: counted as an abort (no-op if done)
            raise
        finally:
            self._active.discard(rid)
            if not finished:  # cancelled or closed early: free the slot before the next step
                self._engine.abort(rid)
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
            if not finished:
                self._trace(request, last, received_ns)

    def _trace(self, request: EngineRequest, last: StreamOutput | None, received_ns: int) -> None:
        if not self.tracing.enabled:
            return
        try:
            self.tracing.record_engine_request(request, last, self.replica_id, self._model_name, received_ns)
        except Exception:  # noqa: BLE001 - a span must never fail a request
            logger.exception("tracing request %s failed", request.request_id)

    async def link_address(self, request: EngineRequest) -> tuple[str, str]:
        """This replica's id and engine link address (deployments.link), for ``request``: what an
        ingress asks through Serve while its router knows no replica with a link; the request
        itself then goes over the link."""
        if self._link is None or self._start_link() is None:
            raise EngineDeadError("this replica serves no engine link")
        if not self._accepting:
            raise EngineDeadError("this replica is shutting down and takes no new requests")
        await asyncio.shield(self._link_started)  # listening before the ingress connects
        return self.replica_id, self._link.address

    def _start_link(self) -> asyncio.Task | None:
        if self._link is not None and self._link_started is None:
            try:
                self._link_started = asyncio.get_running_loop().create_task(self._link.start())
            except RuntimeError:  # built outside an event loop (tests): started by the first call
                pass
        return self._link_started

    def abort(self, request_id: str, index: int | None = None) -> bool:
        """Abort by server request id; the stream then ends with finish_reason "abort". ``index``:
        only that choice ends, the others go on. False: not running here."""
        if request_id not in self._active:
            return False
        self._engine.abort(request_id, index)
        return True

    def model_info(self) -> dict:
        config = self._engine.config
        return {"model": self._model, "model_path": str(self._engine.model_path),
                "max_model_len": self._engine.max_model_len, "vocab_size": self._engine.vocab_size,
                "block_size": config.cache.block_size, "max_num_seqs": config.scheduler.max_num_seqs,
                "quantization": self._engine.quantization,
                "pooling": pooling_of(self._engine.model_path), "hidden_size": self._engine.hidden_size,
                "replica_id": self.replica_id}

    def healthy(self) -> bool:
        try:
            self._engine.check_health()
        except Exception:
            return False
        return self._accepting

    def routing_stats(self) -> RoutingStats:
        """What routers rank by, and the ingress's admission and load reports read."""
        s = self._engine.stats()
        # Streams this replica has taken that the engine has not counted yet (still in its
        # inbox): without them a burst looks like an empty replica and piles onto it.
        arriving = max(0, len(self._active) - s.running - s.waiting)
        linked = self._link_started is not None
        return RoutingStats(
            free_slots=max(0, s.free_slots - arriving), running=s.running, waiting=s.waiting + arriving,
            max_num_seqs=s.max_num_seqs, max_waiting=self._engine.config.scheduler.max_waiting,
            kv_blocks_used=s.kv_blocks_used, kv_blocks_total=s.kv_blocks_total, block_size=s.block_size,
            prefix_hashes=list(self._engine.prefix_digest(PREFIX_DIGEST_ENTRIES)), healthy=self.healthy(),
            updated_at=time.time(), replica_id=self.replica_id,
            link=self._link.address if linked else None, link_requests=self._link.requests if linked else 0,
            lora_loaded=list(s.lora_loaded), lora_roots=dict(s.lora_roots), lora_paths=dict(s.lora_paths),
            lora_loads=s.lora_loads, lora_evictions=s.lora_evictions, kv_usage=s.kv_usage,
            slot_occupancy=s.slot_occupancy, num_finished=s.num_finished, prefix_cache_hits=s.prefix_cache_hits,
            prefix_cache_queries=s.prefix_cache_queries)

    def record_routing_stats(self) -> dict:
        """``routing_stats`` for Serve, which polls it for the routers (a plain dict on that path)."""
        return self.routing_stats().as_dict()

    async def manage_lora(self, request: dict) -> dict:
        """Load LoRA adapter ``lora_name`` from ``lora_path``, or unload it when the path is None (a
        handle call pinned to this replica by ``replica_id``)."""
        name, path = request["lora_name"], request.get("lora_path")
        if path is None:
            await self._engine.unload_lora(name)
            self._unloaded_adapters.add(name)
            return {"lora_name": name}
        info = await self._engine.load_lora(name, path)
        self._unloaded_adapters.discard(name)
        return {"lora_name": name, "rank": info.rank}

    def record_autoscaling_stats(self) -> dict[str, float]:
        # Every value must be a number: anything else silently disables custom metrics.
        s = self._engine.stats()
        return {"slot_occupancy": float(s.slot_occupancy), "waiting": float(s.waiting),
                "max_num_seqs": float(s.max_num_seqs)}

    def check_health(self) -> None:
        self._engine.check_health()

    def publish_metrics(self) -> None:
        """Gauges and counter deltas from the engine's stats snapshot, and its per-step token counts."""
        stats = self._engine.stats()
        self._metrics.record_stats(stats, self._engine.drain_step_tokens())
        if self._gpus is not None:
            self._gpus.record(self._metrics.recorder, stats.weights_bytes + stats.kv_cache_bytes)

    def _start_metrics_loop(self) -> None:
        if self._metrics_task is not None or not self._metrics.enabled or self._shutdown_done:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # built outside an event loop: start with the first request
            return
        self._metrics_task = loop.create_task(self._metrics_loop())

    async def _metrics_loop(self) -> None:
        while True:
            try:
                self.publish_metrics()
            except Exception:  # noqa: BLE001 - metrics must never take the replica down
                if not self._metrics_failed:
                    logger.exception("recording metrics failed (logged once)")
                self._metrics_failed = True
            await asyncio.sleep(METRICS_PERIOD_S)

    def stats(self) -> dict:
        return {**self._engine.stats().as_dict(), "replica_id": self.replica_id, "healthy": self.healthy()}

    async def shutdown(self) -> None:
        """Stop taking requests, let running ones finish (up to drain_timeout_s), stop the engine."""
        if self._shutdown_done:
            return
        self._shutdown_done = True
        self._accepting = False
        if self._metrics_task is not None:
            self._metrics_task.cancel()
        started = time.monotonic()
        serve_log.info("shutting down: draining %d running requests (up to %.0f s)", len(self._active),
                       self._drain_timeout_s)
        deadline = started + self._drain_timeout_s
        while self._active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._active:
            logger.warning("drain timeout (%.1f s): aborting %d running requests", self._drain_timeout_s,
                           len(self._active))
            # Hand them back with finish_reason "abort" while the loop still runs: a stopped
            # engine would leave their streams waiting forever.
            for rid in list(self._active):
                self._engine.abort(rid)
            deadline = time.monotonic() + ABORT_GRACE_S
            while self._active and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        if self._link is not None:
            await self._link.close()
        self._engine.shutdown()
        if self._own_tracing:
            self.tracing.shutdown()
        if self._gpus is not None:
            self._gpus.close()
        serve_log.info("shut down in %.1f s", time.monotonic() - started)


class ServeEngineReplica(EngineReplica):
    """What Serve deploys: Serve awaits an async ``__del__`` on graceful shutdown; an engine link
    listens on this node's address (the one Ray's own ports use)."""

    def __init__(self, *args: Any, link_token: str | None = None, **kwargs: Any) -> None:
        show_engine_log()
        if link_token:
            import ray
            kwargs["link_host"] = ray.util.get_node_ip_address()
        super().__init__(*args, link_token=link_token, **kwargs)

    async def __del__(self) -> None:
        await self.shutdown()
