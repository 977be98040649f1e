"""Prometheus metrics of the serving system, through Ray Serve's metrics API.

Names follow vLLM's (``vllm:num_requests_running`` -> ``slotserve_num_requests_running``), so
dashboards and alerts carry over. Ray 2.60 warns that ':' in a metric name "is no longer
allowed" (a future error), so the prefix is ``slotserve_``; Ray's exporter then prepends
``ray_`` and counters gain ``_total``: ``ray_slotserve_prompt_tokens_total``. Every series
carries ``model_name`` (the served name) and, recorded in a Serve replica, Ray's
``application`` / ``deployment`` / ``replica`` tags. docs/OBSERVABILITY.md has the catalogue.

Recording never touches the engine's step loop: the replica reads the engine's stats
snapshot on a periodic task (gauges, counter deltas, per-step token counts) and records a
request's latencies once, when its stream ends (``RequestMetrics``). Outside a Ray worker
(tests, offline use) ``recorder_for`` returns a no-op.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Mapping, Protocol

from deployments.errors import to_serving_error
from engine.outputs import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, EngineStats, RequestTiming, StreamOutput
from router.autoscale import AUTOSCALER_METRICS
from router.policy import ROUTING_DECISIONS_METRIC

PREFIX = "slotserve_"
EXPORT_PREFIX = "ray_"  # added by Ray's Prometheus exporter
MODEL_TAG = "model_name"

# vLLM's buckets (vllm/v1/metrics/loggers.py), with a finer low end where fast GPUs land.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                           30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
GPU_TAGS = ("UUID", "gpu")  # as DCGM exporter labels its series


@dataclass(frozen=True)
class MetricDef:
    kind: str  # "counter" | "gauge" | "histogram"
    description: str
    tags: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    gpu_only: bool = False
    """Recorded only by replicas that run on a GPU NVML can see (deployments.nvml)."""
    lora_only: bool = False
    """Recorded only by replicas that serve LoRA adapters (engine option ``lora``)."""
    tenant_only: bool = False
    """Recorded only by ingresses of an app with ``tenants`` (deployments.admission)."""


METRICS: dict[str, MetricDef] = {
    # engine replica: gauges from the stats snapshot
    "num_requests_running": MetricDef("gauge", "Requests holding a slot in the engine."),
    "num_requests_waiting": MetricDef("gauge", "Requests queued in the engine, waiting for a slot."),
    "kv_cache_usage_perc": MetricDef("gauge", "Share of KV-cache blocks in use (1 = full)."),
    "slot_occupancy": MetricDef("gauge", "running / max_num_seqs, or KV usage when higher: the autoscaling signal."),
    "num_slots": MetricDef("gauge", "Slots of the replica (max_num_seqs)."),
    # engine replica: counters (cumulative engine counters, exported as deltas)
    "num_preemptions": MetricDef("counter", "Requests preempted for lack of KV blocks (always recomputed)."),
    "generation_tokens": MetricDef("counter", "Tokens generated (sampled)."),
    "prefix_cache_queries": MetricDef("counter", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": MetricDef("counter", "Prompt tokens found in the prefix cache."),
    "spec_decode_num_drafts": MetricDef("counter", "Speculative drafts verified."),
    "spec_decode_num_draft_tokens": MetricDef("counter", "Speculative draft tokens verified."),
    "spec_decode_num_accepted_tokens": MetricDef("counter", "Speculative draft tokens accepted."),
    "spec_decode_num_accepted_tokens_per_pos": MetricDef("counter", "Draft tokens accepted, per draft position "
                                                         "(0: a draft's first token).", tags=("position",)),
    "iteration_tokens_total": MetricDef("histogram", "Tokens computed per engine step.",
                                        buckets=ITERATION_TOKEN_BUCKETS),
    # engine replica with LoRA adapters (docs/LORA.md)
    "lora_requests_info": MetricDef("gauge", "vLLM's LoRA info series: the time, labelled with max_lora and the "
                                    "adapters running and waiting (comma-separated).",
                                    tags=("max_lora", "running_lora_adapters", "waiting_lora_adapters"),
                                    lora_only=True),
    "lora_requests_running": MetricDef("gauge", "Running requests per LoRA adapter.", tags=("lora_name",),
                                       lora_only=True),
    "lora_requests_waiting": MetricDef("gauge", "Requests waiting for a slot, per LoRA adapter.", tags=("lora_name",),
                                       lora_only=True),
    "lora_loads": MetricDef("counter", "LoRA adapters put in a device slot (from host memory or disk)."),
    "lora_evictions": MetricDef("counter", "Idle LoRA adapters taken out of a slot to make room for another."),
    # engine replica: per request, when its stream ends
    "prompt_tokens": MetricDef("counter", "Prompt tokens of requests that got their first token."),
    "request_success": MetricDef("counter", "Finished requests, by finish reason (stop, length, abort).",
                                 tags=("finished_reason",)),
    "time_to_first_token_seconds": MetricDef("histogram", "Engine arrival to first token.", buckets=TTFT_BUCKETS),
    "inter_token_latency_seconds": MetricDef("histogram", "Time between tokens as the replica streams them.",
                                             buckets=ITL_BUCKETS),
    "e2e_request_latency_seconds": MetricDef("histogram", "Engine arrival to last token.",
                                             buckets=REQUEST_LATENCY_BUCKETS),
    "request_queue_time_seconds": MetricDef("histogram", "Engine arrival to first scheduled.",
                                            buckets=REQUEST_LATENCY_BUCKETS),
    "request_prefill_time_seconds": MetricDef("histogram", "First scheduled to first token.",
                                              buckets=REQUEST_LATENCY_BUCKETS),
    "request_decode_time_seconds": MetricDef("histogram", "First token to last token.",
                                             buckets=REQUEST_LATENCY_BUCKETS),
    # engine replica on a GPU (deployments.nvml): DCGM's label names, to join with its series
    "gpu_info": MetricDef("gauge", "1 per GPU the replica runs on, labelled with its UUID, index and node.",
                          tags=GPU_TAGS + ("pci_bus_id", "modelName", "node"), gpu_only=True),
    "gpu_memory_used_bytes": MetricDef("gauge", "GPU memory the replica's process holds (NVML).", tags=GPU_TAGS,
                                       gpu_only=True),
    "gpu_memory_budget_bytes": MetricDef("gauge", "GPU memory the engine planned for: weights + KV pool.",
                                         tags=GPU_TAGS, gpu_only=True),
    # ingress
    "model_weights_bytes": MetricDef("gauge", "Bytes of model weights the replica holds (quantized blocks and "
                                     "their scales included), labelled with their dtype and quantization.",
                                     tags=("dtype", "quantization")),
    "requests_rejected": MetricDef("counter", "Generation requests answered with an error, by reason.",
                                   tags=("reason",)),
    # ingress of an app with tenants (deployments.admission)
    "tenant_requests": MetricDef("counter", "Requests of each tenant: admitted, refused by its limits "
                                 "(outcome: concurrency, waiting, tokens), or refused by the ingress's share of the "
                                 "engines' capacity, or its fair share of a contended ingress, before its limits "
                                 "were checked (overloaded).", tags=("tenant", "outcome"),
                                 tenant_only=True),
    "tenant_tokens": MetricDef("counter", "Prompt and output tokens of each tenant's requests (kind: prompt, "
                               "output).", tags=("tenant", "kind"), tenant_only=True),
    "tenant_requests_in_flight": MetricDef("gauge", "Requests of each tenant in flight at the ingress.",
                                           tags=("tenant",), tenant_only=True),
    # Latencies of a tenant's requests: TTFT buckets for both (queue time is a share of TTFT).
    "tenant_time_to_first_token_seconds": MetricDef(
        "histogram", "Time to first token as each tenant's client sees it: from the ingress starting to prepare the "
        "request (after reading its body and key; before tokenizing and routing) to the first non-empty text "
        "streamed back. Replica retries and resumes included.", tags=("tenant",), buckets=TTFT_BUCKETS,
        tenant_only=True),
    "tenant_queue_time_seconds": MetricDef(
        "histogram", "Each tenant's requests' wait in the engine's queue: engine arrival to first scheduled, as the "
        "engine replica measured it and sent it with the request's first tokens (once per request: one retried or "
        "resumed elsewhere counts the first replica that sent tokens).", tags=("tenant",), buckets=TTFT_BUCKETS,
        tenant_only=True),
}
# Recorded in router/ (which must not import deployments/): listed here for the catalogue.
OTHER_METRICS: dict[str, str] = {ROUTING_DECISIONS_METRIC: "counter", **AUTOSCALER_METRICS}  # full name -> kind


def exported_names(gpu: bool = True, lora: bool = True, tenants: bool = True) -> set[str]:
    """Every series name a Prometheus scrape shows for our metrics (counters' ``_total``,
    histograms' ``_bucket`` / ``_sum`` / ``_count``); ``gpu=False``: those of a CPU-only app;
    ``lora=False``: of an app without LoRA adapters; ``tenants=False``: of an app without tenants."""
    kinds = {PREFIX + name: d.kind for name, d in METRICS.items()
             if (gpu or not d.gpu_only) and (lora or not d.lora_only) and (tenants or not d.tenant_only)} | OTHER_METRICS
    names = set()
    for full, kind in kinds.items():
        base = EXPORT_PREFIX + full
        if kind == "counter":
            names.add(base + "_total")
        elif kind == "histogram":
            names.update(base + suffix for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(base)
    return names


class Recorder(Protocol):
    enabled: bool

    def record(self, name: str, value: float, tags: Mapping[str, str] | None = None) -> None:
        """Counter: add ``value``; gauge: set it; histogram: observe it. ``name`` is a METRICS key."""

    def start_at_zero(self, name: str, tags: Mapping[str, str] | None = None) -> None:
        """Export counter ``name`` (with ``tags``) at 0 before its first event, as vLLM's are:
        ``increase()`` and ``rate()`` see the first event only against an earlier sample."""


class NullRecorder:
    enabled = False

    def record(self, name: str, value: float, tags: Mapping[str, str] | None = None) -> None:
        pass

    def start_at_zero(self, name: str, tags: Mapping[str, str] | None = None) -> None:
        pass


class RayRecorder:
    """``ray.serve.metrics`` objects, made on first use, all tagged with the model name."""

    enabled = True

    def __init__(self, model_name: str) -> None:
        from ray.serve import metrics

        self._api = metrics
        self._model_name = model_name
        self._metrics: dict[str, object] = {}

    def _metric(self, name: str):
        metric = self._metrics.get(name)
        if metric is None:
            d = METRICS[name]
            tag_keys = (MODEL_TAG, *d.tags)
            if d.kind == "histogram":
                metric = self._api.Histogram(PREFIX + name, d.description, boundaries=list(d.buckets),
                                             tag_keys=tag_keys)
            else:
                metric = (self._api.Counter if d.kind == "counter" else self._api.Gauge)(
                    PREFIX + name, d.description, tag_keys=tag_keys)
            metric.set_default_tags({MODEL_TAG: self._model_name})
            self._metrics[name] = metric
        return metric

    def record(self, name: str, value: float, tags: Mapping[str, str] | None = None) -> None:
        metric = self._metric(name)
        kind = METRICS[name].kind
        tags = dict(tags) if tags else None
        if kind == "counter":
            if value > 0:  # Ray refuses inc(0)
                metric.inc(value, tags)
        elif kind == "gauge":
            metric.set(value, tags)
        else:
            metric.observe(value, tags)

    def start_at_zero(self, name: str, tags: Mapping[str, str] | None = None) -> None:
        # Counter.inc refuses 0 and Ray has no call that makes a series before its first event;
        # _record is what inc calls once its check passed.
        self._metric(name)._record(0, dict(tags) if tags else None)


def recorder_for(model_name: str) -> Recorder:
    """Ray metrics inside a Ray worker (a Serve replica, the proxy); a no-op anywhere else."""
    ray = sys.modules.get("ray")  # not imported: surely not in a Ray worker (and no import cost)
    if ray is not None and ray.is_initialized():
        return RayRecorder(model_name)
    return NullRecorder()


# -------------------------------------------------------------------- engine replica

_STATS_COUNTERS = {"num_preemptions": "num_preemptions", "generation_tokens": "num_generated_tokens",
                   "prefix_cache_queries": "prefix_cache_queries", "prefix_cache_hits": "prefix_cache_hits",
                   "lora_loads": "lora_loads", "lora_evictions": "lora_evictions",
                   "spec_decode_num_drafts": "spec_decode_num_drafts",
                   "spec_decode_num_draft_tokens": "spec_decode_num_draft_tokens",
                   "spec_decode_num_accepted_tokens": "spec_decode_num_accepted_tokens"}


FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH, FINISH_ABORT)


class EngineMetrics:
    """What one engine replica records: its engine's stats, and each request when it ends."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self._exported: dict[str, int] = {}  # cumulative engine counters already exported
        self._adapters_seen: set[str] = set()  # their gauges go back to 0 when they stop running
        for name in (*_STATS_COUNTERS, "prompt_tokens"):
            recorder.start_at_zero(name)
        for reason in FINISH_REASONS:
            recorder.start_at_zero("request_success", {"finished_reason": reason})
        recorder.start_at_zero("spec_decode_num_accepted_tokens_per_pos", {"position": "0"})

    @property
    def enabled(self) -> bool:
        return self.recorder.enabled

    def record_stats(self, s: EngineStats, step_tokens: list[int]) -> None:
        rec = self.recorder.record
        rec("num_requests_running", s.running)
        rec("num_requests_waiting", s.waiting)
        rec("kv_cache_usage_perc", s.kv_usage)
        rec("slot_occupancy", s.slot_occupancy)
        rec("num_slots", s.max_num_seqs)
        rec("model_weights_bytes", s.weights_bytes, dict(zip(("dtype", "quantization"), s.weights_format)))
        for name, field in _STATS_COUNTERS.items():
            total = getattr(s, field)
            delta = total - self._exported.get(name, 0)
            self._exported[name] = total
            if delta > 0:  # < 0: a new engine started from zero; the baseline just moved
                rec(name, delta)
        for pos, total in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
            key = f"spec_decode_num_accepted_tokens_per_pos/{pos}"
            delta = total - self._exported.get(key, 0)
            self._exported[key] = total
            if delta > 0:
                rec("spec_decode_num_accepted_tokens_per_pos", delta, {"position": str(pos)})
        for n in step_tokens:
            rec("iteration_tokens_total", n)
        if s.max_loras:
            self._record_lora(s)

    def _record_lora(self, s: EngineStats) -> None:
        rec = self.recorder.record
        rec("lora_requests_info", time.time(), {"max_lora": str(s.max_loras),
                                                "running_lora_adapters": ",".join(sorted(s.lora_running)),
                                                "waiting_lora_adapters": ",".join(sorted(s.lora_waiting))})
        self._adapters_seen |= s.lora_running.keys() | s.lora_waiting.keys()
        for name in self._adapters_seen:
            rec("lora_requests_running", s.lora_running.get(name, 0), {"lora_name": name})
            rec("lora_requests_waiting", s.lora_waiting.get(name, 0), {"lora_name": name})

    def request(self) -> "RequestMetrics":
        return RequestMetrics(self.recorder)


class RequestMetrics:
    """One request's stream through the replica: prompt tokens at its first token, the gaps
    between tokens as streamed, latencies from the engine's RequestTiming at the end."""

    __slots__ = ("_rec", "_last", "_gaps", "_ended")
    FLUSH_GAPS = 256  # bounds memory and the burst of observes for long generations

    def __init__(self, recorder: Recorder) -> None:
        self._rec = recorder
        self._last: float | None = None
        self._gaps: list[tuple[float, int]] = []  # (seconds per token, tokens)
        self._ended = False

    def on_message(self, out: StreamOutput, now: float | None = None) -> None:
        n = len(out.new_token_ids)
        if not n:
            return
        now = time.monotonic() if now is None else now
        if self._last is None:
            self._rec.record("prompt_tokens", out.num_prompt_tokens)
        else:  # coalesced tokens share the gap: the per-token latencies still add up to it
            self._gaps.append(((now - self._last) / n, n))
            if len(self._gaps) >= self.FLUSH_GAPS:
                self._flush_gaps()
        self._last = now

    def on_end(self, out: StreamOutput | None) -> None:
        """``out``: the last message; None when the stream was closed early (client gone)."""
        if self._ended:
            return
        self._ended = True
        self._flush_gaps()
        reason = out.finish_reason if out is not None and out.finished else FINISH_ABORT
        self._rec.record("request_success", 1, {"finished_reason": reason})
        timing = out.timing if out is not None else None
        if reason in (FINISH_STOP, FINISH_LENGTH) and timing is not None:
            self._record_timing(timing)

    def _flush_gaps(self) -> None:
        for gap, n in self._gaps:
            for _ in range(n):
                self._rec.record("inter_token_latency_seconds", gap)
        self._gaps.clear()

    def _record_timing(self, t: RequestTiming) -> None:
        spans = {"time_to_first_token_seconds": (t.arrival_time, t.first_token_time),
                 "e2e_request_latency_seconds": (t.arrival_time, t.finished_time),
                 "request_queue_time_seconds": (t.arrival_time, t.first_scheduled_time),
                 "request_prefill_time_seconds": (t.first_scheduled_time, t.first_token_time),
                 "request_decode_time_seconds": (t.first_token_time, t.finished_time)}
        for name, (start, end) in spans.items():
            if start is not None and end is not None:
                self._rec.record(name, max(end - start, 0.0))


# -------------------------------------------------------------------- ingress

REJECTION_REASONS = ("invalid", "unauthenticated", "overloaded", "tenant_limit", "unavailable", "deadline",
                     "internal")
"""Every ``ServingError.metric_reason`` (tests/test_metrics.py keeps the two in step)."""


class IngressMetrics:
    """Rejections, recorded where errors are mapped to status codes (gRPC and OpenAI)."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        for reason in REJECTION_REASONS:
            recorder.start_at_zero("requests_rejected", {"reason": reason})

    def rejected(self, exc: BaseException) -> None:
        """Count a generation request that ends in ``exc``, by its ServingError's ``metric_reason``
        (overloaded, invalid, unauthenticated, deadline, unavailable, internal; None: not counted)."""
        reason = to_serving_error(exc).metric_reason
        if reason is not None:
            self.recorder.record("requests_rejected", 1, {"reason": reason})
