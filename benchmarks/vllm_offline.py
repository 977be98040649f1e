"""vLLM's engine on a benchmark job, in vLLM's own Python environment: ``PYTHON vllm_offline.py JOB OUT``.

Standalone on purpose (stdlib + vllm only): vLLM pins its own transformers and fastapi, so it
runs from a separate venv (benchmarks.vllm_peer starts it). Requests are submitted at their
arrival times to ``LLMEngine`` and stepped like slotserve's continuous system; every output
message is timed, so the harness computes the same figures for both. Progress lines go to
stdout in the harness's format.
"""

import json
import os
import sys
import time

PROGRESS_MARK = "@@progress"


def _engine(job):
    from vllm import LLM

    s = job["settings"]
    # vLLM's CPU attention pages at multiples of 32 tokens; elsewhere it keeps its own default.
    block_size = s["block_size"] if s["block_size"] % 32 == 0 else None
    llm = LLM(model=s["model_dir"], dtype=s["dtype"], max_num_seqs=s["max_num_seqs"],
              max_num_batched_tokens=s["max_num_batched_tokens"], block_size=block_size,
              enable_prefix_caching=s["enable_prefix_caching"], max_model_len=job["max_model_len"], seed=0,
              kv_cache_dtype="fp8" if s.get("kv_cache_dtype") == "int8" else "auto")
    return llm.llm_engine


def _params(n):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0,
                          output_kind=RequestOutputKind.DELTA)


def _drain(engine, on_output):
    while engine.has_unfinished_requests():
        for out in engine.step():
            on_output(out)


def _run(engine, requests):
    """requests: [id, prompt ids, output length, arrival s]. Returns {id: [[t, new tokens], ...]}, makespan."""
    messages = {rid: [] for rid, *_ in requests}
    pending = sorted(requests, key=lambda r: r[3])
    t0 = time.perf_counter()

    def on_output(out):
        t = time.perf_counter() - t0
        n = sum(len(c.token_ids) for c in out.outputs)
        if n:
            messages[out.request_id].append([t, n])
        if out.finished:
            print(f"{PROGRESS_MARK} 1", flush=True)

    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while pending and pending[0][3] <= now:
            rid, prompt, n, _ = pending.pop(0)
            engine.add_request(rid, {"prompt_token_ids": prompt}, _params(n))
        if engine.has_unfinished_requests():
            for out in engine.step():
                on_output(out)
        elif pending:
            time.sleep(min(0.01, max(0.0, pending[0][3] - now)))
    return messages, time.perf_counter() - t0


def main(argv):
    job_path, out_path = argv
    with open(job_path) as f:
        job = json.load(f)
    import vllm

    engine = _engine(job)
    warm = [[f"warmup-{i}", list(range(10, 10 + 16 + i)), 4, 0.0] for i in range(2)]
    _drain(engine, lambda out: None)
    engine.add_request(warm[0][0], {"prompt_token_ids": warm[0][1]}, _params(4))
    engine.add_request(warm[1][0], {"prompt_token_ids": warm[1][1]}, _params(4))
    _drain(engine, lambda out: None)
    messages, makespan = _run(engine, job["requests"])
    result = {"messages": messages, "makespan_s": makespan, "vllm_version": vllm.__version__,
              "dtype": job["settings"]["dtype"]}
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, out_path)
    return 0


if __name__ == "__main__":  # vLLM spawns its engine core: the guard is required
    sys.exit(main(sys.argv[1:]))
