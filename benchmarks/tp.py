"""Tensor parallelism on CPU: TP=2 against TP=1, and where a decode step's time goes.

    python -m benchmarks.tp [--model smollm2-135m] [--batch 8] [--steps 32] [--json-out FILE]

For each TP size, ``batch`` requests are prefilled, then ``steps`` pure decode steps are
timed with the engine's profile timers (rank 0's view): compute (the forward minus its
collectives), the step broadcast (encoding and sending the step to the other ranks), the
all-reduces and the logits gather (including any wait for the slower rank). A second
measurement times the step channel end to end between two processes: a decode step's
message for ``batch`` requests is encoded, broadcast and decoded on the peer, acked by a
one-element all-reduce; the ack alone is measured too and subtracted.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass

PHASES = ("schedule", "tp_broadcast", "prepare", "forward", "tp_all_reduce", "tp_gather", "sample", "output")


def measure_engine(model: str, tp: int, batch: int, steps: int, prompt_len: int,
                   num_threads: int | None = None) -> dict:
    """Decode tokens/s and the per-step split at ``batch`` running requests. ``num_threads``
    per rank; None: torch's default alone, the cores split over the ranks with TP."""
    import torch

    from benchmarks.engine_systems import exact_params
    from engine.engine import LLMEngine

    engine = LLMEngine.from_options(model, tensor_parallel_size=tp, profile=True, max_num_seqs=batch,
                                    max_num_batched_tokens=max(2048, batch * prompt_len), block_size=32,
                                    max_model_len=prompt_len + steps + 64, num_kv_blocks=batch * 16 + 8,
                                    num_threads=num_threads)
    try:
        for i in range(batch):
            prompt = [(i * 131 + j * 17) % 4000 + 10 for j in range(prompt_len)]
            engine.add_request(prompt, exact_params(steps + 8), request_id=str(i))
        for _ in range(4):  # the prefill, then a few decode steps to warm up
            engine.step()
        before = dict(engine.stats().step_time_s)
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - started
        after = engine.stats().step_time_s
        running = engine.stats().running
        threads = torch.get_num_threads()  # per rank: TP=N on CPU splits the cores
    finally:
        engine.shutdown()
    per_step = {k: 1000 * (after.get(k, 0.0) - before.get(k, 0.0)) / steps for k in PHASES}
    per_step["compute"] = per_step["forward"] - per_step["tp_all_reduce"] - per_step["tp_gather"]
    step_ms = 1000 * wall / steps
    return {"tp": tp, "threads_per_rank": threads, "batch": batch, "running": running, "steps": steps,
            "step_ms": step_ms,
            "decode_tok_s": batch * steps / wall, "per_step_ms": per_step,
            "broadcast_share": per_step["tp_broadcast"] / step_ms}


@dataclass
class _FakeRequest:
    seq_no: int
    block_ids: list


@dataclass
class _FakeChunk:
    request: _FakeRequest
    start: int
    num_tokens: int = 1
    samples: bool = True

    @property
    def token_ids(self) -> list[int]:
        return [7]

    @property
    def block_ids(self) -> list[int]:
        return self.request.block_ids


def _decode_steps(batch: int, context: int, block_size: int):
    """Chunks of successive decode steps: the block tables grow as a real engine's do."""
    reqs = [_FakeRequest(i, list(range(i * 1000, i * 1000 + context // block_size + 1))) for i in range(batch)]
    pos = context
    while True:
        for r in reqs:
            if pos // block_size >= len(r.block_ids):
                r.block_ids.append(r.block_ids[-1] + 1)
        yield [_FakeChunk(r, pos) for r in reqs]
        pos += 1


def _channel_peer(port: int, iters: int) -> None:
    import torch

    from engine.tp.messages import StepDecoder
    from engine.tp.rendezvous import join, leave, open_store, say, wait_go

    torch.set_num_threads(1)
    store = open_store(1, 2, port)
    say(store, "hello", 1)
    wait_go(store)
    group, channel = join(store, 1, 2, "gloo", 60)
    decoder, ack = StepDecoder(), torch.zeros(1)
    for _ in range(2 * iters):
        decoder.decode(channel.recv()[1])
        group.all_reduce(ack)
    for _ in range(2 * iters):
        group.all_reduce(ack)
    leave()


def measure_channel(batch: int, iters: int = 300, context: int = 512, block_size: int = 32) -> dict:
    """End-to-end cost of one decode step's message, rank 0 to a peer process."""
    import torch
    import torch.multiprocessing as mp

    from engine.tp.channel import STEP
    from engine.tp.messages import StepEncoder
    from engine.tp.rendezvous import StartupWatch, join, leave, open_store

    store = open_store(0, 2)
    peer = mp.get_context("spawn").Process(target=_channel_peer, args=(store.port, iters), daemon=True)
    peer.start()
    try:
        StartupWatch(store, 2, lambda: {} if peer.exitcode is None else {1: str(peer.exitcode)}).go()
        group, channel = join(store, 0, 2, "gloo", 60)
        encoder, steps, ack = StepEncoder(block_size), _decode_steps(batch, context, block_size), torch.zeros(1)
        size = 0

        def loop(send: bool) -> float:
            nonlocal size
            started = time.perf_counter()
            for _ in range(iters):
                if send:
                    payload = encoder.encode(next(steps))
                    size = len(payload)
                    channel.send(STEP, payload)
                group.all_reduce(ack)
            return (time.perf_counter() - started) / iters

        loop(True)  # warm-up
        with_message = loop(True)
        channel.flush()
        loop(False)
        ack_only = loop(False)
    finally:
        peer.join(30)
        leave()
    return {"batch": batch, "message_ints": size, "message_and_ack_us": 1e6 * with_message,
            "ack_only_us": 1e6 * ack_only, "broadcast_us": 1e6 * max(0.0, with_message - ack_only)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tp", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    result = {"model": args.model, "cpus": os.cpu_count(), "load_before": os.getloadavg()[0],
              "channel": measure_channel(args.batch),
              # TP=1 on every core, TP=1 on one core (what each TP=2 rank gets), TP=2
              "engine": [measure_engine(args.model, tp, args.batch, args.steps, args.prompt_len, threads)
                         for tp, threads in ((1, None), (1, 1), (2, None))]}
    result["load_after"] = os.getloadavg()[0]
    print(format_result(result))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def format_result(result: dict) -> str:
    lines = [f"model {result['model']}, {result['cpus']} CPUs, load average {result['load_before']:.1f} before, "
             f"{result['load_after']:.1f} after",
             "| TP | threads/rank | decode tok/s | step ms | " + " | ".join(PHASES + ("compute",))
             + " | broadcast share |",
             "|" + "---:|" * (len(PHASES) + 6)]
    for r in result["engine"]:
        ms = r["per_step_ms"]
        lines.append(f"| {r['tp']} | {r['threads_per_rank']} | {r['decode_tok_s']:.1f} | {r['step_ms']:.2f} | "
                     + " | ".join(f"{ms[k]:.2f}" for k in PHASES + ("compute",))
                     + f" | {100 * r['broadcast_share']:.2f}% |")
    c = result["channel"]
    lines.append(f"step channel, {c['batch']} decodes ({c['message_ints']} ints): message + ack "
                 f"{c['message_and_ack_us']:.0f} us, ack alone {c['ack_only_us']:.0f} us, "
                 f"broadcast ~{c['broadcast_us']:.0f} us")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
