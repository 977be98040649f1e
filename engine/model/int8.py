"""int8 weights made at load from a dense checkpoint (``quantization: int8``, CPU).

A user with a safetensors model gets the lever a GGUF file gives (engine.model.quant): each linear
layer, the LM head and the embedding are rounded to llama.cpp's Q8_0 blocks (an int8 per weight and
a float16 scale per 32 weights, 8.5 bits a weight against the 16 or 32 of the checkpoint) and served
by the same kernels: packed for int8 dot products (AVX-512 VNNI or AVX2).

A scale per 32 weights rather than per output channel: a channel's largest weight then sets the step
of 32 weights, not of the whole row, so outliers cost less precision (the rounding error of one
weight is at most half its block's step, amax / 254). The blocks are gguf's own quantizer's
(``gguf.quants.quantize``), so a Q8_0 GGUF file of the same model holds the same values.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from engine.errors import ModelLoadError
from engine.model.quant import GGUFTensor, KERNEL_TYPES, hold_blocks, load_ops

logger = logging.getLogger(__name__)

BLOCK = KERNEL_TYPES["Q8_0"][1]


def q8_0_rows(weight: torch.Tensor) -> np.ndarray:
    """``weight`` [out, in] as Q8_0 blocks, one row of ``in / 32`` blocks per output feature."""
    import gguf
    return gguf.quants.quantize(weight.detach().float().numpy(), gguf.GGMLQuantizationType.Q8_0)


def _quantize(module, in_features: int) -> int:
    """Give ``module`` its dense weight's Q8_0 blocks and release the weight; returns the bytes read a
    step (0 where the width is no multiple of a block: the layer stays dense)."""
    if in_features % BLOCK:
        logger.info("%s: %d input features, no multiple of %d: it stays dense", type(module).__name__,
                    in_features, BLOCK)
        return 0
    hold_blocks(module, [GGUFTensor("weight", "Q8_0", q8_0_rows(module.weight.data))], in_features)
    module.weight.data = module.weight.data.new_empty(0)
    return sum(t.numel() * t.element_size() for t in (module.qweight, module.qscale, module.qmin) if t is not None)


def attach_int8(model) -> int:
    """Quantize every linear layer of ``model``, its LM head and its embedding (one set of blocks when
    they are tied) to Q8_0 blocks in place; returns the blocks' bytes. Under tensor parallelism each
    rank quantizes the part of each weight it holds: blocks never straddle ranks, since a
    row-parallel split falls between heads or multiples of 32 features."""
    load_ops()
    if any(p.dtype not in (torch.float32, torch.bfloat16, torch.float16) for p in model.parameters()):
        raise ModelLoadError("quantization int8 rounds float32/bfloat16/float16 weights")
    total = 0
    for layer in model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            total += _quantize(linear, linear.in_features)
    embed, head = model.embed_tokens, model.lm_head
    hidden = embed.weight.shape[1]
    tied = head.weight is embed.weight
    total += _quantize(head, hidden)
    head.hidden = embed.hidden = hidden
    if tied and head.qweight is not None:  # one set of blocks serves both
        embed.qtype, embed.qweight, embed.qscale, embed.qmin = head.qtype, head.qweight, head.qscale, head.qmin
    elif not tied:
        total += _quantize(embed, hidden)
    return total
