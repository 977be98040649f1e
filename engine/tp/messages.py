"""The step message rank 0 sends the other ranks: compact, and block tables as deltas.

Per chunk: ``key, start, num_tokens, samples, kept, num_new, scored_from, scored_to, lora_slot`` then
this step's token ids, then the block ids appended since the previous step. ``samples``: bit 0,
the chunk yields logits; bit 1, at every position (it verifies drafts: engine.spec_decode, so every
rank's LM head computes the same rows). ``scored_*``: the
positions whose logits score prompt tokens (``prompt_logprob_positions``): every rank's LM
head computes the same rows, since rank 0 gathers them. ``kept`` is how many leading blocks
the receiver keeps from what it holds for ``key`` (a request's ``seq_no``); a request whose
block table was replaced (preempted, readmitted) is resent whole (``kept`` = 0). Both sides
remember exactly the requests of the previous step, so nothing else has to be freed.
``lora_slot``: the adapter slot the chunk's tokens use (-1: none); what a slot holds is sent
before the step that first uses it (``LORA`` messages, engine.tp.channel).
"""

from __future__ import annotations

from dataclasses import dataclass

FIELDS = 9


@dataclass(slots=True)
class RemoteChunk:
    """What the model needs of a ScheduledChunk, on a rank that does not own the request."""

    start: int
    num_tokens: int
    samples: bool
    token_ids: list[int]
    block_ids: list[int]
    prompt_logprob_positions: range = range(0)
    lora_slot: int = -1
    speculative: bool = False
    request: None = None


class StepEncoder:
    """Rank 0: chunks -> flat list of ints."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # key -> (the block list object sent from, how many of its blocks were sent)
        self._sent: dict[int, tuple[list[int], int]] = {}

    def encode(self, chunks) -> list[int]:
        out = [len(chunks)]
        sent: dict[int, tuple[list[int], int]] = {}
        bs = self.block_size
        for c in chunks:
            key, blocks = c.request.seq_no, c.block_ids
            need = -(-(c.start + c.num_tokens) // bs)
            prev = self._sent.get(key)
            # The scheduler only appends to a running request's list and replaces it otherwise
            # (ScheduledChunk.block_ids), so the same list object means the sent prefix still holds.
            kept = prev[1] if prev is not None and prev[0] is blocks and prev[1] <= need else 0
            new = blocks[kept:need]
            scored = c.prompt_logprob_positions
            out += (key, c.start, c.num_tokens, int(c.samples) | (2 if c.speculative else 0), kept, len(new),
                    scored.start, scored.stop, c.lora_slot)
            out += c.token_ids
            out += new
            sent[key] = (blocks, need)
        self._sent = sent
        return out


class StepDecoder:
    """Other ranks: flat list of ints -> RemoteChunks, keeping each request's block table."""

    def __init__(self) -> None:
        self._blocks: dict[int, list[int]] = {}

    def decode(self, msg: list[int]) -> list[RemoteChunk]:
        chunks = []
        blocks_now: dict[int, list[int]] = {}
        i = 1
        for _ in range(msg[0]):
            key, start, num_tokens, samples, kept, num_new, scored_from, scored_to, lora_slot = msg[i:i + FIELDS]
            i += FIELDS
            tokens = msg[i:i + num_tokens]
            i += num_tokens
            blocks = self._blocks.get(key, []) if kept else []
            if len(blocks) < kept:
                raise RuntimeError(f"step message keeps {kept} blocks of request {key}, this rank has {len(blocks)}")
            del blocks[kept:]
            blocks.extend(msg[i:i + num_new])
            i += num_new
            blocks_now[key] = blocks
            chunks.append(RemoteChunk(start, num_tokens, bool(samples & 1), tokens, blocks,
                                      range(scored_from, scored_to), lora_slot, bool(samples & 2)))
        if i != len(msg):
            raise RuntimeError(f"step message has {len(msg)} ints, decoded {i}")
        self._blocks = blocks_now
        return chunks
