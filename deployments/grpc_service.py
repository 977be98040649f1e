"""The slotserve.v1.SlotServe gRPC service (and grpc.health.v1.Health), as ingress methods.

Ray Serve's gRPC proxy calls deployment methods named after the RPCs and passes the
request as raw bytes (see ``grpc_registration``; health checks arrive parsed by
``grpcio-health-checking``'s registration), so a malformed message is reported
as INVALID_ARGUMENT here instead of failing inside grpc's deserializer. Errors set the
status code on Serve's ``grpc_context`` and raise: Serve then sends that code and
message, also after a stream has started.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, AsyncIterator, NoReturn

import grpc
from google.protobuf.json_format import ParseDict
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2
from pydantic import ValidationError

from deployments.embeddings import embed
from deployments.errors import BadRequest, ServingError, to_serving_error
from deployments.frontend import Frontend
from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb
from deployments.requests import GenerateInput, bad_request, parse_messages
from deployments.textstream import TextDelta
from deployments.tools import MAX_TOOLS, FunctionDef, NamedToolChoice, ToolDef, ToolStream, ToolUse, tool_use
from deployments.tracing import trace_headers
from engine.validation import FieldError, field_errors

SERVICE_NAME = "slotserve.v1.SlotServe"
_OPTIONAL_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                      "frequency_penalty", "max_tokens", "min_tokens", "logprobs", "seed", "skip_special_tokens", "n",
                      "prompt_logprobs")
_FINISH = {None: pb.FINISH_REASON_UNSPECIFIED, "stop": pb.FINISH_REASON_STOP,
           "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT,
           "tool_calls": pb.FINISH_REASON_TOOL_CALLS}
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
WATCH_PERIOD_S = 5.0
_GENERATE_RPC = {"rpc.system": "grpc", "rpc.service": SERVICE_NAME, "rpc.method": "Generate"}  # span attributes


def parse(message_class, raw: Any):
    """Raw request bytes (or an already parsed message) -> the message."""
    if isinstance(raw, message_class):
        return raw
    if not isinstance(raw, (bytes, bytearray)):
        raise BadRequest(f"expected a {message_class.DESCRIPTOR.full_name}, got {type(raw).__name__}")
    try:
        return message_class.FromString(bytes(raw))
    except DecodeError as exc:
        raise BadRequest(f"the request is not a valid {message_class.DESCRIPTOR.full_name} message: {exc}. "
                         "Check that the client uses slotserve.v1's proto and sends UTF-8 strings") from None


def metadata(grpc_context, key: str) -> str | None:
    if grpc_context is None:
        return None
    for k, v in grpc_context.invocation_metadata():
        if k == key:
            return v.decode("utf-8", "replace") if isinstance(v, bytes) else v
    return None


def proto_tools(msg: pb.GenerateRequest, parser: str) -> ToolUse:
    """A request's tools as ``deployments.tools`` takes them; errors name the field (``tools.0.name``)."""
    if not msg.tools:
        if msg.tool_choice not in ("", "none", "auto"):
            raise BadRequest("tool_choice needs tools to choose from", param="tool_choice")
        return ToolUse()
    if msg.WhichOneof("input") != "messages":
        raise BadRequest("tools are for chat: send messages, not a prompt", param="tools")
    if len(msg.tools) > MAX_TOOLS:
        raise BadRequest(f"tools has {len(msg.tools)} entries; at most {MAX_TOOLS}", param="tools")
    tools = []
    for i, t in enumerate(msg.tools):
        try:
            parameters = json.loads(t.parameters_json) if t.parameters_json else None
        except (ValueError, RecursionError):
            raise BadRequest(f"tools.{i}.parameters_json must be a JSON schema (JSON text)",
                             param=f"tools.{i}.parameters_json") from None
        try:
            function = FunctionDef(name=t.name, description=t.description or None, parameters=parameters)
        except ValidationError as exc:
            raise bad_request([FieldError(f"tools.{i}.{_proto_name(e.param)}".rstrip("."),
                                          f"tools.{i}.{e.message.replace('parameters', 'parameters_json', 1)}")
                               for e in field_errors(exc, FunctionDef)]) from None
        tools.append(ToolDef(type="function", function=function))
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise BadRequest("tools: function names must be distinct", param="tools")
    choice = msg.tool_choice or None
    if choice not in (None, "none", "auto", "required"):
        if choice not in names:
            raise BadRequest(f"tool_choice names {choice!r}, which is not among the tools (or none, auto, "
                             "required)", param="tool_choice")
        choice = NamedToolChoice(type="function", function={"name": choice})
    parallel = msg.parallel_tool_calls if msg.HasField("parallel_tool_calls") else None
    return tool_use(tuple(tools), choice, parallel, parser, constrained=msg.sampling.HasField("structured_outputs"))


def _proto_name(param: str | None) -> str:
    """A FunctionDef field as the proto names it (its schema travels as JSON text)."""
    return "parameters_json" if param == "parameters" else param or ""


