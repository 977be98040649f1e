"""Tensor parallelism end to end on CPU (gloo): rank 0 runs the engine, a spawned worker
holds the other shard and runs every step rank 0 sends it.

Greedy tokens equal TP=1 (Llama, Qwen2 with qkv bias, uneven KV groups, a replicated KV
head) under concurrency and forced preemption; each rank loads only its slices; a killed
rank makes the engine report dead within a bounded time; shutdown leaves no worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
import signal
import time

import pytest

from engine import LLM, AsyncEngine, EngineDeadError, SamplingParams
from engine.parallel import check_tp_shapes
from tests.factories import make_model_dir

pytestmark = pytest.mark.timeout(180)

# A pool of 12 blocks x 8 tokens for 6 requests of up to 45 tokens: preemption is certain.
SMALL_POOL = dict(dtype="float32", block_size=8, num_kv_blocks=12, max_num_seqs=4)
BIG_POOL = dict(dtype="float32", block_size=8, num_kv_blocks=128, max_num_seqs=4)
PROMPTS = [[5, 9, 13, 200, 7], list(range(20, 53)), [300] * 3, list(range(100, 117)), [7, 7, 8, 9], [42] * 25]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _wait_until(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


MODELS = {  # name: (architecture, factory keywords)
    "llama": ("llama", dict(tie=True)),
    "qwen2-gqa": ("qwen2", dict()),
    "llama-uneven-kv-groups": ("llama", dict(hidden=96, heads=6, kv_heads=3)),  # like SmolLM2: ranks get 2 and 1
    "qwen2-replicated-kv": ("qwen2", dict(kv_heads=1)),                         # MQA: both ranks hold the KV head
}


@pytest.mark.parametrize("name", list(MODELS))
def test_tp2_equals_tp1_under_preemption_and_leaves_no_workers(tmp_path, name):
    arch, kw = MODELS[name]
    path = str(make_model_dir(tmp_path / name, arch, seed=2, with_tokenizer=False, **kw))
    # Two of the prompts are scored too: every rank's LM head computes the extra rows.
    params = [dataclasses.replace(GREEDY, prompt_logprobs=2) if i in (1, 3) else GREEDY for i in range(len(PROMPTS))]
    reference = LLM(path, **SMALL_POOL)
    ref_outs = reference.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    full_bytes = reference.engine.runner.param_bytes
    llm = LLM(path, tensor_parallel_size=2, **SMALL_POOL)
    pids = llm.engine.tp.launcher.pids
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        assert _tokens(outs) == _tokens(ref_outs)
        for i in (1, 3):
            got, want = outs[i].prompt_logprobs, ref_outs[i].prompt_logprobs
            assert len(got) == len(PROMPTS[i]) and got[0] is None
            for q, (g, w) in enumerate(zip(got[1:], want[1:]), start=1):
                assert PROMPTS[i][q] in g and all(abs(g[t] - v) < 1e-4 for t, v in w.items() if t in g)
        assert llm.engine.stats().num_preemptions > 0
        # Sharded loading: each rank holds about half the parameters (norms are replicated).
        assert all(0.45 * full_bytes < b < 0.6 * full_bytes for b in llm.engine.tp.rank_param_bytes), \
            (llm.engine.tp.rank_param_bytes, full_bytes)
    finally:
        llm.shutdown()
    assert all(_gone(pid) for pid in pids) and not multiprocessing.active_children()


def test_each_rank_reads_only_its_slices(tmp_path, monkeypatch):
    import safetensors
    import torch

    from engine.attention import create_backend
    from engine.model import ModelArch, load_model
    from engine.parallel import ParallelGroup

    path = make_model_dir(tmp_path / "m", "qwen2", seed=1, with_tokenizer=False)
    arch = ModelArch.from_dir(path)
    real_open = safetensors.safe_open

    class SlicesOnly:  # a whole-tensor read would put a full copy in this rank's memory
        def __init__(self, *args, **kwargs):
            self._f = real_open(*args, **kwargs)

        def __enter__(self):
            self._inner = self._f.__enter__()
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def keys(self):
            return self._inner.keys()

        def get_slice(self, name):
            return self._inner.get_slice(name)

        def get_tensor(self, name):
            raise AssertionError(f"read {name} whole")

    monkeypatch.setattr(safetensors, "safe_open", SlicesOnly)

    def param_bytes(group):
        heads = group.heads(arch.num_heads, arch.num_kv_heads)
        backend = create_backend("torch", torch.device("cpu"), heads.q_count, heads.kv_count, arch.head_dim, 8)
        model = load_model(path, arch, group, backend, torch.float32, torch.device("cpu"), 64)
        return sum(p.numel() * p.element_size() for p in model.parameters())

    full = param_bytes(ParallelGroup())
    shards = [param_bytes(ParallelGroup(rank=r, world_size=2)) for r in range(2)]
    assert all(0.45 * full < s < 0.55 * full for s in shards), (shards, full)


@pytest.mark.parametrize("shape, field", [
    ((4, 2, 128, 512, 3), "num_key_value_heads"),  # 3 ranks cannot share 2 KV heads evenly
    ((6, 2, 128, 512, 4), "num_attention_heads"),  # 4 ranks, 6 query heads
    ((4, 4, 129, 512, 2), "intermediate_size"),
    ((4, 4, 128, 511, 2), "vocab_size"),
])
def test_unsplittable_shapes_name_the_field(shape, field):
    with pytest.raises(ValueError, match=rf"^{field} \("):
        check_tp_shapes(*shape)


def test_unsplittable_model_fails_before_starting_any_worker(tmp_path):
    path = str(make_model_dir(tmp_path / "m", "llama", seed=0, with_tokenizer=False))  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="num_key_value_heads"):
        LLM(path, tensor_parallel_size=3, **BIG_POOL)
    assert not multiprocessing.active_children()


def test_long_prompt_then_a_killed_idle_rank_is_reported(tmp_path):
    path = str(make_model_dir(tmp_path / "m", "llama", seed=3, with_tokenizer=False))
    prompt = [{"prompt_token_ids": [(i * 37) % 500 + 3 for i in range(1000)]}]  # > one broadcast buffer
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = _tokens(LLM(path, **BIG_POOL, max_num_batched_tokens=1024).generate(prompt, params))
    llm = LLM(path, tensor_parallel_size=2, **BIG_POOL, max_num_batched_tokens=1024)
    try:
        assert _tokens(llm.generate(prompt, params)) == want
        (pid,) = llm.engine.tp.launcher.pids
        os.kill(pid, signal.SIGKILL)

        def reported() -> bool:
            try:
                llm.engine.check_health()
            except EngineDeadError:
                return True
            return False

        assert _wait_until(reported, 10)
        with pytest.raises(EngineDeadError, match="rank 1"):
            llm.generate(prompt, params)
    finally:
        started = time.monotonic()
        llm.shutdown()
        assert time.monotonic() - started < 15
    assert not multiprocessing.active_children()


def test_rank_killed_mid_stream_fails_the_stream_and_health(tmp_path):
    path = str(make_model_dir(tmp_path / "m", "qwen2", seed=4, with_tokenizer=False))
    engine = AsyncEngine.from_options(path, tensor_parallel_size=2, **BIG_POOL)
    (pid,) = engine.engine.tp.launcher.pids

    async def run() -> None:
        stream = engine.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=900, ignore_eos=True))
        await stream.__anext__()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async with asyncio.timeout(30):
                async for _ in stream:
                    pass

    try:
        asyncio.run(run())
        with pytest.raises(EngineDeadError):
            engine.check_health()
    finally:
        started = time.monotonic()
        engine.shutdown()
        assert time.monotonic() - started < 15
    assert _gone(pid) and not multiprocessing.active_children()


def test_step_message_sends_block_tables_as_deltas():
    from engine.request import Request
    from engine.scheduler import ScheduledChunk
    from engine.tp.messages import StepDecoder, StepEncoder  # kept, new at 4-5; scored at 6-7; LoRA slot at 8

    def request(seq_no, tokens, blocks):
        req = Request(str(seq_no), tokens, GREEDY, 0, seq_no, 1000, 0, frozenset())
        req.block_ids = blocks
        return req

    enc, dec = StepEncoder(block_size=4), StepDecoder()
    a, b = request(0, list(range(10)), [7, 3, 9]), request(1, [1, 2], [5])

    def roundtrip(chunks):
        msg = enc.encode(chunks)
        got = dec.decode(msg)
        for c, r in zip(chunks, got):
            assert (r.start, r.num_tokens, r.samples, r.token_ids, r.prompt_logprob_positions, r.lora_slot) == (
                c.start, c.num_tokens, c.samples, c.token_ids, c.prompt_logprob_positions, c.lora_slot)
            assert r.block_ids == c.block_ids[:-(-(c.start + c.num_tokens) // 4)]
        return msg

    roundtrip([ScheduledChunk(a, 0, 10), ScheduledChunk(b, 0, 2)])
    a.token_ids.append(11)
    a.block_ids.append(4)  # grows in place: only what is new travels
    msg = roundtrip([ScheduledChunk(a, 10, 1)])
    assert msg[1 + 4:1 + 6] == [3, 0]  # kept 3 blocks, 0 new (the 11th token is in block 3)
    a.block_ids = [8, 6]   # preempted and readmitted: a new table, sent whole
    msg = roundtrip([ScheduledChunk(a, 0, 8)])
    assert msg[1 + 4:1 + 6] == [0, 2]
    b.token_ids.append(3)
    msg = roundtrip([ScheduledChunk(b, 2, 1)])  # b skipped a step: forgotten, resent whole
    assert msg[1 + 4:1 + 6] == [0, 1]
    scored = request(2, list(range(30)), [1, 2, 11, 12, 13, 14, 15, 16])
    scored.prompt_logprobs = [None] * 5  # 4 prompt tokens scored already
    scored.lora_slot = 3
    msg = roundtrip([ScheduledChunk(scored, 0, 16)])  # recomputed from 0: scores positions 4..15
    assert msg[1 + 6:1 + 9] == [4, 16, 3]


def test_hung_rank_trips_the_collective_timeout(tmp_path):
    path = str(make_model_dir(tmp_path / "m", "llama", seed=5, with_tokenizer=False))
    engine = AsyncEngine.from_options(path, tensor_parallel_size=2, distributed_timeout_s=2, **BIG_POOL)
    (pid,) = engine.engine.tp.launcher.pids

    async def run() -> float:
        stream = engine.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=900, ignore_eos=True))
        await stream.__anext__()
        os.kill(pid, signal.SIGSTOP)  # alive but silent: only the timeout can tell
        started = time.monotonic()
        with pytest.raises(EngineDeadError):
            async with asyncio.timeout(30):
                async for _ in stream:
                    pass
        return time.monotonic() - started

    try:
        assert asyncio.run(run()) < 15
    finally:
        started = time.monotonic()
        engine.shutdown()
        assert time.monotonic() - started < 15
    assert _gone(pid) and not multiprocessing.active_children()
