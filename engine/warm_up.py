"""The steps a compiled model runs at start-up, so that a replica is ready when it says so.

Each step is a real step's shape on throwaway sequences: one-token and many-token steps (the
compiled model's two graphs), decode-only steps of one and of several sequences (the CPU kernel's
C++ attention op, bound per step), and a mixed step (decodes, chunks after a cached prefix short
and long, a first chunk: every branch of the Python attention op). The sequences live in the
pool's first blocks, before any request owns one; the runner wipes them afterwards.
"""

from __future__ import annotations

import dataclasses

from engine.tp.messages import RemoteChunk

MAX_SEQS = 4
"""Sequences in the batched warm-up steps: enough for several rows everywhere, and quick."""
LONG_CHUNK = 64
"""Tokens of the long chunk after a prefix: past the CPU kernel's SDPA threshold (48 rows)."""


@dataclasses.dataclass(frozen=True)
class WarmUpStep:
    name: str
    chunks: list


class _Sequences:
    """Throwaway sequences, each with its own blocks from block 0 upwards."""

    def __init__(self, block_size: int) -> None:
        self.block_size, self.next_block, self.blocks = block_size, 0, []

    def add(self, length: int) -> int:
        need = -(-length // self.block_size)
        self.blocks.append(list(range(self.next_block, self.next_block + need)))
        self.next_block += need
        return len(self.blocks) - 1

    def chunk(self, seq: int, start: int, num_tokens: int) -> RemoteChunk:
        return RemoteChunk(start, num_tokens, True, [0] * num_tokens, self.blocks[seq])


def _plan(block_size: int, seqs: int, max_seqs: int, budget: int, max_len: int) -> tuple[list[WarmUpStep], int]:
    """Steps for ``seqs`` sequences (the batched ones) and the blocks they use."""
    prompt = max(2, min(block_size + 1, budget // seqs, max_len - 3))  # decodes cross into a second block
    # The mixed step: decodes of sequences 2.., 2 tokens after sequence 1's prefix, a long chunk
    # after sequence 0's, and a new 2-token prompt where a slot is left.
    long = min(LONG_CHUNK, budget - max(0, seqs - 2) - 4, max_len - prompt - 2)
    s = _Sequences(block_size)
    one = s.add(1)
    batch = [s.add(prompt + 2 + long if i == 0 else prompt + 3) for i in range(seqs)]
    steps = [WarmUpStep("one token", [s.chunk(one, 0, 1)]),
             WarmUpStep(f"{seqs} prompt{'s' if seqs > 1 else ''} of {prompt} tokens",
                        [s.chunk(q, 0, prompt) for q in batch])]
    if seqs > 1:
        steps.append(WarmUpStep(f"{seqs} decodes", [s.chunk(q, prompt, 1) for q in batch]))
    steps.append(WarmUpStep("1 decode", [s.chunk(batch[0], prompt + (seqs > 1), 1)]))
    if seqs > 1 and long >= 2:
        at = prompt + 1
        chunks = [s.chunk(q, at, 1) for q in batch[2:]]
        chunks += [s.chunk(batch[1], at, 2), s.chunk(batch[0], at + 1, long)]
        if seqs < max_seqs:
            chunks.append(s.chunk(s.add(2), 0, 2))
        steps.append(WarmUpStep(f"mixed: {seqs - 2} decodes, chunks of 2 and {long} tokens after a prefix"
                                f"{', a 2-token prompt' if seqs < max_seqs else ''}", chunks))
    return steps, s.next_block


def warm_up_steps(block_size: int, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                  num_blocks: int) -> list[WarmUpStep]:
    """The warm-up steps that fit the engine's limits (slots, token budget, length, KV pool)."""
    for seqs in range(min(MAX_SEQS, max_num_seqs), 0, -1):
        if seqs * 2 > max_num_batched_tokens or max_model_len < 5:
            continue
        steps, blocks = _plan(block_size, seqs, max_num_seqs, max_num_batched_tokens, max_model_len)
        if blocks <= num_blocks:
            return steps
    # The smallest engines: a one-token and a two-token first chunk, in one block each.
    s = _Sequences(block_size)
    return [WarmUpStep("one token", [s.chunk(s.add(1), 0, 1)]),
            WarmUpStep("2 tokens", [s.chunk(s.add(2), 0, 2)])]
