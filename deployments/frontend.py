"""The protocol-neutral core of the ingress: validate, tokenize, stream text back.

The gRPC service and the OpenAI API both parse their wire format into a
``GenerateInput``, call ``prepare`` (validation, chat template, tokenization: engines
see token ids only) and iterate ``stream`` (incremental detokenization, stop strings,
deadline, abort). Nothing here imports ray: the engine sits behind ``EngineClient``.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

from deployments.engine_client import EngineClient, EngineStream
from deployments.errors import (BadRequest, DeadlineExceeded, ModelNotFound, Unauthenticated, Unavailable,
                                to_serving_error)
from deployments.requests import (ChatMessage, GenerateInput, PreparedRequest, build_sampling_params,
                                  check_priority, check_request_id, check_text, check_timeout, check_token_ids,
                                  parse_messages)
from deployments.textstream import TextAssembler, TextDelta
from engine.errors import InvalidRequestError


@dataclass(frozen=True)
class FrontendConfig:
    served_model_name: str
    model: str
    """What the engines load: a local HF directory or a built-in name."""
    max_prompt_tokens: int | None = None
    """None: the model's context length minus one."""
    max_prompt_chars: int = 2_000_000
    """Checked before tokenizing, so a huge body cannot stall the tokenizer."""
    default_max_tokens: int = 256
    request_timeout_s: float | None = None
    api_keys: tuple[str, ...] = ()
    """Empty: no authentication. Otherwise every request must carry one of them."""


class _Inflight:
    __slots__ = ("stream", "aborted")

    def __init__(self, stream: EngineStream) -> None:
        self.stream = stream
        self.aborted = False


