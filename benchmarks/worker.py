"""One system (or the engine profile) in a fresh process: ``python -m benchmarks.worker JOB RESULT``.

A fresh process per system makes its peak RSS its own and keeps one system's threads,
caches and allocator state from touching the next. Progress goes to stdout as marked
lines; everything else the libraries print goes to the log the parent keeps.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

PROGRESS_MARK = "@@progress"


def _progress(n: int) -> None:
    print(f"{PROGRESS_MARK} {n}", flush=True)


def _threads(count: int) -> None:
    import torch

    torch.set_num_threads(count)


def run_job(job: dict) -> dict:
    from benchmarks.metrics import peak_rss_bytes, summarize
    from benchmarks.systems import SYSTEMS, BenchSettings
    from benchmarks.workloads import BenchRequest

    settings = BenchSettings(**job["settings"])
    _threads(settings.threads)
    start = time.perf_counter()
    if job["kind"] == "profile":
        from benchmarks.profile import run_profile

        result = {"profile": run_profile(settings, job["profile_steps"], _progress)}
    else:
        requests = [BenchRequest(rid, tuple(prompt), out_len, arrival)
                    for rid, prompt, out_len, arrival in job["requests"]]
        run = SYSTEMS[job["system"]].load_runner()(requests, settings, _progress)
        result = {"summary": summarize(run)}
    import torch

    result.update(peak_rss_bytes=peak_rss_bytes(), wall_s=time.perf_counter() - start,
                  torch_threads=torch.get_num_threads())
    return result


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m benchmarks.worker JOB.json RESULT.json", file=sys.stderr)
        return 2
    job_path, result_path = argv
    with open(job_path) as f:
        job = json.load(f)
    try:
        result = {"ok": True, **run_job(job)}
    except Exception as exc:  # the parent reports it and goes on with the next system
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, result_path)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
