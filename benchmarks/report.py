"""Ratios, targets, the environment, the stdout table and the JSON file."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.systems import BASELINE, SYSTEMS


@dataclass(frozen=True)
class Target:
    label: str
    system: str
    minimum: float
    """Minimum ratio: continuous output tok/s over the system's."""
    workload: str | None = None
    """Only judged on this workload (None: every workload)."""


RATIO_TARGETS = (
    Target("continuous >= 4x static on mixed", "static", 4.0, "mixed"),
    Target("continuous >= 4x HF generate on mixed", "hf_generate", 4.0, "mixed"),
    Target("continuous >= 1.5x HF continuous batching", "hf_generate_batch", 1.5),
)
PROFILE_TARGET_RUNNING = 32
PROFILE_TARGET_MAX_OUTSIDE = 0.10
# The served application against the in-process engine on the same workload: through Serve's
# proxy or HAProxy (deployments.ingress_env).
SERVED = "served"
SERVED_SYSTEMS = {SERVED: "served", "served_haproxy": "served via HAProxy,"}
# A tiny model (--quick) stands in for a fast GPU engine: a step costs little, so the serving
# path's per-message costs weigh far more than with a real model.
SERVED_MIN_THROUGHPUT_SHARE = {"model": 0.9, "quick": 0.5}
SERVED_MAX_ADDED_TTFT_S = {"p50": 0.005, "p99": 0.015}
# The same prefill runs 10-20 % faster or slower from one fresh process to the next here, so
# an in-process TTFT above this many times the target hides a difference of the target's size.
SERVED_TTFT_RESOLUTION = 5.0
# Threads waiting on cores taken by other processes slow a step many times over: above this, say so.
BUSY_HOST_SHARE = 0.15


def _ratio(num, den) -> float | None:
    return num / den if num is not None and den else None


def ratios(systems: dict) -> dict:
    """Per system against the baseline: throughput as baseline / system, latency as system / baseline.

    Either way a number above 1 means the baseline is better by that factor.
    """
    base = systems.get(BASELINE)
    if base is None:
        return {}
    out = {}
    for name, s in systems.items():
        if name == BASELINE:
            continue
        out[name] = {
            "output_tokens_per_s": _ratio(base["output_tokens_per_s"], s["output_tokens_per_s"]),
            "requests_per_s": _ratio(base["requests_per_s"], s["requests_per_s"]),
            "ttft_p50": _ratio(s["ttft_s"]["p50"], base["ttft_s"]["p50"]),
            "e2e_p50": _ratio(s["e2e_s"]["p50"], base["e2e_s"]["p50"]),
            "e2e_p99": _ratio(s["e2e_s"]["p99"], base["e2e_s"]["p99"]),
        }
        if name in SERVED_SYSTEMS:
            # What the serving path keeps of the engine's throughput, and what it adds to TTFT.
            out[name]["throughput_share"] = _ratio(s["output_tokens_per_s"], base["output_tokens_per_s"])
            out[name]["added_ttft_s"] = (s.get("notes") or {}).get("added_ttft_s")
    return out


def peak_rss(system: dict) -> int | None:
    """The system's peak RSS; for the served app, summed over the client and every Ray process."""
    return (system.get("notes") or {}).get("peak_rss_tree_bytes") or system.get("peak_rss_bytes")


def _served_targets(ratio_table: dict, quick: bool) -> list[dict]:
    """The throughput share and added-TTFT targets of each served system run (of "served" if none)."""
    names = [name for name in SERVED_SYSTEMS if name in ratio_table] or [SERVED]
    return [entry for name in names for entry in _served_system_targets(name, ratio_table.get(name), quick)]


def _served_system_targets(name: str, served: dict | None, quick: bool) -> list[dict]:
    label = SERVED_SYSTEMS[name]
    share = (served or {}).get("throughput_share")
    minimum = SERVED_MIN_THROUGHPUT_SHARE["quick" if quick else "model"]
    entry = {"target": f"{label} >= {minimum:g}x continuous output tok/s{' (tiny model)' if quick else ''}",
             "minimum": minimum, "value": share}
    if share is None:
        entry.update(status="n/a", detail=f"{name} and {BASELINE} were not both run")
    else:
        margin = share / minimum - 1.0
        entry.update(status="reached" if margin >= 0 else "missed", margin=margin,
                     detail=f"{share:.2f}x vs {minimum:g}x: "
                            f"{'above' if margin >= 0 else 'short'} by {abs(margin):.0%}")
    probe = (served or {}).get("added_ttft_s") or {}
    return [entry] + [_ttft_target(name, label, probe, q, limit) for q, limit in SERVED_MAX_ADDED_TTFT_S.items()]


