"""FP8 / INT4 layers (engine.model.gpu_quant) with the engine's other features, on CPU under Triton's
interpreter: LoRA adapters on a quantized base, tensor parallelism over a dense checkpoint rounded at
load and over a quantized checkpoint (each rank cutting its share of the file's blocks).

Oracles are exact up to summation order: HF transformers (+ PEFT for adapters) in float32 on the weights
the engine de-quantizes to. Under tensor parallelism each rank rounds its own shard, so the oracle rounds
each rank's shard with the engine's own rounding (fp8_from_dense / int4_from_dense). INT4 groups of 128
that the shards' edges never cut give exactly the TP=1 weights, so TP=2 must give TP=1's tokens; FP8 keeps
a scale per output row of each shard, and the row-parallel layers (o_proj, down_proj) hold half a row per
rank: their scales differ from TP=1's (another model, slightly), and TP=2 is checked against its own oracle.
"""

from __future__ import annotations

import copy
import multiprocessing

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import ModelLoadError
from engine.model.gpu_quant import QuantWeights, fp8_from_dense, int4_from_dense
from tests.factories import make_lora_dir
from tests.test_gpu_quant_engine import (FUSED, OPTIONS, PROJ, _hf_greedy, _hf_name, _oracle,
                                         checkpoints, gqa, needs_interpreter)

pytestmark = pytest.mark.timeout(300)

__all__ = ["checkpoints", "gqa"]  # fixtures of tests.test_gpu_quant_engine, used here

PROMPTS = [[5, 9, 200, 17], list(range(3, 30)), [300] * 3]
MAX_NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
"""As HF's ``min_new_tokens`` (tests.test_gpu_quant_engine._hf_greedy): EOS masked, not just ignored. With
``ignore_eos`` the engine may pick EOS where HF cannot, as the TP model's fp8 rounding does (token 2)."""
SCORED = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")
"""Projections whose input features are split across tensor-parallel ranks."""


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def _prompt_logprob_error(out, prompt, hf) -> float:
    """Largest gap between the engine's prompt log-probabilities and ``hf``'s, in nats."""
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), -1)
    return max(abs(out.prompt_logprobs[i][prompt[i]] - want[i - 1, prompt[i]].item()) for i in range(1, len(prompt)))


def _engine_weights(model, hf_config) -> dict[str, torch.Tensor]:
    """Every decoder projection the engine serves, de-quantized, by HF name (one rank: TP=1)."""
    out = {}
    for layer in range(hf_config.num_hidden_layers):
        for fused, parts in FUSED.items():
            module = model.layers[layer].get_submodule(fused)
            assert isinstance(module.wq, QuantWeights) and module.weight.numel() == 0, (layer, fused)
            for proj, w in zip(parts, _split_parts(module, module.wq.dequantize(), fused)):
                out[_hf_name(layer, proj)] = w
    return out


def _split_parts(module, dense: torch.Tensor, fused: str) -> list[torch.Tensor]:
    """A fused layer's [N, K] weight back into its checkpoint parts (tests.test_gpu_quant_engine._split,
    but with the layer's own head_dim, which a config may set apart from hidden / heads)."""
    if fused == "self_attn.qkv_proj":
        sizes = [module.local_heads * module.head_dim] + [module.local_kv_heads * module.head_dim] * 2
    elif fused == "mlp.gate_up_proj":
        sizes = [dense.shape[0] // 2] * 2
    else:
        sizes = [dense.shape[0]]
    assert sum(sizes) == dense.shape[0] == module.out_features
    return list(dense.split(sizes))


def _with_adapter(hf, adapter: str | None):
    """``hf`` (copied) with a PEFT adapter on top; ``hf`` itself for None."""
    if adapter is None:
        return hf
    from peft import PeftModel
    return PeftModel.from_pretrained(copy.deepcopy(hf), adapter).eval()


# --- 1. LoRA adapters on a quantized base ------------------------------------------------------------

LORA_ADAPTERS = {  # name: (rank, modules, extra PEFT options)
    "all-r4": (4, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), {}),
    "qv-down-r8": (8, ("q_proj", "v_proj", "down_proj"), {"use_rslora": True}),
}


