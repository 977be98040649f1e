"""The main loop of a rank worker (ranks 1..N-1): join, load this rank's shard, then run
every step rank 0 sends until it says STOP.

Launchers run ``run_rank(spec)`` in a fresh process (engine.tp.launcher) or a Ray actor
(deployments.tp_launcher). It returns on STOP and raises when rank 0 or a peer is gone
(their sockets close) or a collective times out, so a worker never outlives its replica.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.tp.channel import LORA, STEP, STOP
from engine.tp.messages import StepDecoder
from engine.tp.rendezvous import RankSpec, join, leave, open_store, report_error, report_ready, say, wait_go

logger = logging.getLogger(__name__)


def head_reads_embedding(config) -> bool:
    """An EAGLE-3 head on rank 0 looks draft tokens up in the target's embedding, which the ranks split
    by vocabulary: at start every rank sends its rows to rank 0 (a head with its own table ignores them)."""
    spec = config.speculative_config
    return spec is not None and spec.method == "eagle3"


def _prepare_device(spec: RankSpec) -> None:
    if spec.num_threads is not None:
        torch.set_num_threads(spec.num_threads)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # so nothing lands on another rank's GPU by default


def run_rank(spec: RankSpec) -> None:
    from engine.model import ModelArch
    from engine.runner import ModelRunner

    _prepare_device(spec)
    store = open_store(spec.rank, spec.world_size, spec.port)
    try:
        say(store, "hello", spec.rank)
        wait_go(store)
        group, channel = join(store, spec.rank, spec.world_size, spec.backend,
                              spec.config.parallel.distributed_timeout_s)
        arch = ModelArch.from_dir(spec.model_path)
        runner = ModelRunner(spec.config, Path(spec.model_path), arch, spec.max_model_len, group, spec.device,
                             agree_blocks=lambda blocks, nbytes: report_ready(store, spec.rank, blocks, nbytes))
        group.all_reduce(torch.zeros(1, device=runner.device))  # rank 0 does the same: NCCL comms are up
        if head_reads_embedding(spec.config):
            runner.model.embed_tokens.gathered()  # rank 0's EAGLE-3 head gets the whole table
    except BaseException as exc:
        report_error(store, spec.rank, exc)
        raise
    decoder = StepDecoder()
    while True:
        kind, payload = channel.recv()
        if kind == STOP:
            break
        if kind == LORA:
            from engine.lora import AdapterInfo
            runner.lora.activate(payload[0], AdapterInfo.from_json(bytes(payload[1:]).decode()))
        elif kind == STEP:
            runner.follow(decoder.decode(payload))
        else:
            raise RuntimeError(f"rank {spec.rank}: unknown message kind {kind}")
    leave()