class Frontend:
    def __init__(self, config: FrontendConfig, tokenizer, engine: EngineClient) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._engine = engine
        self._engine_info: dict | None = None
        self._inflight: dict[str, _Inflight] = {}

    # -- checks every protocol shares ------------------------------------------------

    def authorize(self, api_key: str | None) -> None:
        """Accepts ``Bearer <key>`` or a bare key; no-op when no keys are configured."""
        if not self.config.api_keys:
            return
        key = (api_key or "").strip()
        if key.lower().startswith("bearer "):
            key = key[7:].strip()
        if not key or not any(hmac.compare_digest(key.encode(), k.encode()) for k in self.config.api_keys):
            raise Unauthenticated("missing or invalid API key: send 'authorization: Bearer <key>'")

    def check_model(self, model: str | None) -> None:
        if model and model not in (self.config.served_model_name, self.config.model):
            raise ModelNotFound(f"model {model!r} is not served here; this server serves "
                                f"{self.config.served_model_name!r} (see /v1/models)", param="model")

    @property
    def known_engine_info(self) -> dict | None:
        """The engines' model facts if already fetched (no engine call)."""
        return self._engine_info

    async def engine_info(self) -> dict:
        """The engines' model facts (context length, vocab), fetched once."""
        if self._engine_info is None:
            try:
                self._engine_info = await self._engine.model_info()
            except Exception as exc:
                raise to_serving_error(exc) from exc
        return self._engine_info

    async def model_info(self) -> dict:
        info = await self.engine_info()
        return {"served_model_name": self.config.served_model_name, "model": self.config.model,
                "max_model_len": info["max_model_len"], "vocab_size": info["vocab_size"],
                "eos_token_ids": list(self.tokenizer.eos_token_ids),
                "has_chat_template": bool(getattr(self.tokenizer, "has_chat_template", False)),
                "max_prompt_tokens": self._max_prompt_tokens(info)}

    def _max_prompt_tokens(self, info: dict) -> int:
        limit = info["max_model_len"] - 1
        return limit if self.config.max_prompt_tokens is None else min(limit, self.config.max_prompt_tokens)

    # -- text -> token ids -----------------------------------------------------------

    def tokenize_text(self, text: str, name: str = "prompt") -> list[int]:
        check_text(name, text, self.config.max_prompt_chars)
        return list(self.tokenizer.encode(text))

    def tokenize_messages(self, messages: Sequence[ChatMessage] | Sequence[dict]) -> list[int]:
        parsed = parse_messages(messages, self.config.max_prompt_chars)
        try:
            ids = self.tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in parsed],
                                                     add_generation_prompt=True)
        except InvalidRequestError as exc:
            raise BadRequest(str(exc), param="messages") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise BadRequest(f"the chat template rejected these messages: {exc}", param="messages") from None
        return list(ids)

    async def prepare(self, inp: GenerateInput) -> PreparedRequest:
        self.check_model(inp.model)
        given = [name for name in ("prompt", "messages", "prompt_token_ids") if getattr(inp, name) is not None]
        if len(given) != 1:
            raise BadRequest("give exactly one of prompt, messages or prompt_token_ids"
                             + (f" (got {', '.join(given)})" if given else ""), param="prompt")
        request_id = check_request_id(inp.request_id)
        info = await self.engine_info()
        if inp.prompt is not None:
            ids = self.tokenize_text(inp.prompt)
        elif inp.messages is not None:
            ids = self.tokenize_messages(inp.messages)
        else:
            ids = list(check_token_ids("prompt_token_ids", inp.prompt_token_ids, info["vocab_size"]))
        if not ids:
            raise BadRequest("the prompt tokenizes to zero tokens; send some text", param="prompt")
        limit = self._max_prompt_tokens(info)
        if len(ids) > limit:
            raise BadRequest(f"the prompt has {len(ids)} tokens; the limit is {limit} (max_prompt_tokens)",
                             param="prompt")
        params = build_sampling_params(inp.sampling, num_prompt_tokens=len(ids), max_model_len=info["max_model_len"],
                                       default_max_tokens=inp.default_max_tokens or self.config.default_max_tokens)
        return PreparedRequest(request_id=request_id, prompt_token_ids=tuple(ids), params=params,
                               priority=check_priority(inp.priority),
                               timeout_s=check_timeout(inp.timeout_s, self.config.request_timeout_s),
                               trace_context=inp.trace_context)

    # -- streaming -------------------------------------------------------------------

    async def stream(self, req: PreparedRequest) -> AsyncIterator[TextDelta]:
        """Text deltas until the last one (``finish_reason`` set).

        Consume it with ``contextlib.aclosing``: closing it early (client gone) aborts
        the request in its engine, so the slot is free before the next step.
        """
        if req.request_id in self._inflight:
            raise BadRequest(f"request_id {req.request_id!r} is already running; use a unique id",
                             param="request_id")
        assembler = TextAssembler(self.tokenizer, req.request_id, req.params, len(req.prompt_token_ids))
        engine_stream = self._engine.generate(req.engine_request())
        inflight = self._inflight[req.request_id] = _Inflight(engine_stream)
        deadline = None if req.timeout_s is None else time.monotonic() + req.timeout_s
        engine_done = False
        try:
            while not assembler.finished:
                try:
                    message = await _next(engine_stream, deadline)
                except StopAsyncIteration:
                    engine_done = True
                    yield assembler.abort()
                    return
                except (asyncio.TimeoutError, TimeoutError) as exc:
                    if deadline is None:
                        raise to_serving_error(exc) from exc
                    raise DeadlineExceeded(f"request {req.request_id} passed its deadline of {req.timeout_s:g} s "
                                           "and was aborted; raise timeout_s or ask for fewer tokens") from None
                except Exception as exc:
                    if inflight.aborted:  # the abort itself ends a remote stream with an error
                        yield assembler.abort()
                        return
                    raise to_serving_error(exc) from exc
                engine_done = message.get("finish_reason") is not None
                yield assembler.push(message)
        finally:
            self._inflight.pop(req.request_id, None)
            if not engine_done:  # client gone, stop string, deadline or error: free the slot now
                await engine_stream.aclose()

    async def generate_all(self, req: PreparedRequest) -> tuple[str, list[TextDelta]]:
        """The whole output at once (non-streaming APIs)."""
        deltas = []
        stream = self.stream(req)
        try:
            async for delta in stream:
                deltas.append(delta)
        finally:
            await stream.aclose()
        return "".join(d.text for d in deltas), deltas

    def abort(self, request_id: str) -> bool:
        inflight = self._inflight.get(request_id)
        if inflight is None:
            return False
        inflight.aborted = True
        inflight.stream.abort()
        return True

    # -- load and health ---------------------------------------------------------------

    async def load(self) -> dict:
        try:
            replicas = await self._engine.replica_loads()
        except Exception as exc:
            raise to_serving_error(exc) from exc
        return summarize_load(replicas)

    async def check_ready(self) -> None:
        """Raises Unavailable unless at least one engine replica reports healthy."""
        load = await self.load()
        if not any(r.get("healthy") for r in load["replicas"]):
            raise Unavailable(f"no healthy engine replica ({len(load['replicas'])} known); "
                              "they may still be loading the model")


async def _next(stream: EngineStream, deadline: float | None) -> dict:
    if deadline is None:
        return await stream.__anext__()
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise asyncio.TimeoutError
    return await asyncio.wait_for(stream.__anext__(), remaining)


def summarize_load(replicas: list[dict]) -> dict:
    # The prefix digest is for routers; a load report shows how big it is, not its hashes.
    replicas = [{**{k: v for k, v in r.items() if k != "prefix_hashes"},
                 "num_prefix_hashes": len(r.get("prefix_hashes") or ())} for r in replicas]
    total = sum(r.get("max_num_seqs", 0) for r in replicas)
    running = sum(r.get("running", 0) for r in replicas)
    kv_total = sum(r.get("kv_blocks_total", 0) for r in replicas)
    kv_used = sum(r.get("kv_blocks_used", 0) for r in replicas)
    return {"replicas": replicas, "total_slots": total, "free_slots": sum(r.get("free_slots", 0) for r in replicas),
            "running": running, "waiting": sum(r.get("waiting", 0) for r in replicas),
            "occupancy": running / total if total else 0.0, "kv_usage": kv_used / kv_total if kv_total else 0.0}
