"""How often adapter-affine routing finds a request's LoRA adapter already loaded, served.

    python -m benchmarks.lora_routing [--replicas 2] [--adapters 8] [--max-loras 2] [--requests 240]

Starts a local Ray and the served app on a tiny random Llama, ``--replicas`` engine replicas
with ``--max-loras`` adapter slots each and ``--adapters`` adapters in all (more than one
replica holds), then sends ``--requests`` gRPC requests from ``--concurrency`` closed-loop
clients. Each request names an adapter drawn from a Zipf law of exponent ``--zipf`` (a few hot
adapters, a long tail), the same sequence for every run. It runs twice: with the router's
``lora_affinity`` on (the default), then off (routing on load and cached prefix only).

The replicas' own counters (``GetLoad``: ``lora_loads``, ``lora_evictions``) give the figures,
read once they stop changing (they lag a routing period). Each load is made by the admission of
a request whose adapter sits in no slot of its replica, so the **hit rate**, the share of
admissions that found their adapter in a slot, is ``1 - loads / requests``. The report also
gives throughput and latency, so a hit rate bought by piling requests onto one replica would show.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

PROMPT_LEN = 24


def zipf_names(count: int, adapters: int, exponent: float, seed: int) -> list[str]:
    weights = [1.0 / (rank + 1) ** exponent for rank in range(adapters)]
    rng = random.Random(seed)
    return [f"a{i}" for i in rng.choices(range(adapters), weights=weights, k=count)]


def app_args(model_dir: str, adapters: dict[str, str], args, affinity: bool) -> dict:
    return {"model": model_dir, "served_model_name": "tiny", "lora_affinity": affinity,
            "engine": {"device": "cpu", "dtype": "float32", "max_num_seqs": args.slots, "block_size": 16,
                       "num_kv_blocks": 256, "max_model_len": 256,
                       "lora": {"adapters": adapters, "max_loras": args.max_loras, "max_lora_rank": args.rank,
                                "max_cpu_loras": len(adapters)}},
            "num_replicas": args.replicas, "replica_resources": {"num_cpus": 0.5}, "ingress": {"num_cpus": 0.25},
            "drain_timeout_s": 5}


def _one(stub, pb, index: int, name: str, max_tokens: int) -> tuple[float, int]:
    prompt = [3 + (index * 31 + k * 7) % 500 for k in range(PROMPT_LEN)]  # no two alike: no prefix pull
    request = pb.GenerateRequest(model=name, prompt_token_ids=pb.TokenIds(ids=prompt),
                                 sampling=pb.SamplingOptions(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    t0 = time.perf_counter()
    tokens = sum(len(reply.token_ids) for reply in stub.Generate(request, timeout=120))
    return time.perf_counter() - t0, tokens


def _settled(stub, load_report, timeout_s: float = 10.0):
    """GetLoad's replicas once two reads a second apart agree on every counter the report uses."""
    def counters(replicas):
        return [(r.replica_id, r.lora_loads, r.lora_evictions, r.num_finished) for r in replicas]

    last = load_report(stub).replicas
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = load_report(stub).replicas
        if counters(now) == counters(last):
            return now
        last = now
    return last


def run_once(model_dir: str, adapters: dict[str, str], names: list[str], args, affinity: bool) -> dict:
    from benchmarks.overload_load import capacity, load_report, served
    from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb

    with served(app_args(model_dir, adapters, args, affinity), num_cpus=2) as stub:
        capacity(stub, args.replicas)
        # Warm each replica's kernels on the base model (no adapter, so no slot is touched).
        for i in range(2 * args.replicas):
            _one(stub, pb, 10_000 + i, "", 2)
        latencies, tokens = [], 0
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool, \
                tqdm(total=len(names), desc=f"affinity {'on' if affinity else 'off'}", unit="req") as bar:
            for seconds, n in pool.map(lambda job: _one(stub, pb, job[0], job[1], args.max_tokens),
                                       enumerate(names)):
                latencies.append(seconds)
                tokens += n
                bar.update()
        wall = time.perf_counter() - t0
        replicas = _settled(stub, load_report)
    loads = sum(r.lora_loads for r in replicas)
    return {"lora_affinity": affinity, "requests": len(names), "loads": loads,
            "evictions": sum(r.lora_evictions for r in replicas), "hit_rate": 1 - loads / len(names),
            "loads_per_replica": [r.lora_loads for r in replicas],
            "finished_per_replica": [r.num_finished for r in replicas],
            "tok_s": tokens / wall, "latency_p50_s": float(np.percentile(latencies, 50)),
            "latency_p99_s": float(np.percentile(latencies, 99))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--max-loras", type=int, default=2)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-out/lora-routing.json")
    args = ap.parse_args(argv)
    from benchmarks.lora import write_adapter
    from benchmarks.models import make_tiny_model_dir
    from benchmarks.served_system import with_tokenizer
    from engine.model import ModelArch

    names = zipf_names(args.requests, args.adapters, args.zipf, args.seed)
    with tempfile.TemporaryDirectory(prefix="lora-routing-") as tmp:
        # The ingress detokenizes: the tiny model gets a word-level tokenizer.
        model_dir = with_tokenizer(str(make_tiny_model_dir(Path(tmp) / "model")), Path(tmp) / "served")
        arch = ModelArch.from_dir(Path(model_dir))
        adapters = {f"a{i}": str(write_adapter(Path(tmp) / f"a{i}", arch, args.rank, i))
                    for i in range(args.adapters)}
        runs = [run_once(model_dir, adapters, names, args, affinity) for affinity in (True, False)]
    shares = np.bincount([int(n[1:]) for n in names], minlength=args.adapters) / len(names)
    print(f"{args.requests} requests over {args.adapters} adapters (Zipf {args.zipf}: shares "
          f"{', '.join(f'{s:.2f}' for s in shares)}), {args.replicas} replicas x {args.max_loras} adapter slots, "
          f"{args.concurrency} clients")
    print("| lora_affinity | hit rate | loads | evictions | loads per replica | tok/s | latency p50 / p99 s |")
    print("| --- | ---: | ---: | ---: | --- | ---: | --- |")
    for r in runs:
        print(f"| {'on' if r['lora_affinity'] else 'off'} | {r['hit_rate']:.2f} | {r['loads']} | {r['evictions']} | "
              f"{' / '.join(map(str, r['loads_per_replica']))} | {r['tok_s']:.0f} | "
              f"{r['latency_p50_s']:.3f} / {r['latency_p99_s']:.3f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
