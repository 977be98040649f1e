"""slotserve through the served application: a local Ray, Serve's gRPC proxy, the Router
ingress and one engine replica, driven by real gRPC streaming clients.

The engine replica gets the same options as the in-process ``continuous`` system (slots,
token budget, block size, KV blocks, dtype, torch threads), so the difference between the
two is the serving path alone: gRPC, the proxy, the ingress and two Ray streaming hops.

After the timed run, the added-TTFT probe (``served_client``) goes three ways: through
gRPC, straight to the engine replica with a Serve handle (one hop, same engine process),
and, with Ray shut down, to an in-process ``AsyncEngine`` in a fresh process.

Peak RSS: Ray runs a dozen processes besides this client (GCS, raylet, Serve's
controller and proxy, the ingress and engine replicas). ``notes.peak_rss_tree_bytes`` is
the largest sum of RSS over this process and all of its descendants, sampled every
0.5 s; shared pages count once per process, so it overstates a little.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from benchmarks.metrics import SystemRun
from benchmarks.served_client import added_ttft, engine_probe_ttft, run_streams, served_probe_ttft
from benchmarks.systems import BenchSettings
from benchmarks.workloads import BenchRequest, warmup_requests
from deployments.ingress_env import free_port, ingress_env

APP_NAME = "slotserve"
READY_TIMEOUT_S = 300.0
RSS_PERIOD_S = 0.5
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def engine_options(settings: BenchSettings) -> dict:
    """What ``engine_systems.make_engine`` gives the in-process engine, as flat engine options."""
    return {"max_num_seqs": settings.max_num_seqs,
            "max_num_batched_tokens": max(settings.max_num_batched_tokens, settings.max_num_seqs),
            "block_size": settings.block_size, "num_kv_blocks": settings.num_kv_blocks,
            "enable_prefix_caching": settings.enable_prefix_caching, "scheduling": "continuous",
            "dtype": settings.dtype, "device": settings.device, "max_model_len": settings.max_model_len,
            "kv_cache_dtype": settings.kv_cache_dtype, "num_threads": settings.threads}


def with_tokenizer(model_dir: str, scratch: Path) -> str:
    """The model directory, or a copy of it (symlinks) with a word-level tokenizer when it has none.

    The ingress turns token ids back into text, so it needs a tokenizer; the quick run's
    tiny random model is weights only. ``<tN>`` for every id N keeps that text work real.
    """
    src = Path(model_dir)
    if all((src / name).exists() for name in _TOKENIZER_FILES):
        return model_dir
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    dst = scratch / src.name
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if not (dst / item.name).exists():
            (dst / item.name).symlink_to(item.resolve())
    config = json.loads((src / "config.json").read_text())
    vocab_size = int(config.get("text_config", config)["vocab_size"])
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else (eos if isinstance(eos, int) else 0)
    tok = Tokenizer(models.WordLevel({f"<t{i}>": i for i in range(vocab_size)}, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<t0>", eos_token=f"<t{eos}>").save_pretrained(dst)
    return str(dst)


def process_label(cmdline: list[str]) -> str:
    """A process's kind: Ray titles its workers ``ray::Class`` (plus the running method, dropped)."""
    if cmdline and cmdline[0].startswith("ray::"):
        return cmdline[0].split(" ")[0].split(".")[0]
    return next((Path(a).name for a in cmdline[1:] if a.endswith(".py")),
                Path(cmdline[0]).name if cmdline else "?")


def per_process(read: Callable) -> dict[str, float]:
    """``read(process)`` summed per kind over this process and its descendants."""
    import psutil

    me = psutil.Process()
    totals: dict[str, float] = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            label, value = process_label(proc.cmdline()), read(proc)
        except psutil.Error:  # gone between listing and reading
            continue
        totals[label] = totals.get(label, 0) + value
    return totals


def cpu_seconds(proc) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def cpu_by_process(before: dict[str, float], after: dict[str, float], tokens: int) -> dict[str, dict]:
    """CPU each kind of process spent between two ``per_process(cpu_seconds)`` readings, per token."""
    spent = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return {k: {"cpu_s": round(v, 3), "cpu_us_per_token": round(1e6 * v / max(tokens, 1), 1)}
            for k, v in sorted(spent.items(), key=lambda kv: -kv[1]) if v >= 0.005}


