"""Two tenants on one served engine: tenant B's latency beside tenant A's flood.

``python -m benchmarks.fairness_served [--model smollm2-135m] [--seconds 20] [--plot PATH]``

A local Ray runs the app (one engine replica, tenants ``a`` and ``b`` of equal weight). Three
phases, each ``--seconds`` long, the engine drained between them:

- ``b-alone``: B sends a short request every ``1 / --rate`` seconds (open loop), nobody else;
- ``fair``: A keeps ``--flood`` long requests in flight (closed loop) while B sends as before;
- ``fcfs``: the same, with B's requests sent under A's key. One tenant is served first come, first
  served, so this is the engine without tenants: B's requests queue behind A's.

Reported per phase: B's time to first token (p50 / p95) and each client's output tokens per second;
the plot shows both over time. What is measured is the engine's scheduler through the whole served
path (gRPC, the ingress, the engine link), on this host: name the host (``lscpu``) beside a figure.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

KEYS = {"a": "bench-tenant-a-key", "b": "bench-tenant-b-key"}
PHASES = ("b-alone", "fair", "fcfs")
BIN_S = 1.0


@dataclass(frozen=True)
class Load:
    seconds: float = 20.0
    rate: float = 2.0
    """B's requests per second."""
    flood: int = 16
    """A's requests in flight."""
    a_prompt: int = 256
    a_output: int = 128
    b_prompt: int = 32
    b_output: int = 16


@dataclass
class Sample:
    client: str
    phase: str
    sent: float
    first: float | None = None
    done: float | None = None
    times: list[float] = field(default_factory=list)
    """When each of its tokens came."""


def app_args(model_dir: str, slots: int, max_waiting: int, quantization: str | None, name: str,
             budget: int | None = None) -> dict:
    engine = {"device": "cpu", "max_num_seqs": slots, "max_waiting": max_waiting, "max_model_len": 1024}
    if budget is not None:
        engine["max_num_batched_tokens"] = budget
    if quantization:
        engine["quantization"] = quantization
    if quantization == "gguf":  # a built-in model's own file, as ``slotserve serve`` reads it
        from engine.models_hub import resolve_gguf

        engine["gguf_file"] = str(resolve_gguf(name, Path(model_dir), None))
    return {"model": model_dir, "served_model_name": "bench", "engine": engine, "num_replicas": 1,
            "replica_resources": {"num_cpus": 1}, "ingress": {"num_cpus": 0.25}, "drain_timeout_s": 5,
            "tenants": [{"name": name, "api_keys": [key]} for name, key in KEYS.items()]}


class Clients:
    """gRPC streams of both tenants, each token's arrival time kept."""

    def __init__(self, stub, vocab: int, load: Load) -> None:
        self.stub, self.vocab, self.load = stub, vocab, load
        self.samples: list[Sample] = []
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def _prompt(self, length: int) -> list[int]:
        n = next(self._ids)  # distinct prompts: no prefix-cache hits between requests
        return [4 + (n * 7919 + i * 104729) % (self.vocab - 4) for i in range(length)]

    def one(self, client: str, key: str, phase: str, prompt: int, output: int) -> Sample:
        from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb

        sample = Sample(client, phase, time.monotonic())
        request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=self._prompt(prompt)),
                                     sampling=pb.SamplingOptions(temperature=0, max_tokens=output, ignore_eos=True))
        for msg in self.stub.Generate(request, metadata=(("authorization", f"Bearer {key}"),), timeout=600):
            now = time.monotonic()
            sample.first = sample.first or now
            sample.times += [now] * len(msg.token_ids)
        sample.done = time.monotonic()
        with self._lock:
            self.samples.append(sample)
        return sample

    def flood(self, phase: str, stop: threading.Event) -> None:
        while not stop.is_set():
            self.one("a", KEYS["a"], phase, self.load.a_prompt, self.load.a_output)

    def run_phase(self, phase: str, pool: concurrent.futures.ThreadPoolExecutor, tick) -> None:
        stop, futures = threading.Event(), []
        if phase != "b-alone":
            futures += [pool.submit(self.flood, phase, stop) for _ in range(self.load.flood)]
        b_key = KEYS["a"] if phase == "fcfs" else KEYS["b"]
        start = time.monotonic()
        for i in range(round(self.load.seconds * self.load.rate)):
            time.sleep(max(0.0, start + i / self.load.rate - time.monotonic()))
            futures.append(pool.submit(self.one, "b", b_key, phase, self.load.b_prompt, self.load.b_output))
            tick()
        stop.set()
        for f in futures:
            f.result()


def wait_idle(stub, timeout_s: float = 120.0) -> None:
    from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb

    deadline = time.monotonic() + timeout_s
    auth = (("authorization", f"Bearer {KEYS['a']}"),)
    while any(r.running or r.waiting for r in stub.GetLoad(pb.GetLoadRequest(), metadata=auth, timeout=10).replicas):
        if time.monotonic() > deadline:
            raise TimeoutError("the engine did not drain")
        time.sleep(0.2)