def _ttft_target(name: str, label: str, probe: dict, quantile: str, limit_s: float) -> dict:
    added, engine = probe.get(quantile), (probe.get("engine_ttft_s") or {}).get(quantile)
    limit_ms = limit_s * 1e3
    ttft = {"target": f"{label} path adds <= {limit_ms:g} ms to TTFT ({quantile}, light load)",
            "maximum": limit_s, "value": added}
    if added is None:
        ttft.update(status="n/a", detail=f"{name} was not run" if not probe else f"{name} measured no {quantile}")
    elif engine is not None and engine > SERVED_TTFT_RESOLUTION * limit_s:
        ttft.update(status="n/a", detail=f"{added * 1e3:.1f} ms measured, not resolvable: the engine's own TTFT "
                                         f"({quantile} {engine * 1e3:.0f} ms) varies more than {limit_ms:g} ms from "
                                         "one process to the next; judge it with a small model (--quick)")
    else:
        over = (added - limit_s) * 1e3
        ttft.update(status="reached" if over <= 0 else "missed", margin=-over / 1e3,
                    detail=f"{added * 1e3:.1f} ms vs {limit_ms:g} ms: {'under' if over <= 0 else 'over'} by "
                           f"{abs(over):.1f} ms" + (f" (p90 {probe['p90'] * 1e3:.1f} ms)" if quantile == "p50" else ""))
    return ttft


def judge_targets(workload: str, ratio_table: dict, profile: dict | None, bound: dict | None = None,
                  quick: bool = False) -> list[dict]:
    """Every target, reached or missed and by how much (not applicable ones say why).

    Against static batching the schedule bound says what batching alone can win on this
    request list; a target far above it needs more requests rather than a faster step.
    """
    judged = []
    for t in RATIO_TARGETS:
        value = ratio_table.get(t.system, {}).get("output_tokens_per_s")
        entry = {"target": t.label, "minimum": t.minimum, "value": value}
        if t.workload is not None and t.workload != workload:
            entry.update(status="n/a", detail=f"judged on the {t.workload} workload only")
        elif value is None:
            entry.update(status="n/a", detail=f"{t.system} was not run")
        else:
            margin = value / t.minimum - 1.0
            entry.update(status="reached" if value >= t.minimum else "missed", margin=margin,
                         detail=f"{value:.2f}x vs {t.minimum:g}x: {'above' if margin >= 0 else 'short'} "
                                f"by {abs(margin):.0%}")
            if bound and t.system in ("static", "hf_generate"):
                entry["detail"] += f" (schedule bound for this request list: {bound['ratio']:.2f}x)"
        judged.append(entry)
    level = next((lv for lv in (profile or {}).get("levels", []) if lv["running"] == PROFILE_TARGET_RUNNING), None)
    entry = {"target": f"step time outside the forward <= {PROFILE_TARGET_MAX_OUTSIDE:.0%} at "
                       f"{PROFILE_TARGET_RUNNING} running", "maximum": PROFILE_TARGET_MAX_OUTSIDE}
    if level is None or level.get("outside_forward_share") is None:
        entry.update(status="n/a", value=None, detail="engine profile not run")
    else:
        value = level["outside_forward_share"]
        points = (PROFILE_TARGET_MAX_OUTSIDE - value) * 100
        entry.update(status="reached" if value <= PROFILE_TARGET_MAX_OUTSIDE else "missed", value=value,
                     margin=points / 100,
                     detail=f"{value:.1%} vs {PROFILE_TARGET_MAX_OUTSIDE:.0%}: "
                            f"{'under' if points >= 0 else 'over'} by {abs(points):.1f} points")
    judged.append(entry)
    return judged + _served_targets(ratio_table, quick)


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def load_average() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def environment(torch_threads: int | None, load_at_start: list[float] | None) -> dict:
    import numpy
    import torch
    import transformers

    from engine.cpu_features import host_cpu

    status = _git("status", "--porcelain")
    host = host_cpu()
    return {
        "cpu": host["cpu"], "cpu_count": os.cpu_count(), "torch_threads": torch_threads,
        "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "transformers": transformers.__version__, "numpy": numpy.__version__,
        "git_commit": _git("rev-parse", "HEAD"), "git_dirty": bool(status) if status is not None else None,
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        # Other work on the host skews every figure (threads wait on cores taken by others).
        "load_average_at_start": load_at_start, "load_average_at_end": load_average(),
        # The host kind a figure belongs to: the kernels' ISA and the CPU's default dtype.
        "host_cpu": host,
    }


