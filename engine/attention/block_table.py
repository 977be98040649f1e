"""Per-request block tables kept on the device and updated in place.

A request's block list only grows while it runs; preemption, readmission and finishing
assign a new list (engine.scheduler.ScheduledChunk.block_ids; engine.tp's decoder keeps
the same promise). So a row is keyed by its list object: the same object means the
blocks written so far still hold, and a step writes only the blocks added since. Like
engine.tp's step messages, the table remembers exactly the requests of the previous step.
"""

from __future__ import annotations

import torch

from engine.host_tensors import host_tensor


class BlockTable:
    def __init__(self, max_rows: int, max_blocks: int, device: torch.device, pad_block: int = 0) -> None:
        """``max_rows`` requests per step, ``max_blocks`` per request. Row ``pad_row`` (the last)
        lists only ``pad_block``: padding rows of a captured decode step read it."""
        if max_rows < 1 or max_blocks < 1:
            raise ValueError(f"max_rows and max_blocks must be positive, got {max_rows}, {max_blocks}")
        self.max_blocks = max_blocks
        self.device = device
        self.pad_row = max_rows
        self.table = torch.zeros(max_rows + 1, max_blocks, dtype=torch.int32, device=device)
        self.table[self.pad_row] = pad_block
        self._free = list(range(max_rows - 1, -1, -1))
        self._high = [0] * max_rows  # per row: entries past this are 0
        # id(block list) -> [the list, its row, blocks written, the last step that listed it]
        self._rows: dict[int, list] = {}
        self._step = 0

    def update(self, chunks, block_size: int) -> list[int]:
        """Write what changed for this step's ``chunks``; returns their rows, in order.

        Most steps only extend lists the table already holds, so those are handled in one pass;
        rows of requests that left are freed before new lists take rows."""
        self._step = step = self._step + 1
        entries, width = self._rows, self.max_blocks
        rows: list[int] = []
        index: list[int] = []
        values: list[int] = []
        new: list[int] = []  # positions of chunks whose block list the table does not hold
        for c in chunks:
            blocks = c.block_ids
            need = -(-(c.start + c.num_tokens) // block_size)
            entry = entries.get(id(blocks))
            if entry is None or entry[0] is not blocks or entry[2] > need:
                new.append(len(rows))
                rows.append(-1)
                continue
            entry[3] = step
            row, written = entry[1], entry[2]
            if need > written:
                _check(need, blocks, width)
                index.extend(range(row * width + written, row * width + need))
                values.extend(blocks[written:need])
                entry[2] = self._high[row] = need
            rows.append(row)
        if len(entries) > len(rows) - len(new):  # some requests left (or have a new list)
            for key in [k for k, e in entries.items() if e[3] != step]:
                self._free.append(entries.pop(key)[1])
        for i in new:
            c = chunks[i]
            blocks = c.block_ids
            need = -(-(c.start + c.num_tokens) // block_size)
            _check(need, blocks, width)
            row = self._free.pop()
            end = max(need, self._high[row])  # and zero what a longer list left in the row
            index.extend(range(row * width, row * width + end))
            values.extend(blocks[:need])
            values.extend([0] * (end - need))
            self._high[row] = need
            entries[id(blocks)] = [blocks, row, need, step]
            rows[i] = row
        if index:
            writes = host_tensor(torch.int64, index, values).view(2, -1)
            if self.device.type != "cpu":
                writes = writes.pin_memory().to(self.device, non_blocking=True)  # pageable memory would block
            self.table.view(-1).index_copy_(0, writes[0], writes[1].to(torch.int32))
        return rows

    def gather(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """``[len(rows), width]`` int32, the step's block table (contiguous)."""
        return torch.index_select(self.table[:, :width], 0, rows)

    @classmethod
    def for_step(cls, chunks, block_size: int, device: torch.device) -> "BlockTable":
        """A throwaway table just big enough for one step (tests, profiling)."""
        width = max(-(-(c.start + c.num_tokens) // block_size) for c in chunks)
        return cls(len(chunks), width, device)


def _check(need: int, blocks: list[int], width: int) -> None:
    if need > len(blocks) or need > width:
        raise ValueError(f"a chunk needs {need} blocks; its request holds {len(blocks)}, "
                         f"the block table {width} per request")
