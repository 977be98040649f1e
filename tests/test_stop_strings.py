"""Stop strings over streamed text (``engine.detokenizer.StopStringMatcher``): found whatever the
chunking, the first to complete wins, held text released when it diverges or at the end."""

from __future__ import annotations

import random

import pytest

from engine.detokenizer import StopStringMatcher
from engine.errors import InvalidRequestError


def reference_stop(text, stops, include):
    """Character by character: the first stop string to complete (longest on a tie)."""
    for end in range(1, len(text) + 1):
        for s in sorted(stops, key=len, reverse=True):
            if text[:end].endswith(s):
                return (text[:end] if include else text[:end - len(s)]), True
    return text, False


def run_matcher(stops, chunks, include=False):
    matcher = StopStringMatcher(stops, include_stop_str_in_output=include)
    out, stopped = [], False
    for chunk in chunks:
        piece, stopped = matcher.push(chunk)
        out.append(piece)
        if stopped:
            break
    out.append(matcher.flush())
    return "".join(out), stopped, matcher


def test_stop_no_stops_passes_through():
    matcher = StopStringMatcher([])
    assert matcher.push("abc") == ("abc", False) and matcher.flush() == ""


def test_stop_single_push():
    assert run_matcher(["STOP"], ["hello STOP world"])[:2] == ("hello ", True)
    text, stopped, matcher = run_matcher(["STOP"], ["hello STOP world"], include=True)
    assert (text, stopped, matcher.stop_reason) == ("hello STOP", True, "STOP")
    assert matcher.push("more") == ("", True)


def test_stop_across_pushes():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("hel") == ("hel", False)
    assert matcher.push("lo ST") == ("lo ", False)
    assert matcher.push("O") == ("", False)
    assert matcher.push("P and more") == ("", True)
    assert matcher.flush() == ""
    matcher = StopStringMatcher("STOP", include_stop_str_in_output=True)
    assert [matcher.push(c) for c in ["a S", "TO", "Pz"]] == [("a ", False), ("", False), ("STOP", True)]


def test_stop_held_text_released_when_it_diverges_or_at_flush():
    matcher = StopStringMatcher(["abc"])
    assert matcher.push("xab") == ("x", False)
    assert matcher.push("d") == ("abd", False)
    assert matcher.push("ab") == ("", False)
    assert matcher.flush() == "ab"


@pytest.mark.parametrize("include", [False, True])
def test_stop_first_completed_wins(include):
    # "b" completes before "abc" does, whatever the chunking.
    for chunks in (["xabc"], ["x", "a", "b", "c"], ["xa", "bc"]):
        text, stopped, matcher = run_matcher(["abc", "b"], chunks, include)
        assert (text, stopped, matcher.stop_reason) == (("xab" if include else "xa"), True, "b")
    text, _, matcher = run_matcher(["b", "ab"], ["xab"], include)  # tie on the end: the longer one
    assert (text, matcher.stop_reason) == (("xab" if include else "x"), "ab")


@pytest.mark.parametrize("seed", range(40))
def test_stop_matches_reference_for_any_chunking(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice("ab 日") for _ in range(rng.randint(0, 40)))
    stops = ["".join(rng.choice("ab 日") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    include = rng.random() < 0.5
    chunks, i = [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        chunks.append(text[i:i + n])
        i += n
    got_text, got_stopped, _ = run_matcher(stops, chunks, include)
    assert (got_text, got_stopped) == reference_stop(text, stops, include)


@pytest.mark.parametrize("stop, message", [
    ([""], r"stop\[0\] must be a non-empty string"),
    (["ok", 3], r"stop\[1\] must be a non-empty string"),
])
def test_stop_validation(stop, message):
    with pytest.raises(InvalidRequestError, match=message):
        StopStringMatcher(stop)
