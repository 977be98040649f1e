"""LoRA slots, scheduling and refusals on the engine: passed-over requests keep their place and
their share, adapters never share cached KV, run-time load and unload, bad adapters and names are
refused by name while the engine keeps serving, slots are reused least recently used first and
always come back, stats, the router's adapter-rooted prefix keys, and the LoRA benchmark.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import AdapterLoadError, UnknownAdapterError
from engine.lora import LoRAManager
from tests.factories import make_lora_dir, make_model_dir
# the base, adapters and expected fixtures come with these imports
from tests.lora_cases import ADAPTERS, GREEDY, PLAN, PROMPTS, adapters, base, expected, lora_llm


def test_a_passed_over_request_leaves_its_prompt_scoring_share_to_the_next(base, adapters):
    """Prompt logprobs are scored up to MAX_SCORED_TOKENS a step; a request passed over for want of
    an adapter slot takes no share of them."""
    from engine.scheduler import MAX_SCORED_TOKENS

    llm = lora_llm(base, adapters, dict(max_loras=1), num_kv_blocks=256)
    engine = llm.engine
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True), lora="all-r4")
    engine.step()  # it holds the only slot from now on
    prompt = [(11 * i) % 200 + 3 for i in range(MAX_SCORED_TOKENS // 2 + 60)]
    scored = SamplingParams(max_tokens=2, prompt_logprobs=0)
    engine.add_request(prompt, scored, request_id="other-adapter", lora="qv-down-r8")
    engine.add_request(prompt[::-1], scored, request_id="base")
    engine.step()
    (base_req,) = engine.requests["base"]
    assert base_req.num_computed_tokens == len(prompt)  # scored whole, not the share left after the other
    (passed,) = engine.requests["other-adapter"]
    assert passed.num_computed_tokens == 0


def test_adapters_never_share_cached_kv(base, adapters, tmp_path):
    llm = lora_llm(base, adapters, dict(max_loras=2), num_kv_blocks=64)
    prompt = {"prompt_token_ids": list(range(5, 40))}  # 4 full blocks of 8

    def cached(name):
        return llm.generate(prompt, GREEDY, lora=name)[0].num_cached_tokens

    assert cached(None) == 0 and cached("all-r4") == 0 and cached("qv-down-r8") == 0
    assert cached("all-r4") == 32 and cached(None) == 32
    # The same name over other weights is another adapter to the cache.
    other = make_lora_dir(base, tmp_path / "other", rank=4, seed=99)
    llm.engine.load_lora("all-r4", other)
    assert cached("all-r4") == 0


def test_load_at_run_time_then_unload(base, adapters, expected):
    llm = lora_llm(base, {}, dict(max_loras=2), num_kv_blocks=64)
    prompt = PROMPTS[0]
    with pytest.raises(UnknownAdapterError, match="'all-r4' is not loaded; loaded: none"):
        llm.generate({"prompt_token_ids": prompt}, GREEDY, lora="all-r4")
    llm.engine.load_lora("all-r4", adapters["all-r4"])
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY, lora="all-r4")
    assert list(out[0].outputs[0].token_ids) == expected[tuple(prompt), "all-r4"]
    # Not while a request of it is unfinished; the request still completes.
    rid = llm.engine.add_request(prompt, GREEDY, lora="all-r4")
    with pytest.raises(AdapterLoadError, match="1 unfinished requests"):
        llm.engine.unload_lora("all-r4")
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert rid not in llm.engine.requests
    llm.engine.unload_lora("all-r4")
    with pytest.raises(UnknownAdapterError, match="'all-r4'"):
        llm.engine.add_request(prompt, GREEDY, lora="all-r4")
    assert not llm.engine.requests


def test_engine_without_lora_says_so(base):
    llm = LLM(str(base), dtype="float32", block_size=8, num_kv_blocks=32)
    with pytest.raises(UnknownAdapterError, match="serves no LoRA adapters"):
        llm.engine.add_request([5, 6], GREEDY, lora="x")
    with pytest.raises(AdapterLoadError, match="configure lora"):
        llm.engine.load_lora("x", "/nonexistent")


def _broken(base, adapters, tmp_path, case: str):
    """An adapter directory broken in one way; returns (path, what the error must say)."""
    path = tmp_path / case
    shutil.copytree(adapters["all-r4"], path)
    cfg_file = path / "adapter_config.json"
    cfg = json.loads(cfg_file.read_text())
    if case == "no-config":
        cfg_file.unlink()
        return path, "cannot read adapter_config.json"
    if case == "no-weights":
        (path / "adapter_model.safetensors").unlink()
        return path, "has no adapter_model.safetensors"
    if case == "rank-too-high":
        shutil.rmtree(path)
        return make_lora_dir(base, path, rank=16), "rank 16 is above max_lora_rank 8"
    if case == "other-base-model":
        shutil.rmtree(path)
        other = make_model_dir(tmp_path / "other-base", "llama", seed=3, with_tokenizer=False, hidden=64)
        return make_lora_dir(other, path, rank=4), "an adapter of another model"
    if case == "dora":
        cfg["use_dora"] = True
    elif case == "embedding-target":
        cfg["target_modules"] = ["embed_tokens"]
    elif case == "not-json":
        cfg_file.write_text("{")
        return path, "is not JSON"
    cfg_file.write_text(json.dumps(cfg))
    return path, {"dora": "use_dora=True is not supported", "embedding-target": "target_modules must name"}[case]


@pytest.mark.parametrize("case", ["no-config", "no-weights", "not-json", "rank-too-high", "other-base-model",
                                  "dora", "embedding-target"])
def test_bad_adapter_is_refused_and_the_engine_keeps_serving(base, adapters, expected, tmp_path, case):
    llm = lora_llm(base, {"all-r4": adapters["all-r4"]}, dict(max_loras=2), num_kv_blocks=64)
    path, says = _broken(base, adapters, tmp_path, case)
    with pytest.raises(AdapterLoadError, match=says):
        llm.engine.load_lora("broken", path)
    assert "broken" not in llm.engine.lora.adapters
    prompt = PROMPTS[1]
    assert list(llm.generate({"prompt_token_ids": prompt}, GREEDY, lora="all-r4")[0].outputs[0].token_ids) == \
        expected[tuple(prompt), "all-r4"]


@pytest.mark.parametrize("name", ["../etc", "a/b", "", "x" * 200])
def test_adapter_names_are_checked(base, adapters, name):
    llm = lora_llm(base, {}, dict(max_loras=1), num_kv_blocks=32)
    with pytest.raises(AdapterLoadError, match="must match"):
        llm.engine.load_lora(name, adapters["all-r4"])


def test_slots_are_reused_least_recently_used_first(base, adapters):
    from engine.model import ModelArch

    loads = []
    config = _llm_config(adapters, max_loras=2)
    manager = LoRAManager(config, ModelArch.from_dir(base), lambda slot, info: loads.append((slot, info.name)))
    a = manager.acquire("all-r4")
    b = manager.acquire("qv-down-r8")
    assert {a, b} == {0, 1} and manager.acquire("all-r4") == a  # held twice now
    assert manager.acquire("mlp-k-r2") is None  # both slots held by running requests
    manager.release(b)
    assert manager.acquire("mlp-k-r2") == b and manager.num_evictions == 1
    manager.release(a)
    manager.release(a)
    manager.release(b)
    assert manager.acquire("qv-down-r8") == a  # a was idle longest
    assert loads == [(a, "all-r4"), (b, "qv-down-r8"), (b, "mlp-k-r2"), (a, "qv-down-r8")]
    assert manager.running == {"qv-down-r8": 1}


def _llm_config(adapters, **opts):
    from engine.config import LoRAConfig

    return LoRAConfig(adapters=adapters, max_lora_rank=8, **opts)


@pytest.mark.parametrize("scheduling", ["continuous", "static"])
def test_stats_say_which_adapters_run_wait_and_sit_in_slots(base, adapters, scheduling):
    llm = lora_llm(base, adapters, dict(max_loras=1), num_kv_blocks=64, scheduling=scheduling)
    engine = llm.engine
    engine.add_request(PROMPTS[0], GREEDY, lora="all-r4")
    engine.add_request(PROMPTS[1], GREEDY, lora="qv-down-r8")  # waits: the one slot is held
    engine.add_request(PROMPTS[2], GREEDY)  # runs meanwhile, unless a static batch keeps its order
    engine.step()
    stats = engine.stats()
    assert stats.lora_loaded == ("all-r4",) and stats.max_loras == 1
    assert stats.lora_running == {"all-r4": 1} and stats.lora_waiting == {"qv-down-r8": 1}
    assert stats.running == (2 if scheduling == "continuous" else 1)
    assert stats.lora_loads == 1 and stats.lora_evictions == 0
    assert stats.lora_roots == {name: engine.adapter(name).root_hash.hex() for name in ADAPTERS}
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert stats.lora_loaded == ("qv-down-r8",) and stats.lora_evictions == 1 and not stats.lora_running


def test_the_router_finds_an_adapters_cached_prefix_from_its_reported_root(base, adapters):
    """What a replica publishes (``lora_roots``, its prefix digest) lets the router compute an adapter
    request's prefix keys: they are the engine's own keys for that adapter's blocks, not the base's."""
    from engine.kv.hashing import prefix_routing_keys
    from router.request_router import _adapter_root
    from router.policy import ReplicaLoad

    llm = lora_llm(base, adapters, dict(max_loras=2), num_kv_blocks=64)
    prompt = list(range(5, 40))
    llm.generate({"prompt_token_ids": prompt}, GREEDY, lora="all-r4")
    stats = llm.engine.stats()
    load = ReplicaLoad.from_stats("r", {"free_slots": 8, "running": 0, "waiting": 0, "max_num_seqs": 8,
                                        "kv_blocks_used": 0, "kv_blocks_total": 64, "block_size": 8,
                                        "updated_at": 0.0, "lora_loaded": list(stats.lora_loaded),
                                        "lora_roots": stats.lora_roots})
    digest = set(llm.engine.prefix_digest())
    keys = prefix_routing_keys(prompt, 8, root=_adapter_root([load], "all-r4"))
    assert len(keys) == 4 and set(keys) <= digest
    assert not set(prefix_routing_keys(prompt, 8, root=_adapter_root([load], None))) & digest
    assert _adapter_root([load], "unreported") is None  # no keys: the base model's would be false hits


def test_the_lora_benchmark_runs_and_its_adapters_are_peft_loadable(tiny_model_dir, tmp_path, capsys):
    """``benchmarks.lora`` on the tiny model: a row per run, and the adapters it writes are what
    ``peft`` loads (so its figures are those of real adapters)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from benchmarks.lora import main

    out = tmp_path / "bench" / "lora.json"
    assert main(["--model", str(tiny_model_dir), "--requests", "4", "--slots", "4", "--max-tokens", "3",
                 "--rank", "4", "--counts", "1,2", "--rounds", "1", "--out", str(out)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "x |" in line]
    assert [r.split(" | ")[0] for r in rows] == ["| base", "| slots, no adapter", "| 1 adapter", "| 2 adapters"]
    results = json.loads(out.read_text())["results"]
    assert all(r[0]["tokens"] == 12 for r in results.values())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    PeftModel.from_pretrained(model, out.parent / "lora-adapters" / "a1")


@pytest.mark.parametrize("how", ["abort", "n-held-siblings", "static"])
def test_slots_come_back_on_abort_with_held_choices_and_in_static_batches(base, adapters, how):
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=6, ignore_eos=True, n=3 if how != "static" else 1)
    llm = lora_llm(base, adapters, dict(max_loras=1), num_kv_blocks=64,
               **({"scheduling": "static"} if how == "static" else {}))
    engine = llm.engine
    ids = [engine.add_request(p, params, lora=name) for p, name in PLAN[:6]]
    engine.step()
    assert engine.lora.running  # some held a slot
    if how == "abort":
        for rid in ids:
            engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    assert not engine.lora.running and not engine.requests and engine.block_manager.num_used == 0


