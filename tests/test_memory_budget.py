"""The GPU memory budget: its arithmetic and the dummy step it profiles (CPU), and the real
budget holding under load (CUDA)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import EngineConfig
from engine.memory import GIB, DraftFootprint, MemoryBudget, checkpoint_bytes, dummy_prefill, worst_case_sampling
from engine.sampler import Sampler
from tests.factories import make_model_dir


def _budget(**kw) -> MemoryBudget:
    base = dict(total_bytes=80 * GIB, utilization=0.9, weights_bytes=16 * GIB, activation_bytes=2 * GIB,
                graph_pool_bytes=2 * GIB, gather_bytes=GIB, other_bytes=GIB // 2, block_bytes=2 * 1024 * 1024)
    return MemoryBudget(**{**base, **kw})


def test_kv_pool_gets_what_is_left_under_the_utilization():
    b = _budget()
    assert b.allowed_bytes == int(72 * GIB)
    assert b.kv_bytes == int(72 * GIB) - 16 * GIB - 2 * GIB - 2 * GIB - GIB - GIB // 2
    assert b.num_blocks(ceiling=10**9) == b.kv_bytes // (2 * 1024 * 1024)
    assert b.num_blocks(ceiling=1000) == 1000  # never more than every slot at full length needs
    assert _budget(utilization=0.5).num_blocks(10**9) < b.num_blocks(10**9)
    assert _budget(graph_pool_bytes=0).num_blocks(10**9) == b.num_blocks(10**9) + 2 * GIB // (2 * 1024 * 1024)


def test_no_room_for_a_pool_names_the_option_and_what_took_the_memory():
    with pytest.raises(ValueError, match="gpu_memory_utilization 0.25") as info:
        _budget(utilization=0.25).num_blocks(10**9)
    assert "weights 16.00 GiB" in str(info.value) and "KV 0.00 GiB" in str(info.value)


def test_a_drafter_takes_its_weights_buffers_and_a_pool_of_as_many_blocks():
    """A draft model's pool has the target's block count: each block of the target's pool brings one
    of the drafter's. Its captured graphs are counted as the target's largest step again."""
    mib = 1024 * 1024
    plain = _budget()
    draft = DraftFootprint(weights_bytes=2 * GIB, block_bytes=mib, gather_bytes=GIB // 2)
    b = _budget(draft=draft)
    assert b.draft_bytes == 2 * GIB + GIB // 2 and b.kv_bytes == plain.kv_bytes - b.draft_bytes
    assert b.num_blocks(10**9) == b.kv_bytes // (3 * mib)  # the target's 2 MiB and the drafter's 1 MiB
    graphs = _budget(draft=DraftFootprint(weights_bytes=2 * GIB, block_bytes=mib, gather_bytes=GIB // 2, graphs=True))
    assert graphs.draft_bytes == b.draft_bytes + 2 * GIB  # the activations' 2 GiB once more
    wide = _budget(draft=dataclasses.replace(graphs.draft, logits_bytes=mib))
    assert wide.draft_bytes == graphs.draft_bytes + mib  # and the graphs' logits buffer
    assert "drafter 2.50 GiB" in b.describe() and "drafter" not in plain.describe()
    with pytest.raises(ValueError, match="drafter 62.00 GiB"):
        _budget(draft=DraftFootprint(weights_bytes=62 * GIB, block_bytes=mib)).num_blocks(10**9)


def test_a_checkpoints_bytes_once_loaded_come_from_its_headers(tmp_path):
    """Floating tensors at the dtype the model runs in, integer ones (packed INT4, maps) as stored."""
    from safetensors.torch import load_file, save_file

    save_file({"a": torch.zeros(3, 5), "b": torch.zeros(7, dtype=torch.float16)}, str(tmp_path / "x.safetensors"))
    save_file({"q": torch.zeros(4, 2, dtype=torch.int32), "m": torch.zeros(9, dtype=torch.bool)},
              str(tmp_path / "y.safetensors"))
    assert checkpoint_bytes(tmp_path, torch.bfloat16) == 22 * 2 + 8 * 4 + 9
    assert checkpoint_bytes(tmp_path, torch.float32) == 22 * 4 + 8 * 4 + 9
    model = make_model_dir(tmp_path / "m", "llama", with_tokenizer=False)
    loaded = sum(t.numel() for f in model.glob("*.safetensors") for t in load_file(str(f)).values())
    assert checkpoint_bytes(model, torch.bfloat16) == 2 * loaded


@pytest.mark.parametrize("value", [0, -0.1, 1.01, float("nan"), "0.9", True])
def test_gpu_memory_utilization_must_be_in_zero_one(value):
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be a number in \(0, 1\]"):
        EngineConfig.from_options("m", gpu_memory_utilization=value)
    assert EngineConfig.from_options("m").cache.gpu_memory_utilization == 0.9
    assert EngineConfig.from_options("m", gpu_memory_utilization=1).cache.gpu_memory_utilization == 1


@pytest.mark.parametrize("tokens,seqs,max_len", [(2048, 16, 4096), (100, 64, 4096), (4096, 4, 512), (7, 3, 2)])
def test_dummy_step_is_the_largest_step_the_scheduler_can_form(tokens, seqs, max_len):
    bs = 16
    chunks, used = dummy_prefill(tokens, seqs, max_len, bs)
    lens = [c.num_tokens for c in chunks]
    assert len(chunks) == min(seqs, tokens)
    assert sum(lens) == min(tokens, len(chunks) * max_len) and max(lens) - min(lens) <= 1
    assert all(c.start == 0 and c.samples and len(c.token_ids) == c.num_tokens for c in chunks)
    blocks = [b for c in chunks for b in c.block_ids]
    assert sorted(blocks) == list(range(used)) and all(len(c.block_ids) == -(-c.num_tokens // bs) for c in chunks)


def test_worst_case_sampling_runs_the_sampler_on_every_filter():
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0))
    batch = worst_case_sampling(5, torch.device("cpu"))
    tokens, logprobs = Sampler()(logits, batch)
    top50 = logits.topk(50, dim=-1).indices
    assert all(t in top50[i].tolist() for i, t in enumerate(tokens)) and logprobs == [None] * 5


def test_the_profiled_step_runs_every_lora_slot(tmp_path, monkeypatch):
    """The GPU budget's largest step includes LoRA at its widest: each projection reads all slots
    (its intermediates grow with max_loras x rank x tokens)."""
    from engine import LLM
    from engine import runner as runner_module
    from engine.lora.layers import LoRAStep
    from tests.factories import make_lora_dir

    path = make_model_dir(tmp_path, "llama", seed=2, with_tokenizer=False)
    adapter = str(make_lora_dir(path, tmp_path / "lora", rank=4))
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, lora=dict(adapters={"a": adapter}, max_loras=3,
                                                                       max_lora_rank=4))
    runner, widths = llm.engine.runner, []
    real_set = LoRAStep.set
    monkeypatch.setattr(LoRAStep, "set", lambda self, slots, n=0: (widths.append((slots is not None, n)),
                                                                   real_set(self, slots, n))[1])
    monkeypatch.setattr(runner_module, "measure_peak", lambda step, device: step() or 0)
    runner._profile_largest_step()
    assert widths == [(True, 3), (False, 0)]  # every slot, then nothing left set for the next step
    assert runner.lora.step.slots is None


@pytest.mark.gpu
@pytest.mark.parametrize("lora", [False, True], ids=["base", "32-adapters-rank-64"])
def test_engine_stays_within_its_gpu_budget_at_full_load(tmp_path, lora):
    from engine import LLM, SamplingParams
    from tests.factories import make_lora_dir

    path = make_model_dir(tmp_path, "llama", seed=2, with_tokenizer=False, hidden=256, heads=8, kv_heads=2,
                          max_pos=2048)
    names = [None] * 32
    options = {}
    if lora:  # one adapter under 32 names: 32 slots, each step reads them all
        adapter = str(make_lora_dir(path, tmp_path / "lora", rank=64))
        names = [f"a{i}" for i in range(32)]
        options["lora"] = dict(adapters=dict.fromkeys(names, adapter), max_loras=32, max_lora_rank=64)
    torch.cuda.reset_peak_memory_stats()
    util = 0.3
    llm = LLM(str(path), device="cuda", dtype="bfloat16", gpu_memory_utilization=util, max_num_seqs=32,
              max_model_len=2048, max_num_batched_tokens=4096, **options)
    # Every slot at (nearly) full length at once.
    prompts = [{"prompt_token_ids": [3 + i] * 1900} for i in range(32)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=140, ignore_eos=True), lora=names)
    assert all(len(o.outputs[0].token_ids) == 140 for o in outs)
    _, total = torch.cuda.mem_get_info()
    assert torch.cuda.max_memory_reserved() <= util * total
