"""One request's state inside the engine.

    WAITING --admit--> RUNNING --finish--> FINISHED
       ^                  |
       +---- PREEMPTED <--+  (blocks freed; recomputed from its tokens when readmitted)
"""

from __future__ import annotations

import enum
import time

from engine.kv.hashing import ROOT_HASH
from engine.outputs import MAX_AUDIT_EVENTS, RequestTiming
from engine.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    __slots__ = (
        "request_id", "params", "priority", "seq_no", "token_ids", "num_prompt_tokens",
        "num_computed_tokens", "block_ids", "num_hashed_blocks", "last_block_hash",
        "num_cached_tokens", "status", "finish_reason", "stop_token_id", "timing",
        "max_total_tokens", "seed", "eos_token_ids", "matcher", "index", "held", "prompt_logprobs",
        "lora_name", "lora_slot", "root_hash", "sampling_row", "spec", "pooled", "tenant", "weight",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 priority: int, seq_no: int, max_total_tokens: int, seed: int,
                 eos_token_ids: frozenset[int], arrival_time: float | None = None, index: int = 0) -> None:
        self.request_id = request_id
        self.params = params
        self.priority = priority
        self.seq_no = seq_no
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.num_hashed_blocks = 0       # leading full blocks already registered in the prefix cache
        self.last_block_hash = ROOT_HASH  # digest of the last registered block: the next one's parent
        self.num_cached_tokens = 0       # prompt tokens served from the prefix cache at first admission
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_token_id: int | None = None
        self.timing = RequestTiming(arrival_time=time.monotonic() if arrival_time is None else arrival_time)
        self.max_total_tokens = max_total_tokens
        self.seed = seed
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.matcher = None
        """The grammar's state (``engine.structured``) when the request has ``structured_outputs``."""
        self.index = index
        """Which of the request's ``n`` choices this sequence is (its siblings share ``request_id``)."""
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if params.prompt_logprobs is not None and index == 0 else None)
        """Per prompt token so far, when asked: {token id: logprob} of it and its alternatives (the
        first token has none). Choice 0 computes them for all; its siblings use the prefix cache."""
        self.held: list[Request] = []
        """Siblings queued only once this one's prompt is in the prefix cache, so they share its blocks."""
        self.lora_name: str | None = None
        """The LoRA adapter it runs with (None: the base model)."""
        self.lora_slot = -1
        """The device slot holding that adapter while the request runs (engine.lora.manager)."""
        self.root_hash = ROOT_HASH
        """Parent of its first KV block's digest: the adapter's, so adapters never share cached KV."""
        self.sampling_row: tuple | None = None
        """What engine.sampler reads of ``params`` for a batch, cached there on first use."""
        self.spec = None
        """Speculative decoding's state for it (engine.spec_decode), made on its first decode step."""
        self.pooled = None
        """With ``params.pooling``: its prompt's hidden states pooled so far (engine.pooling)."""
        self.tenant: str | None = None
        """Whose request it is: the waiting queue shares service between tenants (engine.fairness)."""
        self.weight = 1.0
        """Its tenant's share of service, relative to the others' weights."""

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def reads_whole_prompt(self) -> bool:
        """Every prompt position's logits or state is needed: nothing may come from the prefix cache."""
        return self.needs_prompt_logprobs or self.params.pooling == "mean"

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def record(self, t: float, event: str, *details) -> None:
        """Append to the audit trail (a tuple; formatting waits until the request ends)."""
        events = self.timing.events
        if len(events) < MAX_AUDIT_EVENTS or event == "finished":
            events.append((t, event, *details))

    def sort_key(self) -> tuple[int, int]:
        """Queue order: lower priority value first, then first come, first served."""
        return (self.priority, self.seq_no)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}#{self.index}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")
