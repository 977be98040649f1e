"""The hostile-input table of tests/test_hostile_e2e.py: one row per kind of bad Generate input.

Each ``Kind`` holds the request in both protocols where it can be expressed (a gRPC
``GenerateRequest`` as ParseDict JSON or raw bytes; an OpenAI body, serialized with
``json.dumps`` so NaN and lone surrogates travel as JSON allows, or raw bytes), the
documented outcome (gRPC status, HTTP status) and the field the error must name: the
OpenAI ``param`` and a word of both messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb
from tests.hostile_service import MAX_PROMPT_CHARS, MAX_PROMPT_TOKENS

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
DROP = object()  # a field to leave out of the default body
_SAMPLING = {f.name for f in pb.SamplingOptions.DESCRIPTOR.fields}
_INPUTS = ("prompt", "messages", "prompt_token_ids")
USER = [{"role": "user", "content": "hi"}]
UNSATISFIABLE = {"type": "string", "minLength": 5, "maxLength": 2}
HUGE_SCHEMA = '{"enum": [' + ", ".join(f'"{i:08d}"' for i in range(7000)) + ']}'


def g(**fields) -> dict:
    """A GenerateRequest (ParseDict form): prompt "hi", max_tokens 4, plus ``fields``."""
    req: dict = {"sampling": {"max_tokens": 4}}
    if not any(k in fields for k in _INPUTS):
        req["prompt"] = "hi"
    for k, v in fields.items():
        if k == "messages":
            req[k] = {"messages": v}
        elif k == "prompt_token_ids":
            req[k] = {"ids": v}
        elif k in _SAMPLING:
            req["sampling"][k] = v
        else:
            req[k] = v
    return req


def _body(path: str, base: dict, fields: dict) -> tuple[str, dict]:
    body = {**base, **fields}
    return path, {k: v for k, v in body.items() if v is not DROP}


def c(**fields) -> tuple[str, dict]:
    """A /v1/completions body: model tiny, prompt "hi", max_tokens 4, plus ``fields``."""
    return _body(COMPLETIONS, {"model": "tiny", "prompt": "hi", "max_tokens": 4}, fields)


def ch(**fields) -> tuple[str, dict]:
    """A /v1/chat/completions body: one user message, max_tokens 4, plus ``fields``."""
    return _body(CHAT, {"model": "tiny", "messages": USER, "max_tokens": 4}, fields)


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field (payloads under 128 bytes)."""
    return bytes([number << 3 | 2, len(payload)]) + payload


def raw(content: bytes, path: str = COMPLETIONS) -> tuple[str, bytes]:
    return path, content


@dataclass(frozen=True)
class Kind:
    id: str
    grpc: dict | bytes | None
    """None: not expressible in protobuf (a wrong JSON type, a lone surrogate...)."""
    http: tuple[str, dict | bytes] | None
    code: str = "INVALID_ARGUMENT"
    status: int = 400
    param: str | None = None
    """OpenAI's error.param; also a word both error messages contain."""
    needle: str | tuple[str, str] | None = None
    """Text the messages contain when it is not ``param``: one for both, or (gRPC, HTTP)."""
    headers: dict = field(default_factory=dict)

    def needles(self) -> tuple[str | None, str | None]:
        n = self.needle if self.needle is not None else self.param
        return n if isinstance(n, tuple) else (n, n)


def K(id, grpc, http, param=None, needle=None, **kw) -> Kind:  # noqa: N802 - a table row
    return Kind(id, grpc, http, param=param, needle=needle, **kw)


LONG_PROMPT = "x" * (MAX_PROMPT_CHARS + 1)
MANY_TOKENS = "hello " * (MAX_PROMPT_TOKENS + 100)  # under the char limit, over the token limit
BAD_PART = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]