def generate_input(msg: pb.GenerateRequest, tools: ToolUse = ToolUse()) -> GenerateInput:
    s = msg.sampling
    sampling: dict[str, Any] = {name: getattr(s, name) for name in _OPTIONAL_SAMPLING if s.HasField(name)}
    if s.stop:
        sampling["stop"] = list(s.stop)
    if s.stop_token_ids:
        sampling["stop_token_ids"] = list(s.stop_token_ids)
    if s.include_stop_str_in_output:
        sampling["include_stop_str_in_output"] = True
    if s.ignore_eos:
        sampling["ignore_eos"] = True
    if s.logit_bias:
        sampling["logit_bias"] = dict(s.logit_bias)
    kind = s.structured_outputs.WhichOneof("kind") if s.HasField("structured_outputs") else None
    if kind is not None:
        value = getattr(s.structured_outputs, kind)
        sampling["structured_outputs"] = {kind: list(value.values) if kind == "choice" else value}
    if tools.structured_outputs is not None:
        sampling["structured_outputs"] = tools.structured_outputs
    which = msg.WhichOneof("input")
    return GenerateInput(
        prompt=msg.prompt if which == "prompt" else None,
        messages=_messages(msg.messages) if which == "messages" else None,
        prompt_token_ids=tuple(msg.prompt_token_ids.ids) if which == "prompt_token_ids" else None,
        sampling=sampling, tools=tools.template_tools, model=msg.model or None,
        request_id=msg.request_id or None, priority=msg.priority, timeout_s=msg.timeout_s or None,
        cache_salt=msg.cache_salt or None)


def _messages(messages: pb.Messages) -> list[dict]:
    """Plain fields: GenerateInput validates them, naming the bad one (messages.0.role)."""
    out = []
    for m in messages.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments_json or "{}"}}
                                     for c in m.tool_calls]
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def with_tool_calls(out: pb.GenerateResponse, delta: TextDelta, stream: ToolStream) -> pb.GenerateResponse:
    """A response whose text went through ``stream``: held from where a call may begin, the calls
    parsed out on the last message."""
    out.text, calls, finish = stream.step(delta.text, delta.finish_reason)
    for call in calls:
        out.tool_calls.add(id=call["id"], name=call["function"]["name"], arguments_json=call["function"]["arguments"])
    if finish == "tool_calls":
        out.finish_reason = pb.FINISH_REASON_TOOL_CALLS
    return out


def delta_to_proto(delta: TextDelta, audit: bool = False) -> pb.GenerateResponse:
    """``audit``: the client asked for the audit trail (only the last delta has one)."""
    out = pb.GenerateResponse(request_id=delta.request_id, client_request_id=delta.client_request_id or "",
                              text=delta.text, token_ids=delta.token_ids,
                              finish_reason=_FINISH[delta.finish_reason], index=delta.index)
    if delta.usage is not None:
        out.usage.prompt_tokens = delta.usage.prompt_tokens
        out.usage.completion_tokens = delta.usage.completion_tokens
        out.usage.cached_prompt_tokens = delta.usage.cached_prompt_tokens
    for field, logprobs in ((out.logprobs, delta.logprobs), (out.prompt_logprobs, (delta.prompt_logprobs or ())[1:])):
        for lp in logprobs or ():
            entry = field.add(token_id=lp.token_id, logprob=lp.logprob, token=lp.token)
            for token_id, logprob, token in lp.top:
                entry.top_logprobs.add(token_id=token_id, logprob=logprob, token=token)
    if audit and delta.audit:
        out.audit.extend(pb.AuditEvent(**event) for event in delta.audit)
    return out


def fail(grpc_context, exc: BaseException) -> NoReturn:
    """Set the status code and message on Serve's context, then raise (Serve sends them)."""
    err = exc if isinstance(exc, ServingError) else to_serving_error(exc)
    if grpc_context is not None:
        grpc_context.set_code(getattr(grpc.StatusCode, err.grpc_code))
        grpc_context.set_details(err.message)
    raise err from (None if err is exc else exc)


