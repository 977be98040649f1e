"""LoRA adapters on the engine give what HF transformers + PEFT gives: a batch mixing three adapters
and the base model, each request as PEFT answers it alone, under preemption, with fewer slots than
adapters (eviction and reload), compiled and through the decode graphs' path, on CUDA, and under
tensor parallelism; the default model with an adapter too.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cuda_graphs import DecodeGraphs
from tests.factories import make_lora_dir
# the base, adapters and expected fixtures come with these imports
from tests.lora_cases import GREEDY, KNOBS, PROMPTS, adapters, base, expected, lora_llm, run_plan, wanted


@pytest.mark.parametrize("knob", list(KNOBS))
def test_mixed_batch_equals_hf_peft(base, adapters, expected, knob):
    opts = dict(KNOBS[knob])
    llm = lora_llm(base, adapters, opts.pop("lora_opts"), **opts)
    assert run_plan(llm) == wanted(expected)
    stats, lora = llm.engine.stats(), llm.engine.lora
    if knob == "preemption":
        assert stats.num_preemptions > 0
    if knob == "one-slot":
        assert (lora.num_loads, lora.num_evictions) == (3, 2)  # one turn each, not one per request
        assert run_plan(llm) == wanted(expected)
        assert (lora.num_loads, lora.num_evictions) == (6, 5) and len(llm.engine.runner.lora._host) == 1
    assert llm.engine.block_manager.num_used == 0  # cached blocks are free (evictable), none held
    assert not lora.running  # every slot given back


def _through_decode_graphs(llm: LLM) -> list:
    """Route the runner's decode steps through DecodeGraphs (captured on CUDA; on CPU the same static
    path runs uncaptured); returns the keys the steps used."""
    runner = llm.engine.runner
    if runner.graphs is None:
        runner.graphs = DecodeGraphs(runner.decoder, runner.backend, runner.kv_caches, runner.block_table,
                                     runner.block_size, llm.engine.config.scheduler.max_num_seqs,
                                     runner.max_model_len, llm.engine.vocab_size, runner.device, runner.lora.step)
    used, run = [], runner.graphs.run
    runner.graphs.run = lambda chunks, key: (used.append((key, len(chunks))), run(chunks, key))[1]
    return used


def test_compiled_model_and_decode_graph_path_equal_hf_peft(base, adapters, expected):
    """The compiled model reads the step's adapters through its opaque op: first chunks with the
    slots in use, decode steps through the graphs' static path with every slot read and each row's
    slot from the graphs' input buffer (padding rows: none). On CPU that path runs uncaptured and
    sets the step each time; replays that read only the buffer are the CUDA test's."""
    llm = lora_llm(base, adapters, dict(max_loras=4), num_kv_blocks=256, enforce_eager=False, compile_model=True,
               attention_backend="torch", max_num_seqs=6)
    assert llm.engine.runner.compiled is not None
    used = _through_decode_graphs(llm)
    llm.engine.runner.graphs.batches = [6]  # waves of 6, 6 and 4 requests: the last one pads
    assert run_plan(llm) == wanted(expected)
    assert any(k.lora and n < k.batch for k, n in used)  # an adapter step with padding rows
    # A batch with no adapter row replays the graphs without LoRA.
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outs] == [expected[tuple(p), None] for p in PROMPTS]
    assert any(not k.lora for k, _ in used)


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled-graphs"])
def test_mixed_batch_on_cuda_equals_hf_peft(base, adapters, expected, eager):
    """The same masked matmuls on CUDA, float32: eager, and compiled with decode steps replayed
    from captured CUDA graphs while adapters are swapped in and out of two slots."""
    llm = lora_llm(base, adapters, dict(max_loras=2), num_kv_blocks=64, device="cuda", enforce_eager=eager)
    runner = llm.engine.runner
    assert (runner.graphs is None) == eager
    used = [] if eager else _through_decode_graphs(llm)
    assert run_plan(llm) == wanted(expected)
    assert eager or any(k.lora for k, _ in used)
    assert llm.engine.lora.num_evictions > 0


def test_tensor_parallel_mixed_batch_equals_hf_peft(base, adapters, expected):
    llm = lora_llm(base, adapters, dict(max_loras=2), num_kv_blocks=64, tensor_parallel_size=2)
    try:
        assert run_plan(llm) == wanted(expected)
        assert llm.engine.lora.num_evictions > 0  # the ranks followed slot reloads too
    finally:
        llm.shutdown()


def test_default_model_with_an_adapter_equals_hf_peft(default_model_dir, tmp_path):
    """The served default model (30 layers, tied embeddings, 3 KV heads): base and adapter in one batch."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = make_lora_dir(default_model_dir, tmp_path / "smol-lora", rank=8, seed=5, scale=0.5)
    prompt = [1, 504, 3458, 282, 2743, 314, 253, 1550, 30, 216]
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])

    def greedy(hf):
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                          do_sample=False, pad_token_id=0)
        return gen[0, len(prompt):].tolist()

    want = [greedy(model)]
    want.append(greedy(PeftModel.from_pretrained(model, adapter).eval()))  # wraps the model in place
    assert want[0] != want[1]
    llm = LLM(str(default_model_dir), dtype="float32", kv_cache_memory_gb=0.1,
              lora=dict(adapters={"smol": str(adapter)}, max_lora_rank=8, max_loras=1))
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    outs = llm.generate([{"prompt_token_ids": prompt}] * 2, params, lora=[None, "smol"])
    assert [list(o.outputs[0].token_ids) for o in outs] == want
