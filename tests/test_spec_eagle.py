"""Speculative decoding with an EAGLE-3 head (engine.spec_eagle): the drafts are the head's own greedy
chain, computed here from HF's hidden states by a reference written from the published layout, and
the output equals the output without speculation, token for token, whatever the head proposes.

Heads are random, of the published checkpoint layout, written by the test. The "near" head reads
the target's embedding stream (layer 0's input) through an identity ``fc``, has no attention or MLP
output, and its LM head maps each token's embedding to the token two places on in the copy model's
cycle: its first draft is mostly right, its later ones (which chain its own output) mostly wrong.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from engine import LLM, SamplingParams
from engine.errors import ModelLoadError
from tests.factories import make_model
from tests.test_spec_decode import (BASE, TP_PARAMS, TP_PROMPTS, VOCAB, _copying, _prompts, _run,  # noqa: F401
                                    copy_model, tensor_parallel_matches_one_rank)

def _eagle(path, k: int = 3) -> dict:
    return {"method": "eagle3", "model": str(path), "num_speculative_tokens": k, "cost_model": False}


def head_weights(hidden: int, vocab: int, draft_vocab: int, seed: int, heads: int = 4, kv_heads: int = 2) -> dict:
    """A random head of EAGLE-3's layout (names as its checkpoints write them)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * (2.0 / shape[-1] ** 0.5)

    d, inter = hidden // heads, 2 * hidden
    w = {"fc.weight": rand(hidden, 3 * hidden), "norm.weight": 1 + 0.1 * rand(hidden, 1)[:, 0],
         "lm_head.weight": rand(draft_vocab, hidden),
         "midlayer.self_attn.q_proj.weight": rand(heads * d, 2 * hidden),
         "midlayer.self_attn.k_proj.weight": rand(kv_heads * d, 2 * hidden),
         "midlayer.self_attn.v_proj.weight": rand(kv_heads * d, 2 * hidden),
         "midlayer.self_attn.o_proj.weight": rand(hidden, heads * d),
         "midlayer.mlp.gate_proj.weight": rand(inter, hidden), "midlayer.mlp.up_proj.weight": rand(inter, hidden),
         "midlayer.mlp.down_proj.weight": rand(hidden, inter)}
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        w[f"midlayer.{norm}.weight"] = 1 + 0.1 * rand(hidden, 1)[:, 0]
    chosen = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    w["d2t"] = chosen - torch.arange(draft_vocab)
    w["t2d"] = torch.zeros(vocab, dtype=torch.bool)
    w["t2d"][chosen] = True
    return w