@pytest.fixture(scope="module")
def adapters(gqa, tmp_path_factory):
    dense_dir, _ = gqa
    root = tmp_path_factory.mktemp("quant-adapters")
    return {name: str(make_lora_dir(dense_dir, root / name, rank=r, seed=10 + i, modules=mods, scale=0.5, **extra))
            for i, (name, (r, mods, extra)) in enumerate(LORA_ADAPTERS.items())}


@needs_interpreter
@pytest.mark.parametrize("method", ["fp8", "int4", "awq"])
def test_lora_on_quantized_base_equals_hf_peft(gqa, checkpoints, adapters, method):
    """A batch mixing the base model and two adapters (two slots) on FP8 / INT4 layers rounded at load, and
    on an AWQ checkpoint: each request gives what HF + PEFT gives on the de-quantized base alone."""
    dense_dir, hf = gqa
    lora = dict(adapters=adapters, max_lora_rank=8, max_loras=2)
    if method == "awq":
        path, _, _ = checkpoints("awq")
        llm = LLM(str(path), lora=lora, **OPTIONS)
    else:
        llm = LLM(str(dense_dir), quantization=method, lora=lora, **OPTIONS)
    runner = llm.engine.runner
    assert runner.quantization == method
    for layer in runner.model.layers:
        for fused in FUSED:
            module = layer.get_submodule(fused)
            assert module.wq is not None and module.lora is not None, fused  # both paths run in one product
    base = _oracle(hf, _engine_weights(runner.model, hf.config))

    plan = [(p, name) for p in PROMPTS for name in (None, *adapters)]
    got = _tokens(llm.generate([{"prompt_token_ids": p} for p, _ in plan], GREEDY, lora=[n for _, n in plan]))
    oracles = {name: _with_adapter(base, adapters.get(name)) for name in (None, *adapters)}
    want = [_hf_greedy(oracles[name], p, MAX_NEW) for p, name in plan]
    assert got == want
    # Each adapter changes what the quantized base says (else a dropped LoRA delta would pass).
    by = {(tuple(p), name): tokens for (p, name), tokens in zip(plan, got)}
    for name in adapters:
        assert all(by[tuple(p), name] != by[tuple(p), None] for p in PROMPTS), name

    # Prompt log-probabilities through every adapter, within summation order of PEFT's.
    scored = [(p, name) for p in PROMPTS[:2] for name in adapters]
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in scored], SCORED, lora=[n for _, n in scored])
    for (p, name), out in zip(scored, outs):
        err = _prompt_logprob_error(out, p, oracles[name])
        assert err < 1e-4, (name, p[:4], err)
    assert llm.engine.block_manager.num_used == 0 and not llm.engine.lora.running


# --- 2. tensor parallelism over a dense checkpoint rounded at load -----------------------------------

TP_MODEL = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64)
"""Every rank's input widths are multiples of INT4's group of 128: q/k/v and gate/up read the whole
hidden 128; o_proj reads 4 heads x 64 = 256 inputs, 128 a rank; down_proj 256, 128 a rank. (With the
other file's model, heads of 32, o_proj would get 64 inputs a rank, which int4 rounds in groups of 64.)
Narrow outputs keep the interpreter's programs few (its time grows with them)."""
TP_OPTIONS = dict(OPTIONS, num_kv_blocks=64, max_num_seqs=8)
"""Every request of a test in one wave: fewer steps, each costing the interpreter's time for all layers."""


@pytest.fixture(scope="module")
def tp_case(tmp_path_factory):
    """The TP model's directory, its HF model and an adapter of it."""
    import transformers

    path = tmp_path_factory.mktemp("tp-quant")
    config = transformers.LlamaConfig(max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=0,
                                      eos_token_id=2, pad_token_id=0, **TP_MODEL)
    torch.manual_seed(7)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # widened as tests.factories.make_model does: greedy paths differ between prompts
        for p in hf.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 2.0 / p.shape[1] ** 0.5)
    hf.save_pretrained(path, safe_serialization=True)
    adapter = make_lora_dir(path, tmp_path_factory.mktemp("tp-adapter") / "a", rank=4, seed=3, scale=0.5)
    return path, hf, str(adapter)


