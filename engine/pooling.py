"""Embeddings: a prompt's final hidden states pooled and L2-normalised (``SamplingParams.pooling``),
computed by the same continuous-batching steps as any prefill.

- ``last``: the last prompt token's state, what decoder embedding models use (e5-mistral, gte-Qwen2,
  Qwen3-Embedding);
- ``mean``: the mean of every prompt token's state. Such a request reads nothing from the prefix
  cache (``Request.reads_whole_prompt``): a cached token's state was never computed here.

States are taken after the model's final norm, as HF's ``AutoModel`` returns ``last_hidden_state``.
A pooling request holds a slot only while its prompt runs: once its last chunk has run it ends with
its embedding, no token is kept for it, and its KV blocks are freed at once.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

POOLING_MODES = ("last", "mean")


def pooling_of(model_dir: Path) -> str:
    """The pooling a sentence-transformers model directory declares (``1_Pooling/config.json``):
    ``mean`` for ``pooling_mode_mean_tokens``, else ``last``, the decoder embedding models' way."""
    try:
        config = json.loads((Path(model_dir) / "1_Pooling" / "config.json").read_text())
    except (OSError, ValueError):
        return "last"
    return "mean" if config.get("pooling_mode_mean_tokens") and not config.get("pooling_mode_lasttoken") else "last"


def accumulate(order: list, hidden: torch.Tensor, norm) -> None:
    """Each pooling chunk's rows of ``hidden`` (its tokens, packed in ``order`` as the step ran
    them) into its request's ``pooled``: (sum of normed states, count) for ``mean``, the last
    prompt token's normed state for ``last``."""
    offset = 0
    for chunk in order:
        req, n = chunk.request, chunk.num_tokens
        mode = req.params.pooling
        if mode is not None:
            rows = hidden[offset:offset + n]
            if mode == "mean":
                total, count = req.pooled if chunk.start > 0 and req.pooled is not None else (0.0, 0)
                req.pooled = (total + norm(rows).float().sum(0), count + n)
            elif chunk.start + n >= req.num_prompt_tokens:
                req.pooled = norm(rows[-1:]).float()[0]
        offset += n


def embedding(req) -> list[float]:
    """The request's embedding, L2-normalised, once its whole prompt has run."""
    vector = req.pooled[0] / req.pooled[1] if req.params.pooling == "mean" else req.pooled
    return torch.nn.functional.normalize(vector, dim=-1).tolist()
