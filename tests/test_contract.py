"""The serving path's typed contract (deployments.contract): one merge, and the link's older peers."""

from __future__ import annotations

from typing import Any

import msgspec

from deployments.contract import EngineMessage, coalesce
from deployments.contract import Output, as_item, outputs
from engine.outputs import RequestTiming, StreamOutput


def _message(tokens, finish=None, index=0, running=1, **kw) -> EngineMessage:
    return EngineMessage(tokens, finish, None, 3, len(tokens), 0, index=index, choices_running=running, **kw)


def test_a_merge_keeps_every_token_and_what_is_sent_once_and_the_latest_counts():
    a = _message([1, 2], queue_time_s=0.5, prompt_logprobs=[None, {4: -1.0}])
    b = _message([3], "length", running=0, audit=[{"event": "finished"}])
    merged = a.merge(b)
    assert merged == EngineMessage([1, 2, 3], "length", None, 3, 1, 0, audit=[{"event": "finished"}],
                                   choices_running=0, prompt_logprobs=[None, {4: -1.0}], queue_time_s=0.5)
    assert merged.ends_request and not a.ends_request
    la = msgspec.structs.replace(a, logprobs=[{1: -0.1}, {2: -0.2}])
    assert la.merge(b).logprobs == [{1: -0.1}, {2: -0.2}]  # a message without logprobs adds none
    lb = msgspec.structs.replace(b, logprobs=[{3: -0.3}])
    assert la.merge(lb).logprobs == [{1: -0.1}, {2: -0.2}, {3: -0.3}]
    assert a.token_ids == [1, 2] and b.token_ids == [3]  # merging changes neither


def test_coalesce_keeps_choices_apart_and_puts_the_end_of_the_request_last():
    got = coalesce([_message([1], index=0, running=2), _message([7], index=1, running=2),
                    _message([2], "stop", index=0, running=1), _message([8], index=1, running=1),
                    _message([9], "length", index=1, running=0)])
    assert [(m.index, m.token_ids, m.finish_reason, m.ends_request) for m in got] == [
        (0, [1, 2], "stop", False), (1, [7, 8, 9], "length", True)]
    assert coalesce([_message([5], "length", running=0)]) == [_message([5], "length", running=0)]


class _PreviousReleaseMessage(msgspec.Struct):
    """How the link's previous release read an engine message: six fields it requires."""

    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    index: int = 0
    choices_running: int = 0


class _PreviousReleaseOutput(msgspec.Struct, array_like=True):
    wire_id: str
    message: _PreviousReleaseMessage | None = None
    error: Any = None


def test_messages_cross_a_rolling_update_both_ways():
    """A new replica's frames read by a previous-release ingress, and a previous replica's message
    (a plain map of the six fields) read by a new one."""
    new = _message([4], index=1)  # every optional field at its default: none of them sent
    [old] = msgspec.msgpack.decode(outputs([("w", new, None)])[4:], type=list[_PreviousReleaseOutput])
    assert (old.message.token_ids, old.message.finish_reason, old.message.index) == ([4], None, 1)
    sent = msgspec.msgpack.encode([["w", {"token_ids": [4], "finish_reason": "stop", "logprobs": None,
                                          "num_prompt_tokens": 3, "num_output_tokens": 1, "num_cached_tokens": 0}, None]])
    [item] = [as_item(o) for o in msgspec.msgpack.decode(sent, type=list[Output])]
    assert item == ("w", EngineMessage([4], "stop", None, 3, 1, 0), None) and item[1].ends_request


def test_a_message_of_an_engine_output_carries_the_audit_and_queue_time_where_they_belong():
    timing = RequestTiming(arrival_time=1.0, first_scheduled_time=1.5)
    timing.events.append((1.5, "scheduled", 0))
    running = StreamOutput("r", [7], num_prompt_tokens=2, num_output_tokens=1, timing=timing, choices_running=1)
    first, later = EngineMessage.of(running, first=True), EngineMessage.of(running)
    assert first.queue_time_s == 0.5 and later.queue_time_s is None and first.audit is None
    done = StreamOutput("r", [8], finished=True, finish_reason="stop", num_output_tokens=2, timing=timing)
    assert EngineMessage.of(done).audit == [{"time_s": 0.5, "event": "scheduled", "cached_tokens": 0}]
    assert EngineMessage.aborted(5) == EngineMessage([], "abort", None, 5, 0, 0)
