"""The protocol-neutral core of the ingress: validate, tokenize, stream text back.

The gRPC service and the OpenAI API both parse their wire format into a
``GenerateInput``, call ``prepare`` (validation, chat template, tokenization: engines
see token ids only) and iterate ``stream`` (incremental detokenization, stop strings,
deadline, abort). Nothing here imports ray: the engine sits behind ``EngineClient``.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import hmac
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Mapping, Sequence

from deployments.adapters import Adapters
from deployments.admission import Admission, TenantQuotas, summarize_load
from deployments.engine_client import EngineClient, EngineStream
from deployments.errors import (BadRequest, DeadlineExceeded, Overloaded, Unauthenticated,
                                Unavailable, retry_kind, to_serving_error)
from deployments.metrics import IngressMetrics, recorder_for
from deployments.requests import (ChatMessage, GenerateInput, PreparedRequest, build_sampling_params,
                                  check_logit_bias, check_messages_length, check_text, check_vocab, effective_timeout,
                                  new_request_id, parse_messages)
from deployments.tenants import KeyList, Tenant, check_priority, tenant_of
from deployments.textstream import TextAssembler, TextDelta, abort_all, last_delta
from deployments.tracing import Tracing
from engine.errors import InvalidRequestError

logger = logging.getLogger(__name__)

MAX_RESUMES = 1
"""Engine replicas a request may lose mid-stream (engine loop dead, process or node gone) and still
finish. A request that was running on two replicas that died is likely what killed them: given up
then, a poison request costs at most one more replica. A kernel fault ends a process as a lost
node does, so the ingress cannot tell the two apart and counts both."""
MAX_OVERLOAD_RETRIES = 3
"""A full replica's refusal is retried this often (on the replica the router picks next)
before the client sees RESOURCE_EXHAUSTED / 429."""
RETRY_BACKOFF_S = 0.1
OFFLOAD_CHARS = 8192
"""Prompts (or chat messages) this long are tokenized off the event loop."""
OFFLOAD_DECODES = 4096
"""Prompt logprobs needing this many token decodes are turned into text off the event loop."""


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
    """Empty (and no ``api_keys_file``): no authentication. Otherwise every request must carry a key."""
    api_keys_file: str | None = None
    """One key per line (``#`` comments); re-read when it changes, so keys rotate without a restart."""
    ingress_replicas: int = 1
    """This ingress admits its share of the streams all engine replicas can hold."""
    tool_call_parser: str = "hermes"
    """How the model writes tool calls (``deployments.tools.PARSERS``): as vLLM's ``--tool-call-parser``."""
    lora_adapters: tuple[str, ...] = ()
    """LoRA adapters the engines serve (engine option ``lora.adapters``): each is a ``model`` of its own."""
    lora_load_dir: str | None = None
    """Adapters loaded at run time (``/v1/load_lora_adapter``) must lie inside it; None: that API is off."""
    allowed_priority: tuple[int, int] = (0, 0)
    """The ``priority`` values a client of no tenant may send (``AppConfig.allowed_priority``)."""
    tenants: tuple[Tenant, ...] = ()


class _Inflight:
    __slots__ = ("stream", "aborted")

    def __init__(self, stream: EngineStream) -> None:
        self.stream = stream
        self.aborted = False


class Frontend:
    def __init__(self, config: FrontendConfig, tokenizer, engine: EngineClient, tracing: Tracing | None = None) -> None:
        """``tracing``: where request spans go (default: as the ``OTEL_*`` environment variables say)."""
        self.config = config
        self.tokenizer = tokenizer
        self._engine = engine
        self._engine_info: dict | None = None
        self._engine_info_call: asyncio.Future | None = None
        self._inflight: dict[str, _Inflight] = {}
        self._keys = KeyList(config.api_keys, config.api_keys_file)
        self._admission = Admission(engine.replica_loads if engine is not None else None, config.ingress_replicas)
        self.adapters = Adapters(config.lora_adapters, config.lora_load_dir, engine)
        self.metrics = IngressMetrics(recorder_for(config.served_model_name))  # rejections, counted by the protocols
        self.quotas = TenantQuotas(config.tenants, config.ingress_replicas, self.metrics.recorder)
        for tenant in config.tenants:  # a missing or bad keys file fails the replica at start
            tenant.keys.current()
        self.tracing = tracing if tracing is not None else Tracing.from_env()  # spans, started by the protocols

    # -- checks every protocol shares ------------------------------------------------

    def authorize(self, api_key: str | None) -> Tenant | None:
        """The key's tenant, or None (a key of no tenant, or no keys configured); ``Bearer <key>`` or bare."""
        keys, tenants = self._keys.current(), self.config.tenants
        if not keys and not tenants and not self._keys.required:
            return None
        key = (api_key or "").strip()
        if key.lower().startswith("bearer "):
            key = key[7:].strip()
        # Compare with every key, whatever matches: the time taken says nothing about which one.
        matches, tenant = [hmac.compare_digest(key.encode(), k.encode()) for k in keys], tenant_of(key, tenants)
        if not key or not (any(matches) or tenant is not None):
            raise Unauthenticated("missing or invalid API key: send 'authorization: Bearer <key>'")
        return tenant

    async def check_model(self, model: str | None) -> tuple[str | None, str | None]:
        """(LoRA adapter, its directory if replicas may lack it) that ``model`` names; (None, None) for
        the base model; NOT_FOUND for anything else."""
        return await self.adapters.resolve(model, (self.config.served_model_name, self.config.model))

    @property
    def known_engine_info(self) -> dict | None:
        """The engines' model facts if already fetched (no engine call)."""
        return self._engine_info

    async def engine_info(self) -> dict:
        """The engines' model facts (context length, vocab), fetched once: the first requests,
        however many arrive together, share one call."""
        if self._engine_info is None:
            call = self._engine_info_call
            if call is None or call.cancelled():
                # In a fresh context: Serve cancels the calls a request made when that request is
                # cancelled (its client went away), and this one is every waiting request's.
                call = self._engine_info_call = asyncio.get_running_loop().create_task(
                    self._engine.model_info(), context=contextvars.Context())
            try:
                info = await asyncio.shield(call)
            except asyncio.CancelledError:
                if not call.cancelled():
                    raise  # this request was cancelled; the shared call goes on
                raise Unavailable("the engines' model facts could not be read (the call was cancelled); "
                                  "retry") from None
            except Exception as exc:
                if self._engine_info_call is call:  # failed: the next request asks again
                    self._engine_info_call = None
                raise to_serving_error(exc) from exc
            self._engine_info = info
        return self._engine_info

    async def model_info(self) -> dict:
        info = await self.engine_info()
        return {"served_model_name": self.config.served_model_name, "model": self.config.model,
                "max_model_len": info["max_model_len"], "vocab_size": info["vocab_size"],
                "eos_token_ids": list(self.tokenizer.eos_token_ids),
                "has_chat_template": bool(getattr(self.tokenizer, "has_chat_template", False)),
                "max_prompt_tokens": self._max_prompt_tokens(info),
                "quantization": info.get("quantization", "none"),
                "lora_adapters": list(await self.adapters.served())}

    def _max_prompt_tokens(self, info: dict) -> int:
        limit = info["max_model_len"] - 1
        return limit if self.config.max_prompt_tokens is None else min(limit, self.config.max_prompt_tokens)

    # -- text -> token ids -----------------------------------------------------------

    def tokenize_text(self, text: str, name: str = "prompt") -> list[int]:
        check_text(name, text, self.config.max_prompt_chars)
        return list(self.tokenizer.encode(text))

    def tokenize_messages(self, messages: Sequence[ChatMessage] | Sequence[dict],
                          tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        parsed = parse_messages(messages)
        check_messages_length(parsed, self.config.max_prompt_chars)
        if tools:  # rendered into the prompt too: the same character limit
            check_text("tools", json.dumps(list(tools)), self.config.max_prompt_chars)
        try:
            ids = self.tokenizer.apply_chat_template(parsed, add_generation_prompt=True, tools=tools)
        except InvalidRequestError as exc:
            raise BadRequest(str(exc), param="messages") from None
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise BadRequest(f"the chat template rejected these messages: {exc}", param="messages") from None
        return list(ids)

    @staticmethod
    async def off_loop(size: int, fn, *args):
        """Long texts are tokenized on a worker thread: a 2 MB prompt must not stall every other
        stream on this event loop. Short ones stay inline (a thread hop costs more than them)."""
        if size < OFFLOAD_CHARS:
            return fn(*args)
        return await asyncio.to_thread(fn, *args)

    async def prepare(self, inp: GenerateInput, trace_context: Mapping[str, str] | None = None,
                      tenant: Tenant | None = None) -> PreparedRequest:
        """``trace_context``: the W3C headers (traceparent, tracestate) the engine replica's spans
        descend from (the ingress span's). ``tenant``: whose it is (``authorize``)."""
        arrival = time.monotonic()  # the tenant's time to first token includes tokenizing
        lora, lora_path = await self.check_model(inp.model)
        check_priority(inp.priority, tenant, self.config.allowed_priority)
        given = [name for name in ("prompt", "messages", "prompt_token_ids") if getattr(inp, name) is not None]
        if len(given) != 1:
            raise BadRequest("give exactly one of prompt, messages or prompt_token_ids"
                             + (f" (got {', '.join(given)})" if given else ""), param="prompt")
        info = await self.engine_info()
        if inp.prompt is not None:
            ids = await self.off_loop(len(inp.prompt), self.tokenize_text, inp.prompt)
        elif inp.messages is not None:
            size = sum(len(m.content) + sum(len(c.function.arguments) for c in m.tool_calls or ())
                       for m in inp.messages) + (len(json.dumps(list(inp.tools))) if inp.tools else 0)
            ids = await self.off_loop(size, self.tokenize_messages, inp.messages, inp.tools)
        else:
            check_vocab(inp.prompt_token_ids, info["vocab_size"])
            ids = list(inp.prompt_token_ids)
        if not ids:
            raise BadRequest("the prompt tokenizes to zero tokens; send some text", param="prompt")
        limit = self._max_prompt_tokens(info)
        if len(ids) > limit:
            raise BadRequest(f"the prompt has {len(ids)} tokens; the limit is {limit} (max_prompt_tokens)",
                             param="prompt")
        build = functools.partial(build_sampling_params, inp.sampling, num_prompt_tokens=len(ids),
                                  max_model_len=info["max_model_len"],
                                  default_max_tokens=inp.default_max_tokens or self.config.default_max_tokens)
        # A grammar compiles the first time it is seen (cached after): off the loop, like a long prompt.
        params = await asyncio.to_thread(build) if "structured_outputs" in inp.sampling else build()
        check_logit_bias(params, info["vocab_size"])
        return PreparedRequest(request_id=new_request_id(), prompt_token_ids=tuple(ids), params=params,
                               priority=inp.priority,
                               timeout_s=effective_timeout(inp.timeout_s, self.config.request_timeout_s),
                               trace_context=trace_context, client_request_id=inp.request_id,
                               operation="chat" if inp.messages is not None else "text_completion", lora=lora,
                               lora_path=lora_path,
                               cache_salt=tenant.cache_salt(inp.cache_salt) if tenant else inp.cache_salt,
                               tenant=tenant.name if tenant else None, tenant_weight=tenant.weight if tenant else 1.0,
                               arrival_time=arrival)

    # -- streaming -------------------------------------------------------------------

    async def stream(self, req: PreparedRequest) -> AsyncIterator[TextDelta]:
        """Text deltas until the request's last one (``ends_request``); with ``n`` > 1, each
        choice's deltas (``index``) as they come, every choice's last one with its ``finish_reason``.

        Consume it with ``contextlib.aclosing``: closing it early (client gone) aborts
        the request in its engine, so the slot is free before the next step. A replica
        that dies mid-stream costs the client nothing: the request resumes on another one
        from the tokens already sent (``MAX_RESUMES``), and a full replica's refusal is
        retried elsewhere (``MAX_OVERLOAD_RETRIES``) before it becomes an error.
        """
        refusal = await self._admission.refusal(req.tenant, req.tenant_weight)  # engines full, or a fair share held
        if refusal is not None:
            self.quotas.overloaded(req.tenant)
            raise Overloaded(refusal)
        prompt_len = len(req.prompt_token_ids)
        ticket = self.quotas.admit(req.tenant, prompt_len, req.arrival_time)
        choices = [TextAssembler(self.tokenizer, req.request_id, req.params, req.prompt_token_ids,
                                 req.client_request_id, i) for i in range(req.params.n)]
        inflight = self._inflight[req.request_id] = _Inflight(self._engine.generate(req.engine_request()))
        self._admission.shares.hold(req.tenant, req.tenant_weight)
        deadline = None if req.timeout_s is None else time.monotonic() + req.timeout_s
        retries = {"lost": 0, "overloaded": 0}
        engine_done = False
        try:
            while not all(c.finished for c in choices):
                try:
                    message = await _next(inflight.stream, deadline)
                except StopAsyncIteration:
                    engine_done = True
                    for delta in abort_all(choices, prompt_len):
                        yield delta
                    return
                except (asyncio.TimeoutError, TimeoutError) as exc:
                    if deadline is None:
                        raise to_serving_error(exc) from exc
                    raise DeadlineExceeded(f"request {req.request_id} passed its deadline of {req.timeout_s:g} s "
                                           "and was aborted; raise timeout_s or ask for fewer tokens") from None
                except Exception as exc:
                    if inflight.aborted:  # the abort itself ends a remote stream with an error
                        for delta in abort_all(choices, prompt_len):
                            yield delta
                        return
                    await self._retry_or_raise(req, inflight, choices, retries, exc)
                    continue
                engine_done = message.ends_request
                ticket.started()  # its first tokens (or its end): no longer waiting
                choice = choices[message.index]
                if choice.finished:  # ended by a stop string; the engine runs it until the others end
                    continue
                # A 32k-token prompt's logprobs with 20 alternatives each are ~700k decodes: off the loop.
                heavy = len(message.prompt_logprobs or ()) * (1 + (req.params.prompt_logprobs or 0))
                delta = await asyncio.to_thread(choice.push, message) if heavy >= OFFLOAD_DECODES else choice.push(message)
                ticket.observe(message, delta.text)
                if all(c.finished for c in choices):
                    yield last_delta(delta, choices, prompt_len)
                    continue
                if choice.finished and message.finish_reason is None:  # a stop string: free its slot
                    inflight.stream.abort(choice.index)
                yield delta
        finally:
            self._admission.shares.release(req.tenant)
            ticket.finish(sum(len(c.token_ids) for c in choices))
            self._inflight.pop(req.request_id, None)
            if not engine_done:  # client gone, stop string, deadline or error: free the slot now
                await inflight.stream.aclose()

    async def _retry_or_raise(self, req: PreparedRequest, inflight: "_Inflight", choices: list[TextAssembler],
                              retries: dict[str, int], exc: Exception) -> None:
        """Send the request again (resumed from the tokens the client has) or raise the error."""
        err = to_serving_error(exc)
        kind = retry_kind(exc, err)
        limit = {"overloaded": MAX_OVERLOAD_RETRIES, "lost": MAX_RESUMES}.get(kind, 0)
        if kind is None or retries[kind] >= limit:
            if kind == "lost":
                raise Unavailable(f"request {req.request_id} lost its engine replica {retries[kind] + 1} times "
                                  f"({err.message}); not resumed again") from exc
            raise err from exc
        if kind == "overloaded" and not await self._room_elsewhere():
            raise err from exc  # every replica is full: tell the client at once
        retries[kind] += 1
        logger.warning("request %s (client id %s): %s; resuming after %s tokens (retry %d of %d)", req.request_id,
                       req.client_request_id, err.message, "/".join(str(len(c.token_ids)) for c in choices),
                       retries[kind], limit)
        await inflight.stream.aclose()
        if kind != "overloaded":  # give Serve a moment to stop routing to the dead replica
            await asyncio.sleep(RETRY_BACKOFF_S * 2 ** (retries[kind] - 1))
        attempt = sum(retries.values())
        if req.params.n == 1:
            request = req.engine_request(resume_token_ids=choices[0].token_ids, attempt=attempt)
        else:  # the choices still running, each from its own tokens
            request = req.engine_request(resume_choices={c.index: c.token_ids for c in choices if not c.finished},
                                         attempt=attempt)
        inflight.stream = self._engine.generate(request)

    async def _room_elsewhere(self) -> bool:
        """Whether some healthy replica has a free slot (then the router sends the retry there)."""
        try:
            loads = await self._engine.replica_loads()
        except Exception:  # noqa: BLE001 - no load report: do not retry blind
            return False
        return any(r.healthy and r.free_slots > 0 for r in loads)

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

    async def abort(self, request_id: str) -> bool:
        """Abort by the server's request id (as streamed back in every response).

        The stream may be held by another ingress replica: then every engine replica is
        asked, and the one running it ends the stream with finish reason "abort".
        """
        inflight = self._inflight.get(request_id)
        if inflight is not None:
            inflight.aborted = True
            inflight.stream.abort()
            return True
        try:
            return await self._engine.abort(request_id)
        except Exception as exc:
            raise to_serving_error(exc) from exc

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
    async with asyncio.timeout(remaining):  # not wait_for: on 3.11 it can swallow a cancellation
        return await stream.__anext__()
