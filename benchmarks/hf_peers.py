"""HF transformers as peers: padded static ``generate`` and its own paged continuous batching.

Both are timed as generously as the engine: a token counts as delivered when it was
computed (a per-step streamer for ``generate``, per-token timestamps for the manager),
not when the call returns.
"""

from __future__ import annotations

import time
from typing import Callable

from benchmarks.metrics import RequestTrace, SystemRun
from benchmarks.systems import BenchSettings
from benchmarks.workloads import BenchRequest, warmup_requests

# How often the driver wakes to sample occupancy while waiting for the manager's results.
_POLL_S = 0.05


def _load_model(settings: BenchSettings):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, settings.dtype)
    model = AutoModelForCausalLM.from_pretrained(settings.model_dir, dtype=dtype, attn_implementation="sdpa")
    return model.to(settings.device).eval()


class _StepClock:
    """A ``generate`` streamer that only timestamps steps: the first put is the prompt, each later one a token."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def _generate_batch(model, batch: list[BenchRequest], pad_id: int) -> tuple[list[float], int]:
    """One padded static batch run to its longest requested output; returns step times and its length."""
    import torch

    longest = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), longest), dtype=torch.long)
    for row, r in enumerate(batch):
        ids[row, longest - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
        mask[row, longest - len(r.prompt_token_ids):] = 1
    new_tokens = max(r.output_len for r in batch)
    clock = _StepClock()
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                             do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             pad_token_id=pad_id, streamer=clock)
    produced = out.shape[1] - longest
    if produced != new_tokens or len(clock.times) != new_tokens:
        raise RuntimeError(f"HF generate produced {produced} tokens ({len(clock.times)} steps), "
                           f"asked for {new_tokens}")
    return clock.times, new_tokens


def run_hf_generate(requests: list[BenchRequest], settings: BenchSettings,
                    progress: Callable[[int], None]) -> SystemRun:
    model = _load_model(settings)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    _generate_batch(model, warmup_requests(model.config.vocab_size)[: settings.max_num_seqs], pad_id)

    traces = {r.request_id: RequestTrace(r.request_id, r.arrival_s, r.output_len, len(r.prompt_token_ids))
              for r in requests}
    pending = list(requests)
    occupancy: list[tuple[float, float]] = []
    computed = 0
    t0 = time.perf_counter()
    while pending:
        now = time.perf_counter() - t0
        if pending[0].arrival_s > now:
            occupancy.append((now, 0.0))
            time.sleep(pending[0].arrival_s - now)
            continue
        # Static batching: take what has arrived, up to the batch size, in arrival order.
        arrived = [r for r in pending if r.arrival_s <= now][: settings.max_num_seqs]
        pending = pending[len(arrived):]
        start = time.perf_counter() - t0
        step_times, new_tokens = _generate_batch(model, arrived, pad_id)
        step_times = [t - t0 for t in step_times]
        computed += new_tokens * len(arrived)
        for r in arrived:
            for t in step_times[: r.output_len]:
                traces[r.request_id].add(t, 1)
        # Slots still producing wanted tokens; the rest of the batch is padding work.
        for j, t in enumerate([start] + step_times[:-1]):
            occupancy.append((t, sum(r.output_len > j for r in arrived) / settings.max_num_seqs))
        progress(len(arrived))
    makespan = time.perf_counter() - t0
    return SystemRun(list(traces.values()), makespan, computed, occupancy,
                     notes={"occupancy": "slots of a running batch still producing wanted tokens",
                            "computed_tokens": "every row of a batch runs to the batch's longest output"})


def _cb_config(settings: BenchSettings):
    """The same page size, pool and batch limits as the engine. On CUDA, transformers' own choices
    for CUDA graphs and async batching (its best settings there); on CPU both off."""
    import importlib.util
    import inspect

    from transformers import ContinuousBatchingConfig

    gpu = settings.device.startswith("cuda")
    wanted = dict(
        page_size=settings.block_size, num_blocks=settings.num_kv_blocks,
        max_batch_tokens=settings.max_num_batched_tokens, max_requests_per_batch=settings.max_num_seqs,
        allow_block_sharing=settings.enable_prefix_caching, use_cuda_graph=None if gpu else False,
        use_async_batching=None if gpu else False,
        auto_switch_to_flash=gpu and importlib.util.find_spec("flash_attn") is not None, seed=0)
    # Older transformers lack some fields (5.17: no page_size): pass what this version takes.
    accepted = inspect.signature(ContinuousBatchingConfig).parameters
    return ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in accepted})


def _active_requests(manager) -> int | None:
    # Internal state, read only for the occupancy curve; absent in other versions is fine.
    scheduler = getattr(getattr(manager, "batch_processor", None), "scheduler", None)
    active = getattr(scheduler, "active_requests", None)
    return len(active) if active is not None else None


def _drain_warmup(manager, vocab_size: int) -> None:
    ids = [manager.add_request(list(r.prompt_token_ids), request_id=r.request_id, max_new_tokens=r.output_len,
                               eos_token_id=-1) for r in warmup_requests(vocab_size)]
    remaining = set(ids)
    deadline = time.monotonic() + 600
    while remaining and time.monotonic() < deadline:
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            remaining.discard(result.request_id)
    if remaining:
        raise RuntimeError("HF continuous batching did not finish its warm-up requests")


def run_hf_generate_batch(requests: list[BenchRequest], settings: BenchSettings,
                          progress: Callable[[int], None]) -> SystemRun:
    from transformers import GenerationConfig

    model = _load_model(settings)
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max(r.output_len for r in requests),
                                  eos_token_id=-1, pad_token_id=model.config.pad_token_id or 0)
    manager = model.init_continuous_batching(generation_config=gen_config,
                                             continuous_batching_config=_cb_config(settings))
    manager.start()
    try:
        _drain_warmup(manager, model.config.vocab_size)
        return _drive_manager(manager, requests, settings, progress)
    finally:
        manager.stop(block=True, timeout=30)


def _drive_manager(manager, requests: list[BenchRequest], settings: BenchSettings,
                   progress: Callable[[int], None]) -> SystemRun:
    by_id = {r.request_id: r for r in requests}
    traces: dict[str, RequestTrace] = {}
    pending = list(requests)
    occupancy: list[tuple[float, float]] = []
    t0 = time.perf_counter()
    while len(traces) < len(requests):
        now = time.perf_counter() - t0
        while pending and pending[0].arrival_s <= now:
            r = pending.pop(0)
            manager.add_request(list(r.prompt_token_ids), request_id=r.request_id, max_new_tokens=r.output_len,
                                eos_token_id=-1, record_timestamps=True)
        active = _active_requests(manager)
        if active is not None:
            occupancy.append((now, active / settings.max_num_seqs))
        wait = _POLL_S if not pending else max(min(_POLL_S, pending[0].arrival_s - now), 0.0)
        result = manager.get_result(timeout=wait)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("HF continuous batching stopped before finishing the workload")
            continue
        if not result.is_finished() or result.request_id not in by_id:
            continue
        if result.error is not None:
            raise RuntimeError(f"HF continuous batching failed request {result.request_id}: {result.error}")
        r = by_id[result.request_id]
        trace = RequestTrace(r.request_id, r.arrival_s, r.output_len, len(r.prompt_token_ids))
        for stamp in result.timestamps or []:
            trace.add(stamp - t0, 1)
        traces[r.request_id] = trace
        progress(1)
    makespan = max(t.messages[-1][0] for t in traces.values() if t.messages)
    computed = sum(t.output_tokens for t in traces.values())
    return SystemRun([traces[r.request_id] for r in requests], makespan, computed, occupancy,
                     notes={"occupancy": "active requests of HF's scheduler, sampled every "
                                         f"{_POLL_S * 1000:.0f} ms",
                            "preemptions": "not exposed by transformers"})
