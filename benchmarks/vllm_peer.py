"""The ``vllm`` system: vLLM's engine on the same requests, run from its own Python environment.

vLLM pins its own transformers and fastapi, so it never shares slotserve's venv: the
benchmark's ``--vllm-python PATH`` names that environment's interpreter (set one up with
benchmarks/peers/setup-vllm-cpu.sh or your own install), and benchmarks/vllm_offline.py runs
there. It gets the settings every system gets (dtype, slots, token budget, block size,
prefix caching, threads) and returns timed output messages, summarized here like the others.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

from benchmarks.metrics import RequestTrace, SystemRun
from benchmarks.systems import BenchSettings
from benchmarks.workloads import BenchRequest

SCRIPT = Path(__file__).with_name("vllm_offline.py")
PROGRESS_MARK = "@@progress"
KV_CACHE_GIB = 2
"""vLLM's CPU KV pool (VLLM_CPU_KVCACHE_SPACE): ample for 16 slots of the presets' longest requests."""


def peer_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB), VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
               OMP_NUM_THREADS=str(threads))
    return env


def run_vllm(requests: list[BenchRequest], settings: BenchSettings,
             progress: Callable[[int], None]) -> SystemRun:
    python = settings.vllm_python
    if not python or not Path(python).exists():
        raise ValueError(f"the vllm system needs --vllm-python: the interpreter of a venv with vLLM, got {python!r}")
    if settings.device != "cpu":
        raise ValueError("the vllm system runs vLLM's CPU build here; device must be cpu")
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    job = {"settings": settings.as_dict(), "max_model_len": settings.max_model_len or longest + 16,
           "requests": [[r.request_id, list(r.prompt_token_ids), r.output_len, r.arrival_s] for r in requests]}
    with tempfile.TemporaryDirectory() as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_path.write_text(json.dumps(job))
        # -I: the script folder is not put on sys.path (benchmarks/profile.py would shadow the stdlib module)
        proc = subprocess.Popen([python, "-I", str(SCRIPT), str(job_path), str(out_path)], stdout=subprocess.PIPE,
                                stderr=sys.stderr, text=True, env=peer_env(settings.threads))
        for line in proc.stdout:
            if line.startswith(PROGRESS_MARK):
                progress(1)
            else:
                sys.stderr.write(line)
        if proc.wait() != 0:
            raise RuntimeError(f"vLLM exited with status {proc.returncode} (its output is in this system's log)")
        result = json.loads(out_path.read_text())
    traces = []
    for r in requests:
        trace = RequestTrace(r.request_id, r.arrival_s, r.output_len, len(r.prompt_token_ids))
        for t, n in result["messages"][r.request_id]:
            trace.add(t, n)
        traces.append(trace)
    return SystemRun(traces, result["makespan_s"], sum(t.output_tokens for t in traces),
                     notes={"vllm_version": result["vllm_version"], "dtype": result["dtype"]})
