"""Rank 0 -> other ranks, one message per step, over a gloo CPU group.

A message is an int64 vector ``[kind, length, payload...]``. The first broadcast always
has the same size, so the receivers know what to post; a payload longer than it (a big
prefill) follows in a second broadcast sized by the header. The group is gloo even when
the model's collectives run on NCCL: step inputs are host data, and idle ranks wait here
between steps, which must not trip the model group's timeout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

STEP, STOP, LORA = 1, 2, 3
"""Message kinds. LORA: ``[slot, *utf-8 bytes of an AdapterInfo's JSON]``, before the step that uses it."""
FIRST_CAPACITY = 1024  # int64s: a decode step of ~100 requests fits in one broadcast


class StepChannel:
    def __init__(self, group, capacity: int = FIRST_CAPACITY) -> None:
        self.group = group
        self._first = torch.zeros(capacity, dtype=torch.int64)
        self._in_flight: list = []  # rank 0: the previous message's sends (and their buffers)

    def send(self, kind: int, payload: list[int]) -> None:
        """Rank 0. Returns once the message is queued: it travels while rank 0 prepares its
        own step; the next send first waits for it (that is when a send error surfaces)."""
        self.flush()
        msg = torch.tensor([kind, len(payload), *payload], dtype=torch.int64)
        cap = self._first.numel()
        self._first[:min(cap, msg.numel())] = msg[:cap]
        self._in_flight = [dist.broadcast(self._first, src=0, group=self.group, async_op=True)]
        if msg.numel() > cap:
            rest = msg[cap:].contiguous()
            self._in_flight += [dist.broadcast(rest, src=0, group=self.group, async_op=True), rest]

    def flush(self) -> None:
        in_flight, self._in_flight = self._in_flight, []
        for item in in_flight:
            if not isinstance(item, torch.Tensor):
                item.wait()

    def recv(self) -> tuple[int, list[int]]:
        dist.broadcast(self._first, src=0, group=self.group)
        kind, length = int(self._first[0]), int(self._first[1])
        cap = self._first.numel()
        if length + 2 <= cap:
            return kind, self._first[2:length + 2].tolist()
        rest = torch.empty(length + 2 - cap, dtype=torch.int64)
        dist.broadcast(rest, src=0, group=self.group)
        return kind, self._first[2:].tolist() + rest.tolist()
