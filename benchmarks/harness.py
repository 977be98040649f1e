"""Runs the selected systems one after the other, each in a fresh process, with one progress bar."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from benchmarks.systems import SYSTEMS, BenchSettings
from benchmarks.worker import PROGRESS_MARK
from benchmarks.workloads import BenchRequest

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Job:
    name: str
    payload: dict
    units: int
    """Progress units the job reports (requests, or profile levels)."""


def system_job(name: str, requests: list[BenchRequest], settings: BenchSettings) -> Job:
    payload = {"kind": "system", "system": name, "settings": settings.as_dict(),
               "requests": [[r.request_id, list(r.prompt_token_ids), r.output_len, r.arrival_s] for r in requests]}
    return Job(name, payload, len(requests))


def profile_job(settings: BenchSettings, steps: int, levels: int) -> Job:
    payload = {"kind": "profile", "settings": settings.as_dict(), "profile_steps": steps}
    return Job("profile", payload, levels)


def _child_env(threads: int) -> dict:
    env = dict(os.environ)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + path if path else "")
    # Same thread count everywhere: torch reads these at import, before set_num_threads.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env["HF_HUB_OFFLINE"] = "1"
    return env


def host_cpu_busy(interval_s: float = 0.5) -> float | None:
    """Share of all cores busy over a short interval; taken while this harness idles, it is other work."""
    try:
        import psutil
    except ImportError:
        return None
    return psutil.cpu_percent(interval=interval_s) / 100.0


def run_job(job: Job, threads: int, log_dir: Path, bar: tqdm) -> dict:
    """Run one job in a fresh interpreter; returns its result dict (``ok`` False with ``error`` on failure)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{job.name}.log"
    busy_before = host_cpu_busy()
    reported = 0
    with tempfile.TemporaryDirectory(prefix="slotserve-bench-") as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job.payload))
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.worker", str(job_path), str(result_path)],
                cwd=REPO_ROOT, env=_child_env(threads), stdout=subprocess.PIPE, stderr=log, text=True)
            for line in proc.stdout:
                if line.startswith(PROGRESS_MARK):
                    n = int(line.split()[1])
                    reported += n
                    bar.update(n)
                else:
                    log.write(line)
            code = proc.wait()
        bar.update(max(job.units - reported, 0))
        if result_path.exists():
            result = json.loads(result_path.read_text())
        else:
            result = {"ok": False, "error": f"worker exited with status {code} and no result"}
    if not result.get("ok"):
        tail = log_path.read_text().strip().splitlines()[-15:]
        tqdm.write(f"{job.name} failed: {result.get('error')}\n  " + "\n  ".join(tail), file=sys.stderr)
    result["log"] = str(log_path)
    result["host_cpu_busy_before"] = busy_before
    return result


def run_all(systems: list[str], requests: list[BenchRequest], settings: BenchSettings, log_dir: Path,
            profile_steps: int | None, profile_levels: int) -> tuple[dict, dict | None]:
    """Every system, then the engine profile; one progress bar over all requests of all systems."""
    jobs = [system_job(name, requests, settings) for name in systems]
    if profile_steps:
        jobs.append(profile_job(settings, profile_steps, profile_levels))
    results: dict[str, dict] = {}
    profile = None
    with tqdm(total=sum(j.units for j in jobs), unit="req", dynamic_ncols=True, file=sys.stderr) as bar:
        for job in jobs:
            bar.set_description(SYSTEMS[job.name].title if job.name in SYSTEMS else "engine profile")
            result = run_job(job, settings.threads, log_dir, bar)
            if job.name == "profile":
                profile = result
            else:
                results[job.name] = result
    return results, profile
