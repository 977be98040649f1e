"""The LoRA tests' model, adapters, prompts and HF + PEFT's answers (fixtures, imported by the
test modules that use them), and the helpers that run a mixed batch through the engine."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.factories import make_lora_dir, make_model_dir

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
# Uneven KV groups (like SmolLM2's): under TP=2 the ranks hold 2 and 1 of them, so B's q/k/v rows
# are cut unevenly.
MODEL = dict(hidden=96, heads=6, kv_heads=3)
ADAPTERS = {  # name: (rank, modules, extra PEFT options)
    "all-r4": (4, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), {}),
    "qv-down-r8": (8, ("q_proj", "v_proj", "down_proj"), {"use_rslora": True}),
    "mlp-k-r2": (2, ("gate_proj", "up_proj", "o_proj", "k_proj"), {}),
}
PROMPTS = [list(range(5, 40)), [7, 7, 8, 9], list(range(100, 117)), [300, 301, 302] * 7]
PLAN = [(p, name) for p in PROMPTS for name in (None, *ADAPTERS)]  # every prompt with every adapter and none


@pytest.fixture(scope="session")
def base(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("lora-base"), "llama", seed=3, with_tokenizer=False, **MODEL)


@pytest.fixture(scope="session")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: str(make_lora_dir(base, root / name, rank=r, seed=i, modules=mods, **extra))
            for i, (name, (r, mods, extra)) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="session")
def expected(base, adapters):
    """HF + PEFT greedy tokens of each (prompt, adapter), one at a time."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = {}
    for name in (None, *adapters):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        if name is not None:
            model = PeftModel.from_pretrained(model, adapters[name]).eval()
        for p in PROMPTS:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                 min_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
            out[tuple(p), name] = gen[0, len(p):].tolist()
    assert len({tuple(v) for v in out.values()}) == len(out), "adapters must change the output"
    return out


def run_plan(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in PLAN], GREEDY, lora=[name for _, name in PLAN])
    return [list(o.outputs[0].token_ids) for o in outs]


def wanted(expected) -> list[list[int]]:
    return [expected[tuple(p), name] for p, name in PLAN]


KNOBS = {
    "mixed": dict(lora_opts=dict(max_loras=4), num_kv_blocks=256),
    # 10 blocks x 8 tokens for 16 requests of up to 46 tokens: preemption is certain.
    "preemption": dict(lora_opts=dict(max_loras=3), num_kv_blocks=10),
    # One slot, one adapter in host memory: adapters take turns (requests of the loaded one run,
    # the others wait their turn), and a second run reads each one from disk again.
    "one-slot": dict(lora_opts=dict(max_loras=1, max_cpu_loras=1), num_kv_blocks=256),
}


def lora_llm(base, adapters, lora_opts, **kw) -> LLM:
    return LLM(str(base), **{"dtype": "float32", "block_size": 8, "max_num_seqs": 8, **kw},
               lora=dict(adapters=adapters, max_lora_rank=8, **lora_opts))
