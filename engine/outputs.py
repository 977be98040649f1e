"""What the engine hands to its callers.

``StreamOutput`` is the serving contract: one per request per step, carrying every
token produced since the previous message (streams are coalesced, never one message
per token). ``RequestOutput`` is the offline result, shaped like vLLM's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

FINISH_STOP = "stop"      # EOS, a stop token id or a stop string
FINISH_LENGTH = "length"  # max_tokens or the context length
FINISH_ABORT = "abort"    # aborted by the caller (cancel, disconnect, deadline)
PREEMPT_KV_FULL = "kv_cache_full"  # the KV pool ran dry: the victim's blocks go to others, it is recomputed later
PREEMPT_FAIR_SHARE = "fair_share"  # its tenant held more than its share of the slots, another's request less

# The scheduling audit trail: each event's details, in the order the engine records them.
AUDIT_DETAILS: dict[str, tuple[str, ...]] = {
    "queued": ("waiting", "running"),        # requests already waiting / running when it arrived
    "scheduled": ("cached_tokens",),         # first admission; prompt tokens found in the prefix cache
    "prefill_chunk": ("start", "tokens", "cached_tokens"),  # cached_tokens: on an admission's first chunk
    "preempted": ("reason", "tokens"),       # tokens: computed tokens dropped, to be recomputed
    "resumed": ("cached_tokens",),           # readmitted after a preemption
    "first_token": (),
    "speculated": ("drafts", "draft_tokens", "accepted_tokens"),  # at the end, if it drafted (engine.spec_decode)
    "finished": ("reason", "tokens"),        # tokens: output tokens
}
MAX_AUDIT_EVENTS = 256
"""Per request; beyond it only ``finished`` is still recorded (a preemption storm must not grow memory)."""


@dataclass(slots=True)
class RequestTiming:
    """Wall-clock times (time.monotonic seconds) of one request's life in the engine."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_drafts: int = 0
    """Speculative decoding (engine.spec_decode): drafts verified, their tokens, and those accepted."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    events: list[tuple] = field(default_factory=list)
    """The audit trail: ``(time, event, *details)`` tuples (details named by AUDIT_DETAILS), appended
    by the engine as things happen; nothing is formatted in the step loop (see ``audit_records``)."""

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


def audit_records(timing: RequestTiming) -> list[dict]:
    """The audit trail as plain dicts: ``time_s`` (seconds since the request reached the engine),
    ``event`` and its details by name. Built once, when the request ends."""
    t0 = timing.arrival_time
    return [{"time_s": t - t0, "event": event, **dict(zip(AUDIT_DETAILS[event], details))}
            for t, event, *details in list(timing.events)]


@dataclass(slots=True)
class StreamOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    """This choice ended (the request has ended when no choice runs: ``request_finished``)."""
    finish_reason: str | None = None
    stop_token_id: int | None = None
    """The token id that ended the request, when it ended on EOS / a stop token id."""
    new_logprobs: list[dict[int, float]] | None = None
    """Per new token: {token_id: logprob} with the sampled token and the top-n alternatives."""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    timing: RequestTiming | None = None
    index: int = 0
    """Which of the request's ``n`` choices this is."""
    choices_running: int = 0
    """The request's choices still running after this output (this one, if it goes on)."""
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """On choice 0's first output, when asked: per prompt token, {token id: logprob} of it and its
    alternatives (None for the first token, which nothing predicts)."""
    embedding: list[float] | None = None
    """A pooling request's (``SamplingParams.pooling``) only output: its prompt's embedding."""

    @property
    def request_finished(self) -> bool:
        return self.finished and self.choices_running == 0


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    timing: RequestTiming | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """With ``SamplingParams.prompt_logprobs``: per prompt token (None for the first)."""
    embedding: list[float] | None = None
    """With ``SamplingParams.pooling``: the prompt's embedding (``LLM.embed``)."""


@dataclass(slots=True)
class EngineStats:
    """A snapshot of the engine's load, read by routing, autoscaling and metrics."""

    running: int = 0
    waiting: int = 0
    max_num_seqs: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    block_size: int = 0
    kv_tokens: int = 0
    """Tokens whose KV the running requests hold (shared prefix blocks counted per holder)."""
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache."""
    prefix_cache_hits: int = 0
    """Prompt tokens found there."""
    num_preemptions: int = 0
    spec_decode_num_drafts: int = 0
    """Speculative decoding (vLLM's names): drafts verified, draft tokens, and those accepted."""
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple = ()
    """Per draft position: drafts whose token there was accepted."""
    num_steps: int = 0
    num_generated_tokens: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    last_step_time: float = 0.0
    """time.monotonic() when the loop last finished a step (or idled)."""
    weights_bytes: int = 0
    """Model weights this engine (rank 0 with tensor parallelism) holds on its device."""
    weights_format: tuple = ("", "")
    """(dtype, quantization or "none") of those weights: ("float32", "gguf") serves GGUF blocks with
    float32 activations."""
    kv_cache_bytes: int = 0
    """The KV pool it allocated: with the weights, the memory budget it planned for."""
    step_time_s: dict = field(default_factory=dict)
    """Cumulative seconds per step phase (schedule, prepare, forward, sample, output) when profiling."""
    lora_loaded: tuple = ()
    """LoRA adapters in device slots, by name: what adapter-affine routing looks for."""
    lora_running: dict = field(default_factory=dict)
    """Adapter -> running requests (choices) using it."""
    lora_waiting: dict = field(default_factory=dict)
    """Adapter -> requests (choices) waiting for a slot."""
    lora_roots: dict = field(default_factory=dict)
    """Adapter -> its prefix-cache root digest (``AdapterInfo.root_hash``), for the router's prefix keys."""
    lora_paths: dict = field(default_factory=dict)
    """Adapter -> its directory: where a replica that lacks it loads it from."""
    max_loras: int = 0
    lora_loads: int = 0
    """Adapters put in a device slot (from host memory or disk)."""
    lora_evictions: int = 0
    """Idle adapters taken out of a slot to make room for another."""

    @property
    def free_slots(self) -> int:
        return max(self.max_num_seqs - self.running, 0)

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def kv_fragmentation(self) -> float:
        """Share of referenced KV slots holding no token: only partial last blocks waste space."""
        slots = self.kv_blocks_used * self.block_size
        return max(0.0, 1.0 - self.kv_tokens / slots) if slots else 0.0

    @property
    def slot_occupancy(self) -> float:
        """running / max_num_seqs, or KV usage when higher: the autoscaling signal."""
        slots = self.running / self.max_num_seqs if self.max_num_seqs else 0.0
        return max(slots, self.kv_usage)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(free_slots=self.free_slots, kv_usage=self.kv_usage, slot_occupancy=self.slot_occupancy,
                 kv_fragmentation=self.kv_fragmentation)
        return d