class TreeRss:
    """Largest summed RSS of this process and its descendants (Ray's processes), sampled.

    ``samples`` keeps every reading as (time.time(), bytes, processes): the timeline a soak
    compares its start and end on."""

    def __init__(self, period_s: float = RSS_PERIOD_S) -> None:
        self.peak_bytes: int | None = None
        self.processes_at_peak = 0
        self.samples: list[tuple[float, int, int]] = []
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-rss", daemon=True)

    def __enter__(self) -> "TreeRss":
        try:
            import psutil  # noqa: F401
        except ImportError:
            return self
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        import psutil

        me = psutil.Process()
        while True:
            total, count = me.memory_info().rss, 1
            for child in me.children(recursive=True):
                try:
                    total += child.memory_info().rss
                    count += 1
                except psutil.Error:  # gone between listing and reading
                    continue
            self.samples.append((time.time(), total, count))
            if self.peak_bytes is None or total > self.peak_bytes:
                self.peak_bytes, self.processes_at_peak = total, count
            if self._stop.wait(self._period_s):
                return


class ServedApp:
    """A local Ray with Serve (gRPC + HTTP on free ports) running build_app with one replica.

    ``ingress``: how the clients reach the ingress replica (deployments.ingress_env: Serve's
    proxy or HAProxy). Ray's environment is restored on exit."""

    def __init__(self, model_dir: str, settings: BenchSettings, *, ingress: str = "proxy") -> None:
        self.model_dir = model_dir
        self.settings = settings
        self.ingress = ingress
        self.grpc_port = self.http_port = 0
        self.startup_s = 0.0
        self._saved_env: dict[str, str | None] = {}

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def _set_env(self) -> None:
        """SERVE_ENV and the ingress mode's environment, for the processes Ray starts."""
        from deployments.app import SERVE_ENV

        env = {"RAY_AUTH_MODE": "disabled", **SERVE_ENV, **ingress_env(self.ingress, local=True)}
        self._saved_env = {key: os.environ.get(key) for key in env}
        os.environ.update(env)

    def _restore_env(self) -> None:
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    def app_args(self) -> dict:
        # One replica, no autoscaling: the replica owns as many CPUs as the engine has threads.
        return {"model": self.model_dir, "served_model_name": "bench", "engine": engine_options(self.settings),
                "num_replicas": 1, "replica_resources": {"num_cpus": self.settings.threads},
                "ingress": {"num_replicas": 1, "num_cpus": 0.5}, "drain_timeout_s": 5}

    def __enter__(self) -> "ServedApp":
        import ray
        from ray import serve
        from ray.serve.config import HTTPOptions, gRPCOptions

        from deployments.app import build_app
        from deployments.grpc_registration import SERVICER_FUNCTIONS

        start = time.perf_counter()
        self.http_port, self.grpc_port = free_port(), free_port()
        self._set_env()
        ray.init(num_cpus=self.settings.threads + 1, include_dashboard=False, log_to_driver=False)
        try:
            serve.start(http_options=HTTPOptions(host="127.0.0.1", port=self.http_port),
                        grpc_options=gRPCOptions(port=self.grpc_port, grpc_servicer_functions=list(SERVICER_FUNCTIONS)))
            serve.run(build_app(self.app_args()), name=APP_NAME, route_prefix="/")
            self._wait_ready()
        except BaseException:
            self.__exit__()
            raise
        self.startup_s = time.perf_counter() - start
        return self

    def _wait_ready(self) -> None:
        """Until the readiness probe (an engine replica reports healthy) answers SERVING."""
        import grpc

        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + READY_TIMEOUT_S
        last: object = "not serving yet"
        with grpc.insecure_channel(self.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service="slotserve.v1.SlotServe"), timeout=10)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                    last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                except grpc.RpcError as exc:
                    last = exc
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the served app was not ready within {READY_TIMEOUT_S:.0f} s ({last!r})")
                time.sleep(0.2)

    def engine_stats(self) -> dict:
        """The engine replica's cumulative stats (preemptions, prefix cache, steps, tokens)."""
        from ray import serve

        from deployments.ingress import ENGINE_DEPLOYMENT

        handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=APP_NAME)
        return handle.stats.remote().result(timeout_s=30)

    def serve_call_floor(self, calls: int = 20) -> dict:
        """For scale: a bare Serve streaming call (this process -> a do-nothing replica -> one item).

        Through Serve's proxy the served path makes one such hop (proxy -> ingress) plus gRPC;
        the ingress reaches the engine replica over an engine link.
        Deployed as a second application, so no gRPC call may follow (with two apps the
        proxy wants the app named in every call's metadata).
        """
        import numpy as np
        from ray import serve

        class Echo:
            async def stream(self):
                yield 0

        echo = serve.deployment(Echo, name="Echo", ray_actor_options={"num_cpus": 0}).bind()
        handle = serve.run(echo, name="serve-call-floor", route_prefix=None).options(stream=True)
        times = []
        for i in range(calls + 3):  # the first calls warm the handle's router
            start = time.perf_counter()
            list(handle.stream.remote())
            if i >= 3:
                times.append(time.perf_counter() - start)
        return {"p50": float(np.percentile(times, 50)), "p90": float(np.percentile(times, 90)), "calls": calls}

    def __exit__(self, *exc) -> None:
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            self._restore_env()