def write_head(path, weights: dict, vocab: int, aux=None, speculators: bool = False, **config):
    """Save ``weights`` as an EAGLE-3 checkpoint: EAGLE-3's own config, or speculators' (its decoder
    layer's shape nested, the layer under ``layers.0.``)."""
    path.mkdir(parents=True, exist_ok=True)
    hidden = weights["norm.weight"].shape[0]
    layer = {"hidden_size": hidden, "intermediate_size": weights["midlayer.mlp.up_proj.weight"].shape[0],
             "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": vocab,
             "rms_norm_eps": 1e-6, "max_position_embeddings": 1024, "rope_theta": 10000.0}
    cfg = {"draft_vocab_size": weights["lm_head.weight"].shape[0]}
    if aux is not None:
        cfg["eagle_aux_hidden_state_layer_ids"] = list(aux)
    if speculators:
        cfg |= {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                "transformer_layer_config": layer}
        weights = {k.replace("midlayer.", "layers.0."): v for k, v in weights.items()}
    else:
        cfg |= {"architectures": ["LlamaForCausalLMEagle3"], **layer}
    cfg |= config
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta=10000.0):
    d = x.shape[-1]
    freqs = torch.outer(pos.double(), 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)).float()
    cos, sin = torch.cat([freqs.cos()] * 2, -1)[:, None], torch.cat([freqs.sin()] * 2, -1)[:, None]
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class ReferenceHead:
    """EAGLE-3's head over a whole sequence, from its layout's description (no paging, no batching)."""

    def __init__(self, w: dict, embed: torch.Tensor, heads: int = 4, kv_heads: int = 2):
        self.w, self.embed, self.heads, self.kv_heads = w, embed, heads, kv_heads

    def _layer(self, tokens, hidden, past):
        """Outputs at the new positions, attending to ``past`` (keys, values) and themselves."""
        w, p = self.w, "midlayer."
        residual = hidden
        x = torch.cat([_rms(self.embed[tokens], w[p + "input_layernorm.weight"]),
                       _rms(hidden, w[p + "hidden_norm.weight"])], -1)
        d = hidden.shape[-1] // self.heads
        pos = torch.arange(len(past[0]), len(past[0]) + len(tokens))
        q = _rope((x @ w[p + "self_attn.q_proj.weight"].T).view(-1, self.heads, d), pos)
        k = _rope((x @ w[p + "self_attn.k_proj.weight"].T).view(-1, self.kv_heads, d), pos)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(-1, self.kv_heads, d)
        keys, values = torch.cat([past[0], k]), torch.cat([past[1], v])
        rep = self.heads // self.kv_heads
        scores = torch.einsum("qhd,khd->hqk", q, keys.repeat_interleave(rep, 1)) / math.sqrt(d)
        mask = torch.arange(len(keys))[None, :] > pos[:, None]
        att = torch.einsum("hqk,khd->qhd", scores.masked_fill(mask, -math.inf).softmax(-1),
                           values.repeat_interleave(rep, 1))
        x = residual + att.reshape(len(tokens), -1) @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"])
        mlp = (torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T))
        return x + mlp @ w[p + "mlp.down_proj.weight"].T, (keys, values)

    def _token(self, out):
        best = int((_rms(out, self.w["norm.weight"]) @ self.w["lm_head.weight"].T).argmax())
        return best + int(self.w["d2t"][best])

    def drafts(self, tokens: list[int], streams: torch.Tensor, k: int) -> list[int]:
        """The k greedy drafts after ``tokens`` (t_0..t_n); ``streams``: the target's at 0..n-1."""
        empty = torch.empty(0, self.kv_heads, streams.shape[-1] // 3 // self.heads)
        out, past = self._layer(torch.tensor(tokens[1:]), streams @ self.w["fc.weight"].T, (empty, empty))
        drafts, last = [self._token(out[-1])], out[-1:]
        while len(drafts) < k:
            last, past = self._layer(torch.tensor(drafts[-1:]), last, past)
            drafts.append(self._token(last[0]))
        return drafts


def _record_proposals(engine) -> list:
    """(the request's tokens, its drafts) of every proposal the engine's head makes."""
    seen, propose = [], engine.drafter.propose

    def recording(chunks, costs=None):
        propose(chunks, costs)
        seen.extend((list(c.request.token_ids), list(c.draft_token_ids)) for c in chunks)

    engine.drafter.propose = recording
    return seen


def near_weights(vocab: int = VOCAB, attention: float = 0.0, embedding_stream: int = 0) -> dict:
    """The module docstring's near head for the copy model (whose cycle is its LM head's successors),
    its attention's output scaled by ``attention`` (0: none); ``fc`` reads the embedding as its
    ``embedding_stream``-th stream."""
    model = _copying("llama", vocab)
    embed = model.model.embed_tokens.weight.detach()
    successor = (model.lm_head.weight.detach() @ embed.T).argmax(dim=0)  # row s scores s as each token's successor
    w = head_weights(64, vocab, vocab, seed=6)
    w["fc.weight"] = torch.zeros(64, 3 * 64)
    w["fc.weight"][:, 64 * embedding_stream:64 * (embedding_stream + 1)] = torch.eye(64)
    w["midlayer.self_attn.o_proj.weight"].mul_(attention)
    w["midlayer.mlp.down_proj.weight"].zero_()
    w["midlayer.hidden_norm.weight"] = torch.ones(64)
    w["norm.weight"] = torch.ones(64)
    lm_head = torch.zeros(vocab, 64)
    lm_head[successor[successor]] = embed  # the token two on in its cycle
    w["lm_head.weight"], w["d2t"] = lm_head, torch.zeros(vocab, dtype=torch.int64)
    return w


@pytest.mark.parametrize("speculators,tp", [(False, 1), (True, 1), (False, 2)],
                         ids=["eagle3-layout", "speculators-layout", "eagle3-layout-tp2"])
def test_drafts_are_the_heads_greedy_chain_over_the_targets_hidden_states(copy_model, tmp_path, speculators, tp):
    """Prompts in chunks of 16 beside verifying decodes: the head catches up across chunks and after
    each verify (accepted drafts included), and each proposal equals the reference's, computed afresh
    from the request's tokens. The head's attention counts: its drafts read its KV and the embedding
    of its tokens (with tensor_parallel_size 2, rank 0's copy of every rank's rows)."""
    w = near_weights(attention=0.5, embedding_stream=1)
    head = write_head(tmp_path / "head", w, VOCAB, aux=(1, 0, 1), speculators=speculators)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = _prompts(7, (5, 19, 40))
    want, _ = _run(copy_model[0], prompts, params, **BASE)
    llm = LLM(str(copy_model[0]), **{**BASE, "max_num_batched_tokens": 16}, tensor_parallel_size=tp,
              speculative_config=_eagle(head, 3))
    proposals = _record_proposals(llm.engine)
    try:
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = llm.engine.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    target = _copying("llama", VOCAB)  # the copy model's weights
    reference = ReferenceHead(w, target.model.embed_tokens.weight.detach())
    assert len(proposals) >= 12
    with torch.no_grad():
        for tokens, drafts in proposals:
            hs = target(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
            streams = torch.cat([hs[1][0], hs[0][0], hs[1][0]], -1)  # the inputs of layers 1, 0, 1
            assert drafts == reference.drafts(tokens, streams, len(drafts)), len(tokens)
    llm.engine.block_manager.check_invariants()
    assert llm.engine.block_manager.num_free == llm.engine.block_manager.num_blocks


def test_the_default_streams_are_layers_2_half_and_3_from_the_end(tmp_path):
    """Without ``eagle_aux_hidden_state_layer_ids`` the head reads the inputs of layers 2, L/2, L-3."""
    target = make_model("llama", seed=0, vocab_size=VOCAB, layers=6)
    target.save_pretrained(tmp_path / "target")
    w = head_weights(64, VOCAB, 96, seed=5)
    head = write_head(tmp_path / "head", w, VOCAB)
    llm = LLM(str(tmp_path / "target"), **BASE, speculative_config=_eagle(head, 2))
    assert llm.engine.runner.model.aux_layers == (2, 3, 3)
    proposals = _record_proposals(llm.engine)
    llm.generate([{"prompt_token_ids": _prompts(8, (11,))[0]}], SamplingParams(temperature=0, max_tokens=6))
    reference = ReferenceHead(w, target.model.embed_tokens.weight.detach())
    tokens, drafts = proposals[0]
    with torch.no_grad():
        hs = target(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
    assert drafts == reference.drafts(tokens, torch.cat([hs[2][0], hs[3][0], hs[3][0]], -1), len(drafts))


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    return {"near": write_head(root / "near", near_weights(), VOCAB, aux=(0, 1, 1)),
            "random": write_head(root / "random", head_weights(64, VOCAB, 128, seed=8), VOCAB, aux=(1, 0, 1))}


def _same(path, head, prompts, params, k: int = 3, **options):
    options = {**BASE, **options}
    want, plain = _run(path, prompts, params, **options)
    got, engine = _run(path, prompts, params, speculative_config=_eagle(head, k), **options)
    for w, g in zip(want, got):
        assert [(c.token_ids, c.finish_reason, c.text) for c in g.outputs] == \
               [(c.token_ids, c.finish_reason, c.text) for c in w.outputs]
    return engine.stats(), plain.stats()


def test_a_near_head_is_often_right_a_random_one_wrong_and_the_output_stays_exact(copy_model, heads):
    path = copy_model[0]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    stats, plain = _same(path, heads["near"], _prompts(0), params)
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert stats.spec_decode_num_accepted_tokens_per_pos[0] > 0.6 * stats.spec_decode_num_drafts
    assert stats.num_steps < plain.num_steps
    stats, _ = _same(path, heads["random"], _prompts(1, (5, 20, 43)), params)
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens < 0.2 * stats.spec_decode_num_draft_tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_head_on_cuda_gives_the_tokens_without_it(copy_model, heads):
    """On a GPU, the pools sized by the GPU memory budget with the head's weights and pool counted;
    the target's steps eager here (captured ones: tests/test_verify_graphs.py)."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    stats, _ = _same(copy_model[0], heads["near"], _prompts(0), params, device="cuda", num_kv_blocks=None,
                     gpu_memory_utilization=0.5)
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_preemption_prefix_hits_and_sampled_requests_keep_their_tokens(copy_model, heads):
    """A preempted request drafts again once the head has read its recomputed tokens; a request
    that starts from cached blocks reads the head's KV of them; seeded sampled requests (n = 2 too)
    get the tokens they would get without drafts."""
    path, near = copy_model[0], heads["near"]
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    stats, _ = _same(path, near, _prompts(2, (20, 24, 28, 30)), greedy, num_kv_blocks=18)
    assert stats.num_preemptions > 0 and stats.spec_decode_num_accepted_tokens > 0
    prompt = _prompts(3, (13,))[0]
    stats, _ = _same(path, near, [prompt, prompt + list(range(5, 15))], greedy, max_num_seqs=1)
    assert stats.prefix_cache_hits > 0
    sampled = [SamplingParams(temperature=0.7, top_p=0.95, max_tokens=24, seed=11, n=2, ignore_eos=True),
               SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=5, logprobs=2)]
    stats, _ = _same(path, near, _prompts(6, (5, 33)), sampled)
    assert stats.spec_decode_num_accepted_tokens > 0


def test_the_compiled_target_returns_its_streams_to_the_head(copy_model, heads):
    path = copy_model[0]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want, _ = _run(path, _prompts(4), params, **BASE)
    got, engine = _run(path, _prompts(4), params, **BASE, enforce_eager=False, speculative_config=_eagle(heads["near"]))
    assert engine.runner.compiled is not None
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert engine.stats().spec_decode_num_accepted_tokens > 0
    # The head's pool: the target's blocks, one layer.
    assert engine.drafter.kv_cache[0].shape[0] == engine.runner.num_blocks + 1


def _broken(tmp_path, name: str, edit) -> str:
    w = head_weights(64, VOCAB, 128, seed=9)
    cfg = {"eagle_aux_hidden_state_layer_ids": [0, 1, 1]}
    edit(w, cfg)
    return str(write_head(tmp_path / name, w, VOCAB, **cfg))


@pytest.mark.parametrize("name, edit, message", [
    ("no-fc", lambda w, c: w.pop("fc.weight"), "lacks weights for: fc.weight"),
    ("bad-d2t", lambda w, c: w["d2t"].add_(VOCAB), "d2t maps draft tokens outside the target's vocabulary"),
    ("narrow-fc", lambda w, c: w.__setitem__("fc.weight", w["fc.weight"][:, :128]), "fc.weight: .*shape \\(64, 128\\)"),
    ("aux", lambda w, c: c.update(eagle_aux_hidden_state_layer_ids=[0, 1, 2]),
     "eagle_aux_hidden_state_layer_ids \\[0, 1, 2\\] must name 3 layers of the target's 2"),
    ("vocab", lambda w, c: c.update(vocab_size=512), "vocab_size 512 is not the target's \\(384\\)"),
    ("not-eagle", lambda w, c: c.update(architectures=["LlamaForCausalLM"]), "is not an EAGLE-3 head"),
])
def test_a_head_that_cannot_serve_the_target_is_refused_by_name(copy_model, tmp_path, name, edit, message):
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(copy_model[0]), **BASE, speculative_config=_eagle(_broken(tmp_path, name, edit)))


def test_options_that_do_not_apply_are_refused(copy_model, heads):
    with pytest.raises(ValueError, match="model \\(the draft model, or the EAGLE-3 head\\) is required"):
        LLM(str(copy_model[0]), **BASE, speculative_config={"method": "eagle3", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="quantization is the draft model's"):
        LLM(str(copy_model[0]), **BASE, speculative_config={**_eagle(heads["near"]), "quantization": "int8"})


@pytest.mark.timeout(180)
def test_tensor_parallel_target_with_the_head_on_rank_0(copy_model, heads):
    """tensor_parallel_size 2: rank 0 keeps the layers' streams for the head and gets every rank's
    embedding rows at start, so the head drafts as it does on one rank; every rank verifies."""
    from safetensors.torch import load_file

    engine, stats = tensor_parallel_matches_one_rank(copy_model[0], _eagle(heads["near"]))
    assert engine.runner.group.world_size == 2
    embed = load_file(copy_model[0] / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(engine.runner.whole_embedding, embed)  # both halves of the vocabulary
    _, one_rank = _run(copy_model[0], TP_PROMPTS, TP_PARAMS, num_kv_blocks=16, speculative_config=_eagle(heads["near"]))
    alone = one_rank.stats()
    assert stats.spec_decode_num_accepted_tokens_per_pos[0] > 0
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_accepted_tokens_per_pos) == \
           (alone.spec_decode_num_drafts, alone.spec_decode_num_accepted_tokens_per_pos)


def test_logprobs_lora_and_grammars_keep_their_meaning(copy_model, heads, tmp_path):
    """Logprobs and prompt logprobs are each position's; a LoRA request's streams are its adapter's
    (the head reads them) and it keeps its tokens; a grammar request decodes one token a step, as
    with a draft model (its drafts would come after scheduling, unchecked)."""
    from tests.factories import make_lora_dir

    path, near = copy_model[0], heads["near"]
    scored = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    grammar = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"regex": "([ab][cd] ){4,30}x"})
    adapter = make_lora_dir(path, tmp_path / "adapter", rank=4, seed=2, scale=0.05)
    prompts = [{"prompt_token_ids": p} for p in _prompts(23, (10, 20))]
    outs = {}
    for name, spec in (("plain", None), ("drafts", _eagle(near))):
        llm = LLM(str(path), **BASE, lora={"adapters": {"small": str(adapter)}, "max_loras": 2},
                  speculative_config=spec)
        outs[name] = (llm.generate(prompts, scored, lora="small"), llm.generate(prompts, scored),
                      llm.generate(prompts[:1], grammar))
        llm.engine.block_manager.check_invariants()
    for want, got in zip(outs["plain"], outs["drafts"]):
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        for w, g in zip(want, got):
            if w.prompt_logprobs is not None:
                assert [sorted(e) for e in g.prompt_logprobs[1:]] == [sorted(e) for e in w.prompt_logprobs[1:]]
            for a, b in zip(w.outputs[0].logprobs or (), g.outputs[0].logprobs or ()):
                assert sorted(a) == sorted(b) and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    adapted, base, constrained = outs["drafts"]
    assert [o.outputs[0].token_ids for o in outs["plain"][0]] != [o.outputs[0].token_ids for o in outs["plain"][1]]
    assert sum(o.timing.num_accepted_tokens for o in adapted) > 0
    assert constrained[0].timing.num_drafts == 0


def test_the_benchmark_heads_and_copy_prompts_are_what_they_say(tmp_path):
    """benchmarks.eagle3_head writes a head of the target's shapes that the engine loads and drafts
    with; benchmarks.copy_dataset writes passages of two paragraphs the model wrote under every copy task."""
    from benchmarks import copy_dataset
    from benchmarks.eagle3_head import write_random_head
    from tests.factories import make_model_dir

    target = make_model_dir(tmp_path / "target", "llama", seed=0, vocab_size=VOCAB, layers=4)
    head = write_random_head(str(target), tmp_path / "head", draft_vocab=100)
    outs, engine = _run(target, _prompts(9, (12,)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        speculative_config=_eagle(head, 2))
    assert engine.drafter.head.ea.draft_vocab_size == 100 and engine.stats().spec_decode_num_draft_tokens > 0
    copy_dataset.main([str(tmp_path / "copy.jsonl"), "--model", str(target), "--paragraph-tokens", "6"])
    prompts = [json.loads(line)["prompt"] for line in (tmp_path / "copy.jsonl").read_text().splitlines()]
    assert len(prompts) == len(copy_dataset.TOPICS) * len(copy_dataset.TASKS)
    texts = copy_dataset.paragraphs(str(target), 6)
    for i in range(len(copy_dataset.TOPICS)):  # a passage of two paragraphs under each task
        mine = prompts[i * len(copy_dataset.TASKS):(i + 1) * len(copy_dataset.TASKS)]
        assert {p.split("\n\n", 1)[1] for p in mine} == {f"{texts[i]}\n\n{texts[(i + 1) % len(texts)]}"}
        assert {p.split("\n\n", 1)[0] for p in mine} == {t.split("\n\n")[0] for t in copy_dataset.TASKS}