def write_json(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, allow_nan=False, default=str) + "\n")


def fmt_num(value, fmt: str, scale: float = 1.0) -> str:
    if value is None:
        return "-"
    return format(value * scale if scale != 1.0 else value, fmt)


def fmt_pcts(p: dict, scale: float, fmt: str) -> str:
    return "/".join(fmt_num(p.get(k), fmt, scale) for k in ("p50", "p90", "p99"))


def _load_warning(results: dict) -> str:
    env = results["environment"]
    start, end = env.get("load_average_at_start"), env.get("load_average_at_end")
    busy = [s.get("host_cpu_busy_before") for s in results["systems"].values()]
    busy.append((results.get("profile") or {}).get("host_cpu_busy_before"))
    busy = [b for b in busy if b is not None]
    text = (f"host: load average (1 min) {start[0] if start else '-'} at start, {end[0] if end else '-'} at end; "
            f"CPU busy with other work just before each system (and the profile): "
            f"{', '.join(f'{b:.0%}' for b in busy) if busy else '-'}")
    # Measured while the harness idles between systems, so it is someone else's work.
    if busy and max(busy) > BUSY_HOST_SHARE:
        text += "  WARNING: busy host, figures are unreliable"
    return text


def _header_lines(results: dict) -> list[str]:
    w, st = results["workload"], results["settings"]
    lines = [f"workload {w['name']}: {w['num_requests']} requests; prompts {w['prompt_len']}"
             + (f" after a shared prefix of {w['shared_prefix_len']}" if w["shared_prefix_len"] else "")
             + f"; outputs {w['output_len']}; arrivals {w['arrival']}; seed {w['seed']}",
             f"model {results['model']}, {st['dtype']}, torch threads {st['threads']}, {st['max_num_seqs']} slots, "
             f"KV {st['num_kv_blocks']} x {st['block_size']} tokens"]
    bound = w.get("schedule_bound")
    if bound:
        lines.append(f"schedule bound (all arriving at once, a step costing the same however full): static batches "
                     f"need {bound['static_steps']} decode steps, continuous at least "
                     f"{bound['continuous_steps_lower_bound']}: {bound['ratio']:.2f}x")
    return lines + [_load_warning(results), ""]


def _ratio_lines(results: dict) -> list[str]:
    if not results["ratios"]:
        return []
    lines = [f"{BASELINE} vs each (x > 1: {BASELINE} better)   tok/s   req/s  TTFT p50  E2E p50  E2E p99"]
    for name, r in results["ratios"].items():
        keys = ("output_tokens_per_s", "requests_per_s", "ttft_p50", "e2e_p50", "e2e_p99")
        cells = [fmt_num(r[k], ".2f") + "x" for k in keys]
        title = SYSTEMS[name].title if name in SYSTEMS else name
        lines.append(f"  {title:<36}" + "".join(f"{c:>9}" for c in cells))
    return lines + [""]


def _system_lines(systems: dict) -> list[str]:
    lines = [f"{'system':<24}{'out tok/s':>10}{'req/s':>8}{'TTFT p50/90/99 s':>22}{'ITL p50/90/99 ms':>20}"
             f"{'E2E p50/90/99 s':>22}{'occup':>7}{'preempt':>8}{'prefix':>7}{'RSS MB':>8}"]
    for name, s in systems.items():
        if "error" in s:
            lines.append(f"{name:<24}failed: {s['error']}")
            continue
        cells = [(fmt_num(s["output_tokens_per_s"], ".1f"), 10), (fmt_num(s["requests_per_s"], ".2f"), 8),
                 (fmt_pcts(s["ttft_s"], 1, ".2f"), 22), (fmt_pcts(s["itl_s"], 1000, ".1f"), 20),
                 (fmt_pcts(s["e2e_s"], 1, ".1f"), 22), (fmt_num(s["mean_slot_occupancy"], ".2f"), 7),
                 (fmt_num(s["preemptions"], "d"), 8), (fmt_num(s["prefix_cache_hit_rate"], ".0%"), 7),
                 (fmt_num(peak_rss(s), ".0f", 1 / 2**20), 8)]
        lines.append(f"{s['title']:<24}" + "".join(f"{text:>{width}}" for text, width in cells))
    for name in SERVED_SYSTEMS:
        lines += served_lines(systems, name)
    for name, s in systems.items():
        if "error" not in s and not s["exact_output_lengths"]:
            lines.append(f"WARNING: {name} returned {s['output_tokens']} tokens for {s['requested_tokens']} asked; "
                         "its figures are not comparable")
    return lines