def _in_process_probe(options: dict, model_dir: str) -> list[float]:
    """The engine side of the added-TTFT probe, in a fresh process (Ray is down by then)."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(engine_probe_ttft, options, model_dir).result()


def _delta(after: dict, before: dict, key: str) -> int:
    return int(after.get(key, 0)) - int(before.get(key, 0))


def run_served(requests: list[BenchRequest], settings: BenchSettings,
               progress: Callable[[int], None]) -> SystemRun:
    return _run(requests, settings, progress, ingress="proxy")


def run_served_haproxy(requests: list[BenchRequest], settings: BenchSettings,
                       progress: Callable[[int], None]) -> SystemRun:
    return _run(requests, settings, progress, ingress="haproxy")


def _run(requests: list[BenchRequest], settings: BenchSettings, progress: Callable[[int], None], *,
         ingress: str) -> SystemRun:
    with tempfile.TemporaryDirectory(prefix="slotserve-served-") as scratch:
        model_dir = with_tokenizer(settings.model_dir, Path(scratch))
        with TreeRss() as rss, ServedApp(model_dir, settings, ingress=ingress) as app:
            vocab_size = _vocab_size(model_dir)
            run_streams(app.target, warmup_requests(vocab_size))
            before, cpu_before = app.engine_stats(), per_process(cpu_seconds)
            traces, makespan, occupancy = run_streams(app.target, requests, progress, sample_occupancy=True)
            cpu_after, after = per_process(cpu_seconds), app.engine_stats()
            served_ttft = served_probe_ttft(app.target, vocab_size)
            floor = app.serve_call_floor()
            startup_s = app.startup_s
        engine_ttft = _in_process_probe(engine_options(settings), model_dir)
    added = added_ttft(served_ttft, engine_ttft)
    return SystemRun(
        traces, makespan, _delta(after, before, "num_generated_tokens"), occupancy,
        preemptions=_delta(after, before, "num_preemptions"),
        prefix_cache_queries=_delta(after, before, "prefix_cache_queries"),
        prefix_cache_hits=_delta(after, before, "prefix_cache_hits"),
        notes={"steps": _delta(after, before, "num_steps"), "kv_blocks_total": after.get("kv_blocks_total"),
               "block_size": after.get("block_size"), "added_ttft_s": added,
               "serve_call_floor_s": floor,
               "cpu_by_process": cpu_by_process(cpu_before, cpu_after,
                                                _delta(after, before, "num_generated_tokens")),
               "peak_rss_tree_bytes": rss.peak_bytes, "processes_at_peak_rss": rss.processes_at_peak,
               "startup_s": startup_s, "ingress": ingress, "engine_link": True,
               "transport": "gRPC (grpc.aio client, one channel) -> " + _FRONT[ingress]
                            + "Router ingress -> engine link -> EngineReplica (1 replica)"})


_FRONT = {"proxy": "Serve proxy -> ", "haproxy": "HAProxy -> "}


def _vocab_size(model_dir: str) -> int:
    from benchmarks.models import model_vocab_size

    return model_vocab_size(model_dir)