def _round(w: torch.Tensor, method: str) -> torch.Tensor:
    """The engine's own rounding of one [N, K] weight, de-quantized (per output row: a fused layer's
    parts round as they would alone)."""
    return (fp8_from_dense if method == "fp8" else int4_from_dense)(w).dequantize()


def _tp_weights(hf, method: str, world: int) -> dict[str, torch.Tensor]:
    """What ``world`` ranks serve, joined back by HF name: column-parallel layers rounded whole (their
    rows are whole on every rank), row-parallel ones rounded a rank's input shard at a time."""
    state = hf.state_dict()
    out = {}
    for layer in range(hf.config.num_hidden_layers):
        for proj in PROJ:
            w = state[_hf_name(layer, proj)]
            out[_hf_name(layer, proj)] = (torch.cat([_round(s, method) for s in w.chunk(world, 1)], 1)
                                          if proj in ROW_PARALLEL else _round(w, method))
    return out


def _rank_slice(weights: dict[str, torch.Tensor], layer: int, fused: str, module) -> torch.Tensor:
    """Rank ``module.group.rank``'s part of a fused layer, cut from the joined weights (HF names)."""
    rank, world = module.group.rank, module.group.world_size
    parts = [weights[_hf_name(layer, p)] for p in FUSED[fused]]
    if fused == "self_attn.qkv_proj":
        d, h = module.head_dim, module.heads
        q, k, v = parts
        return torch.cat([q[h.q_start * d:(h.q_start + h.q_count) * d],
                          k[h.kv_start * d:(h.kv_start + h.kv_count) * d],
                          v[h.kv_start * d:(h.kv_start + h.kv_count) * d]])
    if fused in ROW_PARALLEL:
        return parts[0][:, module.in_start:module.in_start + module.in_features]
    return torch.cat([p.chunk(world, 0)[rank] for p in parts])


@needs_interpreter
@pytest.mark.parametrize("method", ["int4", "fp8"])
def test_tensor_parallel_rounded_at_load_equals_tp1_and_hf(tp_case, method):
    """TP=2 with ``quantization: fp8 | int4`` of a dense checkpoint: rank 0 holds its shards rounded as the
    oracle rounds them; greedy tokens (base model and an adapter, one batch) equal TP=1's with the same
    quantization and HF (+ PEFT)'s on the oracle's weights; prompt log-probabilities within 1e-4 nats."""
    path, hf, adapter = tp_case
    lora = dict(adapters={"a": adapter}, max_lora_rank=4, max_loras=1)
    plan = [(p, name) for p in PROMPTS for name in (None, "a")]
    requests = [{"prompt_token_ids": p} for p, _ in plan]
    names = [n for _, n in plan]

    tp1 = LLM(str(path), quantization=method, lora=lora, **TP_OPTIONS)
    one = _engine_weights(tp1.engine.runner.model, hf.config)
    tp1_tokens = _tokens(tp1.generate(requests, GREEDY, lora=names))
    del tp1
    # TP=1 holds exactly this file's rounding of the whole weights.
    assert all(torch.equal(w, _round(hf.state_dict()[n], method)) for n, w in one.items())

    weights = _tp_weights(hf, method, 2)
    changed = [n for n in weights if not torch.equal(weights[n], one[n])]
    if method == "int4":  # shards cut no group: the very same weights
        assert not changed
    else:  # a scale per row of each rank's half row: only the row-parallel layers differ
        assert changed and all(n.endswith(tuple(f"{p}.weight" for p in ROW_PARALLEL)) for n in changed), changed
    base = _oracle(hf, weights)
    oracles = {None: base, "a": _with_adapter(base, adapter)}

    llm = LLM(str(path), quantization=method, tensor_parallel_size=2, lora=lora, **TP_OPTIONS)
    try:
        runner = llm.engine.runner
        assert runner.quantization == method and runner.group.world_size == 2
        for layer, block in enumerate(runner.model.layers):
            for fused in FUSED:
                module = block.get_submodule(fused)
                wq = module.wq
                assert isinstance(wq, QuantWeights) and wq.kind == method, (layer, fused)
                if method == "int4":
                    assert wq.group == 128, (layer, fused, wq.group)
                assert torch.equal(wq.dequantize(), _rank_slice(weights, layer, fused, module)), (layer, fused)
        # The worker ran its rounding too: rank 1's parameter bytes match rank 0's.
        sizes = llm.engine.tp.rank_param_bytes
        assert len(sizes) == 2 and sizes[0] == sizes[1], sizes

        got = _tokens(llm.generate(requests, GREEDY, lora=names))
        assert got == [_hf_greedy(oracles[n], p, MAX_NEW) for p, n in plan]
        # int4: the very weights of TP=1, so its tokens. Not fp8: its o_proj / down_proj scales per half row
        # move prompt log-probabilities by up to 0.4 nats from TP=1's on this model, and the adapter's
        # second prompt takes another greedy path from its third token (the oracle above is TP=2's own).
        if method == "int4":
            assert got == tp1_tokens
        by = {(tuple(p), n): t for (p, n), t in zip(plan, got)}
        assert all(by[tuple(p), "a"] != by[tuple(p), None] for p in PROMPTS)  # the adapter is applied
        outs = llm.generate(requests, SCORED, lora=names)
        for (p, n), out in zip(plan, outs):
            err = _prompt_logprob_error(out, p, oracles[n])
            assert err < 1e-4, (n, p[:4], err)
    finally:
        llm.shutdown()
    assert not multiprocessing.active_children()