def test_an_adapter_file_changed_after_loading_ends_its_requests_not_the_engine(base, adapters, expected, tmp_path):
    path = shutil.copytree(adapters["all-r4"], tmp_path / "changing")
    llm = lora_llm(base, {"changing": str(path), "qv-down-r8": adapters["qv-down-r8"]}, dict(max_loras=2),
               num_kv_blocks=64)
    make_lora_dir(base, tmp_path / "other", rank=4, seed=42)
    shutil.copy(tmp_path / "other" / "adapter_model.safetensors", path / "adapter_model.safetensors")
    outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 2, GREEDY, lora=["changing", "qv-down-r8"])
    assert outs[0].outputs[0].finish_reason == "abort" and not outs[0].outputs[0].token_ids
    assert list(outs[1].outputs[0].token_ids) == expected[tuple(PROMPTS[0]), "qv-down-r8"]
    with pytest.raises(UnknownAdapterError, match="'changing'"):  # no longer served
        llm.engine.add_request(PROMPTS[0], GREEDY, lora="changing")
    assert not llm.engine.lora.running and llm.engine.block_manager.num_used == 0


def test_loading_on_a_closed_async_engine_fails_at_once(base, adapters):
    from engine.async_engine import AsyncEngine
    from engine.errors import EngineDeadError

    engine = AsyncEngine.from_options(str(base), dtype="float32", block_size=8, num_kv_blocks=32,
                                      lora={"max_loras": 1, "max_lora_rank": 8})
    info = asyncio.run(engine.load_lora("all-r4", adapters["all-r4"]))
    assert info.rank == 4
    engine.shutdown()
    with pytest.raises(EngineDeadError):
        asyncio.run(asyncio.wait_for(engine.load_lora("mlp-k-r2", adapters["mlp-k-r2"]), 10))