KINDS = [
    # -- the wire format ---------------------------------------------------------------------
    K("garbage-bytes", b"\xff\xff\xff", raw(b'{"model": "tiny", "prompt":'),
      needle=("not a valid slotserve.v1.GenerateRequest", "not valid JSON")),
    K("truncated", b"\x1a\x05ab", raw(b'{"model": "tiny", "prompt": "hi"} trailing'),
      needle=("not a valid", "not valid JSON")),
    K("wrong-wire-type", b"\x18\x05", raw(b'[1, 2]'), needle=("exactly one of prompt", "JSON object")),
    K("overlong-varint", b"\x38" + b"\xff" * 10 + b"\x01", raw(b'"just a string"'),
      needle=("not a valid", "JSON object")),
    K("length-past-end", b"\x1a\xff\xff\xff\xff\x0f", raw(b""), needle=("not a valid", "not valid JSON")),
    K("end-group-tag", b"\x0c", raw(b"null"), needle=("not a valid", "JSON object")),
    K("utf8-bom", None, raw(b'\xef\xbb\xbf{"model": "tiny", "prompt": "hi"}'), needle="not valid JSON"),
    K("utf16-body", None, raw('{"model": "tiny", "prompt": "hi"}'.encode("utf-16")), needle="UTF-8"),
    K("deep-nesting", None, raw(b"[" * 30_000 + b"]" * 30_000), needle="JSON"),
    K("int-5000-digits", None, raw(b'{"model": "tiny", "prompt": "hi", "seed": ' + b"9" * 5000 + b"}"),
      needle="JSON"),
    # -- text encoding -------------------------------------------------------------------------
    K("bad-utf8-prompt", b"\x1a\x02\xff\xfe", raw(b'{"model": "tiny", "prompt": "\xff\xfe"}'), needle="UTF-8"),
    K("bad-utf8-request-id", b"\x0a\x02\xc3\x28\x1a\x02hi", None, needle="UTF-8"),
    K("bad-utf8-message", _field(4, _field(1, _field(1, b"user") + _field(2, b"\xff"))), None, needle="UTF-8"),
    K("surrogate-prompt", None, c(prompt="a\ud800b"), param="prompt", needle="unpaired surrogate"),
    K("surrogate-message", None, ch(messages=[{"role": "user", "content": "\udc00"}]), param="messages.0.content",
      needle="unpaired surrogate"),
    K("surrogate-stop", None, c(stop=["\ud83d"]), param="stop.0", needle="unpaired surrogate"),
    K("surrogate-field-name", None, c(**{"\ud800": 1}), param="\ud800", needle="unknown field"),
    K("surrogate-model", None, c(model="\udfff"), code="NOT_FOUND", status=404, param="model", needle="not served"),
    # -- the prompt ----------------------------------------------------------------------------
    K("empty-prompt", g(prompt=""), c(prompt=""), param="prompt", needle="empty"),
    K("no-input", {"sampling": {"max_tokens": 4}}, c(prompt=DROP), param="prompt",
      needle=("exactly one of", "prompt is required")),
    K("prompt-over-char-limit", g(prompt=LONG_PROMPT), c(prompt=LONG_PROMPT), param="prompt",
      needle=f"limit is {MAX_PROMPT_CHARS}"),
    K("prompt-over-token-limit", g(prompt=MANY_TOKENS), c(prompt=MANY_TOKENS), param="prompt",
      needle=f"limit is {MAX_PROMPT_TOKENS}"),
    K("prompt-wrong-type", None, c(prompt=5), param="prompt"),
    K("prompt-object", None, c(prompt={"text": "hi"}), param="prompt"),
    K("prompt-batch", None, c(prompt=["a", "b"]), param="prompt", needle="one prompt per request"),
    K("token-ids-empty", g(prompt_token_ids=[]), c(prompt=[]), param="prompt", needle=("prompt_token_ids", "prompt")),
    K("token-id-out-of-vocab", g(prompt_token_ids=[1, 10**6]), c(prompt=[1, 10**6]), param="prompt_token_ids.1"),
    K("token-id-negative", g(prompt_token_ids=[-1]), c(prompt=[-1]), param="prompt_token_ids.0"),
    K("token-id-past-int64", None, c(prompt=[2**70]), param="prompt_token_ids.0"),
    K("token-id-float", None, c(prompt=[1, 2.5]), param="prompt"),
    K("token-id-bool", None, c(prompt=[True, False]), param="prompt"),
    K("token-id-string", None, c(prompt=[1, "2"]), param="prompt"),
    # -- sampling values -----------------------------------------------------------------------
    K("temperature-negative", g(temperature=-1), c(temperature=-1), param="temperature"),
    K("temperature-too-high", g(temperature=101), c(temperature=101), param="temperature"),
    K("temperature-nan", g(temperature="NaN"), c(temperature=float("nan")), param="temperature"),
    K("temperature-string", None, c(temperature="hot"), param="temperature"),
    K("top-p-zero", g(top_p=0), c(top_p=0), param="top_p"),
    K("top-p-above-one", g(top_p=1.5), c(top_p=1.5), param="top_p"),
    K("top-p-infinite", g(top_p="Infinity"), c(top_p=float("inf")), param="top_p"),
    K("top-k-below-minus-one", g(top_k=-2), c(top_k=-2), param="top_k"),
    K("top-k-float", None, c(top_k=2.5), param="top_k"),
    K("top-k-past-int64", None, c(top_k=10**30, temperature=1), param="top_k"),
    K("min-p-negative", g(min_p=-0.1), c(min_p=-0.1), param="min_p"),
    K("min-p-above-one", g(min_p=1.5), c(min_p=1.5), param="min_p"),
    K("repetition-penalty-zero", g(repetition_penalty=0), c(repetition_penalty=0), param="repetition_penalty"),
    K("repetition-penalty-huge", g(repetition_penalty=11), c(repetition_penalty=11), param="repetition_penalty"),
    K("presence-penalty-range", g(presence_penalty=3), c(presence_penalty=3), param="presence_penalty"),
    K("frequency-penalty-range", g(frequency_penalty=-3), c(frequency_penalty=-3), param="frequency_penalty"),
    K("frequency-penalty-object", None, c(frequency_penalty={"a": 1}), param="frequency_penalty"),
    K("max-tokens-zero", g(max_tokens=0), c(max_tokens=0), param="max_tokens"),
    K("max-tokens-negative", g(max_tokens=-4), c(max_tokens=-4), param="max_tokens"),
    K("max-tokens-past-context", g(max_tokens=10**9), c(max_tokens=10**9), param="max_tokens"),
    K("max-tokens-string", None, c(max_tokens="4"), param="max_tokens"),
    K("max-tokens-float", None, c(max_tokens=4.5), param="max_tokens"),
    K("max-tokens-bool", None, c(max_tokens=True), param="max_tokens"),
    K("max-completion-tokens-string", None, ch(max_tokens=DROP, max_completion_tokens="x"), param="max_tokens"),
    K("min-tokens-over-max", g(min_tokens=8), c(min_tokens=8), param="min_tokens"),
    K("min-tokens-negative", g(min_tokens=-1), c(min_tokens=-1), param="min_tokens"),
    K("logprobs-too-many", g(logprobs=21), c(logprobs=21), param="logprobs"),
    K("logprobs-negative", g(logprobs=-1), c(logprobs=-1), param="logprobs"),
    K("top-logprobs-too-many", None, ch(logprobs=True, top_logprobs=21), param="logprobs"),
    K("chat-logprobs-not-bool", None, ch(logprobs="yes"), param="logprobs"),
    K("top-logprobs-without-logprobs", None, ch(top_logprobs=2), param="top_logprobs"),
    K("seed-negative", g(seed=-1), c(seed=-1), param="seed"),
    K("seed-past-int64", None, c(seed=2**64), param="seed"),
    K("seed-string", None, c(seed="abc"), param="seed"),
    K("priority-past-int32", None, c(priority=2**31), param="priority"),
    K("priority-string", None, c(priority="high"), param="priority"),
    # the hostile service allows [-5, 5]; the in-process frontend of tests/test_validation_errors [0, 0]
    K("priority-not-allowed", g(priority=-(2**31)), c(priority=2**31 - 1), param="priority", needle="allowed_priority"),
    K("cache-salt-empty", None, c(cache_salt=""), param="cache_salt"),
    K("cache-salt-too-long", g(cache_salt="s" * 257), c(cache_salt="s" * 257), param="cache_salt"),
    K("cache-salt-number", None, c(cache_salt=7), param="cache_salt"),
    K("ignore-eos-string", None, c(ignore_eos="yes"), param="ignore_eos"),
    K("skip-special-tokens-int", None, c(skip_special_tokens=1), param="skip_special_tokens"),
    K("include-stop-str-string", None, c(include_stop_str_in_output="no"), param="include_stop_str_in_output"),
    K("timeout-negative", g(timeout_s=-1), None, param="timeout_s"),
    K("timeout-nan", g(timeout_s="NaN"), None, param="timeout_s"),
    K("stream-not-bool", None, c(stream="yes"), param="stream"),
    K("stream-options-without-stream", None, c(stream_options={"include_usage": True}), param="stream_options"),
    K("stream-options-unknown-key", None, c(stream=True, stream_options={"include_usage": True, "x": 1}),
      param="stream_options.x"),
    K("bad-value-while-streaming", None, ch(stream=True, temperature=-1), param="temperature"),
    # -- stops ---------------------------------------------------------------------------------
    K("stop-17-strings", g(stop=["x"] * 17), c(stop=["x"] * 17), param="stop"),
    K("stop-10000-strings", g(stop=["x"] * 10_000), c(stop=["x"] * 10_000), param="stop"),
    K("stop-string-too-long", g(stop=["x" * 257]), c(stop=["x" * 257]), param="stop.0"),
    K("stop-string-empty", g(stop=[""]), c(stop=[""]), param="stop.0"),
    K("stop-not-strings", None, c(stop=[1, 2]), param="stop.0"),
    K("stop-wrong-type", None, c(stop=5), param="stop"),
    K("stop-token-ids-65", g(stop_token_ids=list(range(65))), c(stop_token_ids=list(range(65))),
      param="stop_token_ids"),
    K("stop-token-id-negative", g(stop_token_ids=[-1]), c(stop_token_ids=[-1]), param="stop_token_ids.0"),
    K("stop-token-ids-string", None, c(stop_token_ids="1,2"), param="stop_token_ids"),
    K("stop-token-id-float", None, c(stop_token_ids=[1.5]), param="stop_token_ids.0"),
    # -- chat messages -------------------------------------------------------------------------
    K("messages-not-a-list", None, ch(messages="hi"), param="messages"),
    K("messages-empty", g(messages=[]), ch(messages=[]), param="messages"),
    K("messages-missing", None, ch(messages=DROP), param="messages"),
    K("message-not-an-object", None, ch(messages=["hi"]), param="messages.0"),
    K("message-bad-role", g(messages=[{"role": "wizard", "content": "hi"}]),
      ch(messages=[{"role": "wizard", "content": "hi"}]), param="messages.0.role"),
    K("message-no-role", g(messages=[{"content": "hi"}]), ch(messages=[{"content": "hi"}]), param="messages.0.role"),
    K("message-content-int", None, ch(messages=[{"role": "user", "content": 5}]), param="messages.0.content"),
    K("message-image-part", None, ch(messages=BAD_PART), param="messages.0.content", needle="text-only"),
    K("message-text-part-not-str", None, ch(messages=[{"role": "user", "content": [{"type": "text", "text": 1}]}]),
      param="messages.0.content", needle="text parts"),
    K("messages-1025", g(messages=USER * 1025), ch(messages=USER * 1025), param="messages", needle="at most 1024"),
    K("messages-over-char-limit", g(messages=[{"role": "user", "content": LONG_PROMPT}]),
      ch(messages=[{"role": "user", "content": LONG_PROMPT}]), param="messages.0.content",
      needle=f"limit is {MAX_PROMPT_CHARS}"),
    # -- model, request id ---------------------------------------------------------------------
    K("unknown-model", g(model="gpt-4"), c(model="gpt-4"), code="NOT_FOUND", status=404, param="model",
      needle="not served"),
    K("model-missing", None, c(model=DROP), param="model"),
    K("model-wrong-type", None, c(model=5), param="model"),
    K("request-id-too-long", g(request_id="r" * 129), c(), param="request_id", headers={"x-request-id": "r" * 129}),
    K("request-id-not-printable", g(request_id="a\tb"), c(), param="request_id", headers={"x-request-id": "a\tb"}),
    # -- OpenAI features refused by name -------------------------------------------------------
    K("n-zero", g(n=0), c(n=0), param="n"),
    K("n-above-limit", g(n=65), c(n=65), param="n", needle="integer in [1, 64]"),
    K("n-not-an-integer", None, c(n=2.5), param="n"),
    K("best-of-2", None, c(best_of=2), param="best_of"),
    K("logit-bias-outside-vocab", g(logit_bias={10**6: 5}), c(logit_bias={str(10**6): 5}), param="logit_bias.1000000",
      needle="not a token id of this model"),
    K("logit-bias-above-100", g(logit_bias={1: 101}), c(logit_bias={"1": 101}), param="logit_bias.1"),
    K("logit-bias-not-a-token-id", None, c(logit_bias={"one": 5}), param="logit_bias.one"),
    K("logit-bias-negative-id", g(logit_bias={-1: 5}), c(logit_bias={"-1": 5}), param="logit_bias.-1"),
    K("logit-bias-not-a-number", None, c(logit_bias={"1": "high"}), param="logit_bias.1"),
    K("logit-bias-infinite", g(logit_bias={1: "-Infinity"}), c(logit_bias={"1": float("-inf")}), param="logit_bias.1"),
    K("logit-bias-list", None, c(logit_bias=[1, 5]), param="logit_bias"),
    K("echo-not-a-boolean", None, c(echo="yes"), param="echo"),
    K("suffix", None, c(suffix="x"), param="suffix"),
    K("tool-name-not-a-string", None, ch(tools=[{"type": "function", "function": {"name": 5}}]),
      param="tools.0.function.name"),
    K("tool-parameters-not-an-object", None, ch(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]),
      param="tools.0.function.parameters"),
    K("tool-required-without-tools", g(tool_choice="required"), ch(tool_choice="required"), param="tool_choice",
      needle="needs tools"),
    K("grpc-tool-bad-name", g(messages=USER, tools=[{"name": "bad name!"}]), None, param="tools.0.name"),
    K("grpc-tools-with-a-prompt", g(tools=[{"name": "f"}]), None, param="tools", needle="send messages"),
    K("grpc-tool-parameters-not-json", g(messages=USER, tools=[{"name": "f", "parameters_json": "{x"}]), None,
      param="tools.0.parameters_json"),
    K("grpc-tool-choice-unknown", g(messages=USER, tools=[{"name": "f"}], tool_choice="g"), None,
      param="tool_choice", needle="not among the tools"),
    K("tool-parameters-unsatisfiable", None,
      ch(tools=[{"type": "function", "function": {"name": "f", "parameters": UNSATISFIABLE}}], tool_choice="required"),
      param="tools", needle="Unsatisfiable"),
    # -- structured outputs ---------------------------------------------------------------------
    K("response-format-unknown-type", None, ch(response_format={"type": "xml"}), param="response_format.type"),
    K("response-format-schema-missing", None, ch(response_format={"type": "json_schema"}), param="response_format",
      needle="json_schema is required"),
    K("response-format-unsatisfiable", None,
      ch(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": UNSATISFIABLE}}),
      param="response_format", needle="Unsatisfiable"),
    K("schema-wrong-type", g(structured_outputs={"json": '{"type": "strin"}'}),
      c(structured_outputs={"json": {"type": "strin"}}), param="structured_outputs.json", needle="strin"),
    K("schema-not-json", g(structured_outputs={"json": "{type"}), c(structured_outputs={"json": "{type"}),
      param="structured_outputs", needle="JSON schema"),
    # Over HTTP the same schema is over this service's body limit first (a 413, tested above).
    K("schema-huge", g(structured_outputs={"json": HUGE_SCHEMA}), None, param="structured_outputs",
      needle="the limit is"),
    K("regex-unclosed", g(structured_outputs={"regex": "[a-"}), c(structured_outputs={"regex": "[a-"}),
      param="structured_outputs.regex", needle="unclosed"),
    K("grammar-undefined-rule", g(structured_outputs={"grammar": "start: foo"}),
      ch(structured_outputs={"grammar": "start: foo"}), param="structured_outputs.grammar", needle="foo"),
    K("choice-empty", None, c(structured_outputs={"choice": []}), param="structured_outputs.choice"),
    K("two-constraints", None, c(structured_outputs={"regex": "a", "choice": ["a"]}), param="structured_outputs",
      needle="exactly one"),
    K("constraint-and-response-format", None,
      ch(structured_outputs={"regex": "a"}, response_format={"type": "json_object"}), param="structured_outputs",
      needle="give one of them"),
    K("unknown-field", None, c(frobnicate=1), param="frobnicate"),
    K("chat-field-on-completions", None, c(messages=USER), param="messages", needle="unknown field"),
]