# --- 3. a quantized checkpoint under tensor parallelism ----------------------------------------------

@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors"])
def test_quantized_checkpoint_sharded_gives_tp1_tokens_and_hf(checkpoints, fmt):
    """TP=2 over a checkpoint's own quantization: each rank cuts every part to its share (rows with their
    scales; input features in whole groups, GPTQ's 32 here) and holds exactly its slice of the checkpoint's
    de-quantized weights; greedy tokens equal TP=1's and HF's on those weights, prompt log-probabilities
    within 1e-4 nats. With the interpreter the ranks run the kernels; without it each rank de-quantizes
    its cut at load."""
    import engine.model.quant_checkpoint as qc

    path, weights, oracle = checkpoints(fmt)
    requests = [{"prompt_token_ids": p} for p in PROMPTS]
    tp1 = LLM(str(path), **OPTIONS)
    tp1_tokens = _tokens(tp1.generate(requests, GREEDY))
    del tp1
    shares = []  # rank 0 loads in this process: what it read of each large tensor
    read_share = qc.read_share

    def counted(sl, *args):
        shares.append((read_share(sl, *args), sl.get_shape()))
        return shares[-1][0]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(qc, "read_share", counted)
        llm = LLM(str(path), tensor_parallel_size=2, **OPTIONS)
    read = [(t, shape) for t, shape in shares if t is not None]  # None: small tensors, read whole
    # every layer's seven large tensors, each read as half of its whole
    assert len(read) == 2 * 7 and all(2 * t.numel() == torch.Size(shape).numel() for t, shape in read)
    try:
        for layer, block in enumerate(llm.engine.runner.model.layers):
            for fused in FUSED:
                module = block.get_submodule(fused)
                held = module.wq.dequantize() if module.wq is not None else module.weight.data
                assert torch.equal(held, _rank_slice(weights, layer, fused, module)), (layer, fused)
        got = _tokens(llm.generate(requests, GREEDY))
        assert got == tp1_tokens == [_hf_greedy(oracle, p, MAX_NEW) for p in PROMPTS]
        for prompt, out in zip(PROMPTS, llm.generate(requests, SCORED)):
            assert _prompt_logprob_error(out, prompt, oracle) < 1e-4, prompt[:4]
    finally:
        llm.shutdown()
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("fmt,width,what", [("awq", 128, "groups"), ("fp8", 128, "scale blocks")])
def test_a_split_inside_groups_or_blocks_is_refused_before_workers_start(checkpoints, fmt, width, what):
    """o_proj's 128 input features split at 64 cut AWQ's 128-wide groups and FP8's 128 x 128 blocks:
    refused by name before any worker starts."""
    path, _, _ = checkpoints(fmt)
    with pytest.raises(ModelLoadError, match=rf"{fmt} checkpoint: tensor_parallel_size 2 splits every o_proj's "
                                             rf"input features at 64, inside its {width}-wide {what}"):
        LLM(str(path), tensor_parallel_size=2, **OPTIONS)
    assert not multiprocessing.active_children()


