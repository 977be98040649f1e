"""Per-request block tables kept on the device and updated in place.

A request's block list only grows while it runs; preemption, readmission and finishing
assign a new list (engine.scheduler.ScheduledChunk.block_ids; engine.tp's decoder keeps
the same promise). So a row is keyed by its list object: the same object means the
blocks written so far still hold, and a step writes only the blocks added since. Like
engine.tp's step messages, the table remembers exactly the requests of the previous step.
"""

from __future__ import annotations

import torch


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
        # id(block list) -> (the list, its row, blocks written)
        self._rows: dict[int, tuple[list[int], int, int]] = {}

    def update(self, chunks, block_size: int) -> list[int]:
        """Write what changed for this step's ``chunks``; returns their rows, in order."""
        keep = {id(c.block_ids) for c in chunks}
        previous = self._rows
        for key, (_, row, _) in previous.items():
            if key not in keep:
                self._free.append(row)
        self._rows = {}
        index: list[int] = []
        values: list[int] = []
        rows = []
        width = self.max_blocks
        for c in chunks:
            blocks = c.block_ids
            need = -(-(c.start + c.num_tokens) // block_size)
            if not need <= len(blocks) and need <= width:
                raise ValueError(f"a chunk needs {need} blocks; its request holds {len(blocks)}, "
                                 f"the block table {width} per request")
            entry = previous.get(id(blocks))
            if entry is not None and entry[0] is blocks and entry[2] <= need:
                row, first = entry[1], entry[2]
            else:
                row = entry[1] if entry is not None else self._free.pop()
                first = 0
            end = max(need, self._high[row]) if first == 0 else need
            if end > first:
                base = row * width
                index.extend(range(base + first, base + end))
                values.extend(blocks[first:need])
                values.extend([0] * (end - need))
            self._high[row] = need
            self._rows[id(blocks)] = (blocks, row, need)
            rows.append(row)
        if index:
            writes = torch.tensor([index, values], dtype=torch.int64)
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
