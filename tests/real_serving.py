"""The serving path in one process over the real engine (tiny random Llama), no Ray:
replica + frontend + gRPC methods + OpenAI app, for tests of what the engine itself records
(audit trail, traces). ``tests.serving_helpers`` is the same over the fake engine."""

from __future__ import annotations

import contextlib
import secrets

from deployments.engine_client import LocalEngineClient
from deployments.frontend import Frontend, FrontendConfig
from deployments.grpc_service import SlotServeGrpcMixin
from deployments.replica import EngineReplica

# A KV pool of 8 blocks of 16 tokens (128 tokens) and two slots: two requests of 20 + LONG tokens
# cannot both hold their KV, so one is preempted (always recomputed) and resumed.
ENGINE = {"device": "cpu", "dtype": "float32", "max_num_seqs": 2, "max_waiting": 4, "block_size": 16,
          "num_kv_blocks": 8, "max_model_len": 128}
LONG = 100


@contextlib.asynccontextmanager
async def real_frontend(model_dir, tokenizer, tracing=None, lora_adapters=None, **engine_options):
    """(frontend, replica) over one real engine; the engine is shut down on exit. ``lora_adapters``:
    the adapter names the frontend serves (default: those of the engine option ``lora``)."""
    replica = EngineReplica(str(model_dir), {**ENGINE, **engine_options}, drain_timeout_s=5, model_name="tiny",
                            tracing=tracing)
    if lora_adapters is None:
        lora_adapters = tuple((engine_options.get("lora") or {}).get("adapters", {}))
    frontend = Frontend(FrontendConfig(served_model_name="tiny", model=str(model_dir), lora_adapters=lora_adapters),
                        tokenizer, LocalEngineClient([replica]), tracing=tracing)
    try:
        yield frontend, replica
    finally:
        await replica.shutdown()


class GrpcService(SlotServeGrpcMixin):
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend


class GrpcContext:
    """What the RPC methods read of Serve's gRPC context: metadata, and the status they set."""

    def __init__(self, metadata=()) -> None:
        self._metadata = list(metadata)
        self.code = self.details = None

    def invocation_metadata(self):
        return self._metadata

    def set_code(self, code) -> None:
        self.code = code

    def set_details(self, details) -> None:
        self.details = details


def new_traceparent() -> tuple[str, int, int]:
    """A sampled W3C traceparent as a client would send it: (header, trace id, span id)."""
    trace_id, span_id = secrets.randbits(128) or 1, secrets.randbits(64) or 1
    return f"00-{trace_id:032x}-{span_id:016x}-01", trace_id, span_id