def figures(samples: list[Sample], load: Load) -> dict:
    out = {}
    for phase in PHASES:
        mine = [s for s in samples if s.phase == phase]
        if not mine:
            continue
        t0 = min(s.sent for s in mine)
        t1 = max(s.done for s in mine)
        ttft = sorted(s.first - s.sent for s in mine if s.client == "b")
        out[phase] = {"b_ttft_p50_s": statistics.median(ttft), "b_ttft_p95_s": ttft[int(0.95 * (len(ttft) - 1))],
                      "b_requests": len(ttft),
                      **{f"{c}_tokens_per_s": sum(len(s.times) for s in mine if s.client == c) / (t1 - t0)
                         for c in ("a", "b")}}
    return out


def report(result: dict) -> str:
    rows = ["| phase | B's TTFT p50 / p95 (ms) | A's output tok/s | B's output tok/s |", "| --- | ---: | ---: | ---: |"]
    for phase, f in result["phases"].items():
        rows.append(f"| {phase} | {f['b_ttft_p50_s'] * 1e3:.0f} / {f['b_ttft_p95_s'] * 1e3:.0f} "
                    f"| {f['a_tokens_per_s']:.1f} | {f['b_tokens_per_s']:.1f} |")
    return "\n".join(rows)


def plot(samples: list[Sample], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(s.sent for s in samples)
    end = max(s.done for s in samples) - t0
    bins = [i * BIN_S for i in range(int(end / BIN_S) + 2)]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for client, color in (("a", "tab:orange"), ("b", "tab:blue")):
        times = [t - t0 for s in samples if s.client == client for t in s.times]
        counts = [sum(lo <= t < lo + BIN_S for t in times) / BIN_S for lo in bins[:-1]]
        top.step(bins[:-1], counts, where="post", color=color, label=f"tenant {client}")
        if client == "b":
            for phase, marker in zip(PHASES, "os^"):
                mine = [s for s in samples if s.client == "b" and s.phase == phase]
                bottom.scatter([s.sent - t0 for s in mine], [(s.first - s.sent) * 1e3 for s in mine], s=12,
                               color=color, marker=marker, label=f"B's requests, {phase}")
    for phase in PHASES:
        mine = [s for s in samples if s.phase == phase]
        if mine:
            top.axvspan(min(s.sent for s in mine) - t0, max(s.done for s in mine) - t0, alpha=0.06, color="gray")
            top.text(min(s.sent for s in mine) - t0, top.get_ylim()[1] * 0.92, f" {phase}", fontsize=8)
    top.set_ylabel("output tokens / s")
    top.legend(loc="upper right", fontsize=8)
    bottom.set_yscale("log")
    bottom.set_ylabel("B's time to first token (ms)")
    bottom.set_xlabel("seconds")
    bottom.legend(loc="upper left", fontsize=8)
    fig.suptitle("Tenant B's short requests beside tenant A's flood: fair scheduling vs first come, first served")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args, load: Load) -> dict:
    from tqdm import tqdm

    from benchmarks.models import resolve_default_model
    from benchmarks.overload_load import served
    from benchmarks.report import environment
    from benchmarks.served_system import with_tokenizer

    with tempfile.TemporaryDirectory(prefix="slotserve-fairness-") as scratch:
        model = with_tokenizer(str(resolve_default_model(args.model)), Path(scratch) / "served")
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        app = app_args(model, args.slots, args.max_waiting, args.quantization, args.model,
                       args.max_num_batched_tokens)
        with served(app, args.num_cpus) as stub, concurrent.futures.ThreadPoolExecutor(load.flood + 64) as pool:
            clients = Clients(stub, vocab, load)
            clients.one("b", KEYS["b"], "warm-up", load.b_prompt, load.b_output)  # compile, fill caches
            clients.samples.clear()
            with tqdm(total=len(PHASES) * round(load.seconds * load.rate), desc="B's requests", file=sys.stderr) as bar:
                for phase in PHASES:
                    bar.set_postfix(phase=phase)
                    clients.run_phase(phase, pool, lambda: bar.update(1))
                    wait_idle(stub)
    return {"command": "python -m benchmarks.fairness_served " + " ".join(sys.argv[1:]), "model": args.model,
            "quantization": args.quantization, "slots": args.slots,
            "max_num_batched_tokens": args.max_num_batched_tokens, "load": load.__dict__,
            "phases": figures(clients.samples, load), "environment": environment(None, None),
            "samples": clients.samples}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fairness_served", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quantization", default="gguf", help="the engine's quantization ('' for none)")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-waiting", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="the engine's token budget a step")
    ap.add_argument("--num-cpus", type=int, default=None)
    ap.add_argument("--seconds", type=float, default=Load.seconds)
    ap.add_argument("--rate", type=float, default=Load.rate)
    ap.add_argument("--flood", type=int, default=Load.flood)
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--plot", type=Path, help="write the timeline (PNG) here")
    args = ap.parse_args(argv)
    result = run(args, Load(seconds=args.seconds, rate=args.rate, flood=args.flood))
    samples = result.pop("samples")
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(samples, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