class SlotServeGrpcMixin:
    """RPC methods of the ingress; the deployment class provides ``self.frontend``."""

    frontend: Frontend

    async def Generate(self, request, grpc_context=None) -> AsyncIterator[pb.GenerateResponse]:
        client = trace_headers(metadata(grpc_context, "traceparent"), metadata(grpc_context, "tracestate"))
        span = self.frontend.tracing.start_ingress(f"{SERVICE_NAME}/Generate", self.frontend.config.served_model_name,
                                                   client, _GENERATE_RPC)
        last = None
        try:
            tenant = self.frontend.authorize(metadata(grpc_context, "authorization"))  # before parsing
            span.on_tenant(tenant)
            msg = parse(pb.GenerateRequest, request)
            tools = proto_tools(msg, self.frontend.config.tool_call_parser)
            prepared = await self.frontend.prepare(generate_input(msg, tools), span.engine_trace_context(client),
                                                   tenant)
            span.on_request(prepared.operation, prepared.request_id, prepared.params)
            calls = tools.streams(prepared.params.n)
            async with contextlib.aclosing(self.frontend.stream(prepared)) as deltas:
                async for delta in deltas:
                    last = delta
                    out = delta_to_proto(delta, msg.return_audit)
                    yield out if calls is None else with_tool_calls(out, delta, calls[delta.index])
        except Exception as exc:
            span.end(last, exc)
            self.frontend.metrics.rejected(exc)
            fail(grpc_context, exc)
        finally:
            span.end(last)  # done, or the client went away (no error of ours)

    async def Abort(self, request, grpc_context=None) -> pb.AbortResponse:
        try:
            self.frontend.authorize(metadata(grpc_context, "authorization"))
            msg = parse(pb.AbortRequest, request)
            if not msg.request_id:
                raise BadRequest("request_id is required", param="request_id")
            return pb.AbortResponse(found=await self.frontend.abort(msg.request_id))
        except Exception as exc:
            fail(grpc_context, exc)

    async def Tokenize(self, request, grpc_context=None) -> pb.TokenizeResponse:
        try:
            self.frontend.authorize(metadata(grpc_context, "authorization"))
            msg = parse(pb.TokenizeRequest, request)
            await self.frontend.check_model(msg.model or None)
            which = msg.WhichOneof("input")
            if which == "text":
                ids = await self.frontend.off_loop(len(msg.text), self.frontend.tokenize_text, msg.text, "text")
            elif which == "messages":
                messages = parse_messages(_messages(msg.messages))
                ids = await self.frontend.off_loop(sum(len(m.content) for m in messages),
                                                   self.frontend.tokenize_messages, messages)
            else:
                raise BadRequest("give text or messages to tokenize", param="text")
            info = await self.frontend.engine_info()
            return pb.TokenizeResponse(token_ids=ids, count=len(ids), max_model_len=info["max_model_len"])
        except Exception as exc:
            fail(grpc_context, exc)

    async def Embed(self, request, grpc_context=None) -> pb.EmbedResponse:
        try:
            tenant = self.frontend.authorize(metadata(grpc_context, "authorization"))
            msg = parse(pb.EmbedRequest, request)
            which = msg.WhichOneof("input")
            if which is None:
                raise BadRequest("give text or token_ids to embed", param="text")
            value = msg.text if which == "text" else list(msg.token_ids.ids)
            (vector,), tokens = await embed(self.frontend, [value], msg.model or None, tenant,
                                            request_id=msg.request_id or None)
            return pb.EmbedResponse(embedding=vector, prompt_tokens=tokens)
        except Exception as exc:
            self.frontend.metrics.rejected(exc)
            fail(grpc_context, exc)

    async def GetModelInfo(self, request, grpc_context=None) -> pb.ModelInfo:
        try:
            self.frontend.authorize(metadata(grpc_context, "authorization"))
            parse(pb.GetModelInfoRequest, request)
            return pb.ModelInfo(**await self.frontend.model_info())
        except Exception as exc:
            fail(grpc_context, exc)

    async def GetLoad(self, request, grpc_context=None) -> pb.LoadReport:
        try:
            self.frontend.authorize(metadata(grpc_context, "authorization"))
            parse(pb.GetLoadRequest, request)
            return load_to_proto(await self.frontend.load())
        except Exception as exc:
            fail(grpc_context, exc)

    # -- grpc.health.v1.Health (Kubernetes' gRPC probe) ---------------------------------

    async def _health_status(self, service: str) -> int:
        """"" = the serving path (proxy -> ingress) is up; slotserve.v1.SlotServe = an engine is ready."""
        if service == "":
            return _SERVING
        if service != SERVICE_NAME:
            raise ServingHealthUnknown(f"unknown service {service!r}; ask for '' or {SERVICE_NAME!r}")
        try:
            await self.frontend.check_ready()
        except ServingError:
            return _NOT_SERVING
        return _SERVING

    async def Check(self, request, grpc_context=None) -> health_pb2.HealthCheckResponse:
        try:
            msg = parse(health_pb2.HealthCheckRequest, request)
            return health_pb2.HealthCheckResponse(status=await self._health_status(msg.service))
        except Exception as exc:
            fail(grpc_context, exc)

    async def List(self, request, grpc_context=None) -> health_pb2.HealthListResponse:
        try:
            parse(health_pb2.HealthListRequest, request)
            statuses = {name: health_pb2.HealthCheckResponse(status=await self._health_status(name))
                        for name in ("", SERVICE_NAME)}
            return health_pb2.HealthListResponse(statuses=statuses)
        except Exception as exc:
            fail(grpc_context, exc)

    async def Watch(self, request, grpc_context=None) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        try:
            msg = parse(health_pb2.HealthCheckRequest, request)
            last = None
            while True:
                try:
                    status = await self._health_status(msg.service)
                except ServingHealthUnknown:
                    status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
                if status != last:
                    yield health_pb2.HealthCheckResponse(status=status)
                    last = status
                await asyncio.sleep(WATCH_PERIOD_S)
        except Exception as exc:
            fail(grpc_context, exc)


class ServingHealthUnknown(ServingError):
    grpc_code = "NOT_FOUND"
    http_status = 404


def load_to_proto(load: dict) -> pb.LoadReport:
    """The frontend's load dict as a message; what replicas report for routing only is left out."""
    return ParseDict(load, pb.LoadReport(), ignore_unknown_fields=True)