def served_lines(systems: dict, name: str = SERVED) -> list[str]:
    """How the served figures were taken: the added TTFT probe and whose memory the RSS counts."""
    s = systems.get(name)
    if not s or "error" in s:
        return []
    return [f"{name}: {line}" for line in _served_notes(s)]


def _served_notes(s: dict) -> list[str]:
    notes = s.get("notes") or {}
    ingress = notes.get("ingress", "proxy")
    # Requests go over engine links, which are no Serve calls: only Serve's proxy makes one.
    hops = "one such hop (the proxy's)" if ingress == "proxy" else "no such hop"
    lines = []
    added = notes.get("added_ttft_s")
    if added:
        p99 = f", p99 {added['p99'] * 1e3:.1f} ms" if "p99" in added else ""
        lines.append(f"added TTFT p50 {added['p50'] * 1e3:.1f} ms, p90 {added['p90'] * 1e3:.1f} ms{p99} "
                     f"(client TTFT through gRPC + Ray p50 {added['served_ttft_s']['p50'] * 1e3:.1f} ms minus "
                     f"in-process AsyncEngine p50 {added['engine_ttft_s']['p50'] * 1e3:.1f} ms; "
                     f"{added['requests']} requests one at a time, {added['prompt_len']}-token prompts, "
                     f"{min(added['output_lens'])}-{max(added['output_lens'])} tokens)")
    floor = notes.get("serve_call_floor_s")
    if floor:
        lines.append(f"for scale, one bare Serve streaming call (do-nothing replica, one item) takes "
                     f"p50 {floor['p50'] * 1e3:.1f} ms, p90 {floor['p90'] * 1e3:.1f} ms here; "
                     f"the path makes {hops} plus {'HAProxy and ' if ingress == 'haproxy' else ''}gRPC")
    cpu = notes.get("cpu_by_process")
    if cpu:
        top = ", ".join(f"{name} {c['cpu_us_per_token']:.0f}" for name, c in list(cpu.items())[:6])
        lines.append(f"CPU per output token in the timed run, µs by process: {top}")
    if notes.get("peak_rss_tree_bytes"):
        lines.append(f"peak RSS is the client plus all {notes.get('processes_at_peak_rss')} Ray processes "
                     f"(client alone {fmt_num(s.get('peak_rss_bytes'), '.0f', 1 / 2**20)} MB)")
    return lines


def _profile_lines(profile: dict | None) -> list[str]:
    if profile and profile.get("error"):
        return ["", f"engine profile failed: {profile['error']}"]
    if not (profile and profile.get("levels")):
        return []
    phases = profile["phases"]
    lines = ["", "engine profile: share of step time (decode steps)",
             f"  {'running':>7}{'step ms':>9}{'tok/s':>9}" + "".join(f"{p:>10}" for p in phases)
             + f"{'outside fwd':>13}"]
    for lv in profile["levels"]:
        shares = "".join(f"{fmt_num(lv['shares'].get(p), '.1%'):>10}" for p in phases)
        lines.append(f"  {lv['running']:>7}{fmt_num(lv['step_ms'], '.2f'):>9}"
                     f"{fmt_num(lv['decode_tokens_per_s'], '.0f'):>9}{shares}"
                     f"{fmt_num(lv['outside_forward_share'], '.1%'):>13}")
    return lines


def format_table(results: dict) -> str:
    """The stdout report: ratios first, then every figure, the targets, the engine profile."""
    lines = _header_lines(results) + _ratio_lines(results) + _system_lines(results["systems"])
    lines += ["", "targets (reported, not asserted)"]
    lines += [f"  [{t['status']:>7}] {t['target']}: {t['detail']}" for t in results["targets"]]
    return "\n".join(lines + _profile_lines(results.get("profile")))
