"""The device block table, updated incrementally, equals a rebuild from the block lists every step."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention.block_table import BlockTable
from engine.tp.messages import RemoteChunk

BS, WIDTH, SLOTS = 4, 12, 6


def _rebuild(chunks) -> list[list[int]]:
    rows = []
    for c in chunks:
        need = -(-(c.start + c.num_tokens) // BS)
        rows.append(c.block_ids[:need] + [0] * (WIDTH - need))
    return rows


class _Sim:
    """Requests whose block lists grow in place while running and are replaced on preemption."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.next_block = 1
        self.running: dict[int, tuple[list[int], int]] = {}  # id -> (block list, tokens computed)
        self.next_id = 0

    def _blocks(self, n: int) -> list[int]:
        out = [(self.next_block + i) % 500 + 1 for i in range(n)]
        self.next_block += n
        return out

    def step(self) -> list[RemoteChunk]:
        rng = self.rng
        for rid in list(self.running):
            blocks, done = self.running[rid]
            roll = rng.random()
            if roll < 0.1 or done >= WIDTH * BS - 8:
                del self.running[rid]                                 # finished
            elif roll < 0.2:
                self.running[rid] = (self._blocks(len(blocks)), done)  # preempted: a new list
        while len(self.running) < SLOTS and rng.random() < 0.7:
            self.running[self.next_id] = ([], 0)
            self.next_id += 1
        chunks = []
        for rid, (blocks, done) in self.running.items():
            if rng.random() < 0.15:
                continue                                              # skipped this step (budget)
            n = 1 if done and rng.random() < 0.7 else rng.randint(1, 7)
            n = min(n, WIDTH * BS - done)
            need = -(-(done + n) // BS)
            blocks.extend(self._blocks(need - len(blocks)))           # grows in place
            chunks.append(RemoteChunk(done, n, True, [0] * n, blocks))
            self.running[rid] = (blocks, done + n)
        rng.shuffle(chunks)
        return chunks


@pytest.mark.parametrize("seed", range(5))
def test_incremental_updates_equal_a_rebuild_over_random_steps(seed):
    table = BlockTable(SLOTS, WIDTH, torch.device("cpu"), pad_block=777)
    sim = _Sim(seed)
    writes = 0
    for _ in range(200):
        chunks = sim.step()
        if not chunks:
            continue
        before = table.table.clone()
        rows = table.update(chunks, BS)
        writes += int((table.table != before).sum())
        assert len(set(rows)) == len(rows) and all(0 <= r < SLOTS for r in rows)
        assert table.gather(torch.tensor(rows), WIDTH).tolist() == _rebuild(chunks)
        assert table.table[table.pad_row].tolist() == [777] * WIDTH
    assert writes > 0


def test_only_blocks_added_since_the_last_step_are_written():
    table = BlockTable(2, 8, torch.device("cpu"))
    a, b = [5, 9], [4]
    rows = table.update([RemoteChunk(0, 8, True, [0] * 8, a), RemoteChunk(0, 3, True, [0] * 3, b)], 4)
    table.table[rows, 0] = -1  # marks: a rewrite of either row would erase them
    a.append(3)
    rows = table.update([RemoteChunk(8, 1, True, [0], a), RemoteChunk(3, 1, True, [0], b)], 4)
    assert table.table[rows].tolist() == [[-1, 9, 3, 0, 0, 0, 0, 0], [-1, 0, 0, 0, 0, 0, 0, 0]]
    # A replaced list (preemption) is written whole, over whatever the row held.
    b.append(6)
    rows = table.update([RemoteChunk(0, 5, True, [0] * 5, [7, 8]), RemoteChunk(4, 1, True, [0], b)], 4)
    assert table.table[rows].tolist() == [[7, 8, 0, 0, 0, 0, 0, 0], [-1, 6, 0, 0, 0, 0, 0, 0]]


def test_a_chunk_needing_more_blocks_than_it_holds_or_the_row_fits_is_an_error():
    table = BlockTable(2, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match="needs 2 blocks; its request holds 1"):
        table.update([RemoteChunk(0, 5, True, [0] * 5, [3])], 4)
    with pytest.raises(ValueError, match="needs 3 blocks; its request holds 3, the block table 2"):
        table.update([RemoteChunk(0, 9, True, [0] * 9, [3, 4, 5])], 4)
    grown = [3]
    table.update([RemoteChunk(0, 4, True, [0] * 4, grown)], 4)
    with pytest.raises(ValueError, match="needs 2 blocks; its request holds 1"):  # a list it holds, grown short
        table.update([RemoteChunk(4, 1, True, [0], grown)], 4)