def test_the_loader_cuts_scale_blocks_whole_or_refuses():
    """Blocks found from a scale's shape (compressed-tensors names none in its config): a cut between blocks
    keeps theirs, one inside a block names the tensor."""
    from engine.model.gpu_quant import QuantScheme
    from engine.model.quant_checkpoint import _fp8_parts
    scheme = QuantScheme("fp8", "compressed-tensors")
    part = {"weight": torch.randn(256, 256).to(torch.float8_e4m3fn), "weight_scale": torch.tensor([[1., 2.], [3., 4.]])}
    held = _fp8_parts(["layers.0.mlp.down_proj"], [part], scheme, [(slice(128, 192), slice(128, 256))])
    assert held.block == (1, 128) and torch.equal(held.scale, torch.full((64, 1), 4.0))
    assert torch.equal(held.weight.float(), part["weight"][128:192, 128:].float())
    with pytest.raises(ModelLoadError, match=r"layers.0.mlp.down_proj: tensor parallelism splits its input "
                                             r"features at 64 and 192, inside its 128-wide scale blocks"):
        _fp8_parts(["layers.0.mlp.down_proj"], [part], scheme, [(None, slice(64, 192))])


@pytest.mark.parametrize("source", ["awq", "gptq", "compressed-tensors"])
def test_a_rank_reads_its_share_of_a_large_tensor_as_the_whole_tensor_cut(tmp_path, source):
    """``read_share`` reads only a rank's rows or input features of an int4 ``qweight`` or an FP8
    weight from the file; the layer built from it equals the one built from the whole tensor cut
    after reading. A cut that is no whole packed word is read whole (the builder cuts or refuses)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from engine.model.gpu_quant import QuantScheme
    from engine.model.quant_checkpoint import CUT, SHAPES, _fp8_parts, _int4_parts, read_share

    gen = torch.Generator().manual_seed(3)
    words = lambda *shape: torch.randint(-2 ** 31, 2 ** 31 - 1, shape, generator=gen, dtype=torch.int32)  # noqa: E731
    n = k = 256
    if source == "compressed-tensors":
        scheme, big = QuantScheme("fp8", source), "weight"
        tensors = {"weight": torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn), "weight_scale": torch.rand(n, 1)}
    else:
        scheme, big = QuantScheme("int4", source, group=32), "qweight"
        tensors = {"qweight": words(k, n // 8) if source == "awq" else words(k // 8, n),
                   "qzeros": words(k // 32, n // 8), "scales": torch.rand(k // 32, n, generator=gen).half()}
    save_file(tensors, tmp_path / "layer.safetensors")
    build = _fp8_parts if scheme.kind == "fp8" else _int4_parts
    with safe_open(tmp_path / "layer.safetensors", "pt") as f:
        for shard in [(slice(128, 256), None), (None, slice(0, 128))]:
            share = read_share(f.get_slice(big), big, source, shard)
            assert 2 * share.numel() == tensors[big].numel()
            held = {**tensors, big: share, CUT: True, SHAPES: {big: tuple(tensors[big].shape)}}
            got, want = build(["l"], [held], scheme, [shard]), build(["l"], [dict(tensors)], scheme, [shard])
            assert all(torch.equal(a.float(), b.float()) for a, b in zip(got.buffers(), want.buffers()))
        assert read_share(f.get_slice(big), big, source, (None, None)) is None  # one rank: whole
        assert read_share(f.get_slice("scales" if big == "qweight" else "weight_scale"),
                          "scales", source, (slice(64, 128), None)) is None  # small tensors: whole
        if source == "awq":
            assert read_share(f.get_slice(big), big, source, (slice(60, 124), None)) is None
