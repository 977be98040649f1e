"""Tensor-parallel layers: two gloo ranks on CPU produce the same greedy tokens as one process.

Each rank loads only its shard through the parameters' own weight loaders (q/k/v and
gate/up packed, heads and vocabulary split, row-parallel all-reduce), and runs the same
deterministic schedule, so the collectives line up.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from engine import LLM, SamplingParams
from tests.factories import make_model_dir

PROMPTS = [[5, 9, 13, 200, 7], list(range(20, 61)), [300] * 3]
OPTIONS = dict(dtype="float32", block_size=8, num_kv_blocks=64, max_num_seqs=4)
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, path: str, results) -> None:
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.parallel import init_parallel_group

    torch.set_num_threads(1)
    group = init_parallel_group(rank, world, init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
    engine = LLMEngine(EngineConfig.from_options(path, **OPTIONS), group=group)
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, PARAMS, request_id=str(i))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    results[rank] = [tokens[str(i)] for i in range(len(PROMPTS))]
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp2_matches_tp1(tmp_path, arch):
    # 4 heads / 2 KV heads / vocab 512: everything splits evenly across 2 ranks.
    path = str(make_model_dir(tmp_path / arch, arch, seed=2, with_tokenizer=False, tie=(arch == "llama")))
    want = [o.outputs[0].token_ids for o in
            LLM(path, **OPTIONS).generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)]
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = _free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, 2, port, path, results)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        assert results[0] == want
        assert results[1] == want
