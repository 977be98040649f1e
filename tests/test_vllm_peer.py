"""The vllm benchmark system without vLLM: its driver loop over a stand-in engine (submission at
arrival times, delta outputs timed per message), and a clear error when no vLLM venv is named."""

from __future__ import annotations

import types

import pytest

from benchmarks import vllm_offline
from benchmarks.systems import SYSTEMS, BenchSettings
from benchmarks.vllm_peer import run_vllm
from benchmarks.workloads import BenchRequest


class StandInEngine:
    """vLLM's LLMEngine surface the driver uses: one new token per running request per step."""

    def __init__(self):
        self.running: dict[str, int] = {}
        self.added: list[str] = []

    def add_request(self, rid, prompt, params):
        assert prompt["prompt_token_ids"] and params.max_tokens > 0
        self.running[rid] = params.max_tokens
        self.added.append(rid)

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        outs = []
        for rid in list(self.running):
            self.running[rid] -= 1
            finished = self.running[rid] == 0
            if finished:
                del self.running[rid]
            outs.append(types.SimpleNamespace(request_id=rid, finished=finished,
                                              outputs=[types.SimpleNamespace(token_ids=[7])]))
        return outs


def test_driver_submits_at_arrival_and_times_every_message(monkeypatch, capsys):
    monkeypatch.setattr(vllm_offline, "_params", lambda n: types.SimpleNamespace(max_tokens=n))
    engine = StandInEngine()
    requests = [["a", [1, 2, 3], 3, 0.0], ["b", [4, 5], 2, 0.05]]
    messages, makespan = vllm_offline._run(engine, requests)
    assert engine.added == ["a", "b"]
    assert [n for _, n in messages["a"]] == [1, 1, 1] and [n for _, n in messages["b"]] == [1, 1]
    assert messages["b"][0][0] >= 0.05  # not before its arrival
    assert makespan >= messages["b"][-1][0]
    assert capsys.readouterr().out.count(vllm_offline.PROGRESS_MARK) == 2


def test_without_a_vllm_venv_the_system_says_what_it_needs(tmp_path):
    assert "vllm" in SYSTEMS
    settings = BenchSettings(str(tmp_path), vllm_python=str(tmp_path / "missing" / "python"))
    with pytest.raises(ValueError, match="--vllm-python"):
        run_vllm([BenchRequest("r", (1, 2), 2, 0.0)], settings, lambda n: None)
