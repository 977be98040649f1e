"""The figures of a run as Markdown tables, ready for docs/BENCHMARKS.md."""

from __future__ import annotations

from benchmarks.report import SERVED_SYSTEMS, fmt_num, fmt_pcts, peak_rss, served_lines
from benchmarks.systems import BASELINE


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _host_kind(env: dict) -> str:
    host = env.get("host_cpu")  # results written before it was recorded have none
    return f"; {host['kernel_isa']} kernels, {host['cpu_default_dtype']} by default" if host else ""


def format_markdown(results: dict) -> str:
    env, st, w = results["environment"], results["settings"], results["workload"]
    busy = [s.get("host_cpu_busy_before") for s in results["systems"].values()]
    busy = [f"{b:.0%}" for b in busy if b is not None]
    lines = [
        f"Workload `{w['name']}`, {w['num_requests']} requests, arrivals {w['arrival']}, seed {w['seed']}; "
        f"model {results['model']}, {st['dtype']}, torch threads {st['threads']}, {st['max_num_seqs']} slots, "
        f"KV {st['num_kv_blocks']} blocks x {st['block_size']} tokens"
        f"{' (int8; vLLM fp8)' if st.get('kv_cache_dtype') == 'int8' else ''}. "
        f"{env['cpu']} ({env['cpu_count']} cores{_host_kind(env)}), "
        f"torch {env['torch']}, transformers {env['transformers']}, commit {(env.get('git_commit') or '-')[:10]}"
        f"{' (dirty)' if env.get('git_dirty') else ''}, {env['date_utc']}. Host CPU busy with other work before "
        f"each system: {', '.join(busy) or '-'}.", "",
        _row(["system", "output tok/s", f"{BASELINE} ÷ system", "req/s", "TTFT p50/p90/p99 s",
              "ITL p50/p90/p99 ms", "E2E p50/p90/p99 s", "mean occupancy", "preemptions", "prefix hits",
              "peak RSS MB"]),
        _row(["---"] + ["---:"] * 10),
    ]
    for name, s in results["systems"].items():
        if "error" in s:
            lines.append(_row([s["title"], f"failed: {s['error']}"] + [""] * 9))
            continue
        ratio = results["ratios"].get(name, {}).get("output_tokens_per_s")
        lines.append(_row([
            s["title"], fmt_num(s["output_tokens_per_s"], ".1f"),
            "1" if name == BASELINE else fmt_num(ratio, ".2f") + "x", fmt_num(s["requests_per_s"], ".2f"),
            fmt_pcts(s["ttft_s"], 1, ".2f"), fmt_pcts(s["itl_s"], 1000, ".1f"), fmt_pcts(s["e2e_s"], 1, ".1f"),
            fmt_num(s["mean_slot_occupancy"], ".2f"), fmt_num(s["preemptions"], "d"),
            fmt_num(s["prefix_cache_hit_rate"], ".0%"), fmt_num(peak_rss(s), ".0f", 1 / 2**20)]))
    served = [line for name in SERVED_SYSTEMS for line in served_lines(results["systems"], name)]
    if served:
        lines += [""] + [f"- {line}" for line in served]
    lines += ["", "Targets (reported, not asserted):", ""]
    lines += [f"- **{t['status']}** — {t['target']}: {t['detail']}" for t in results["targets"]]
    profile = results.get("profile") or {}
    if profile.get("levels"):
        phases = profile["phases"]
        lines += ["", "Engine profile, decode steps (share of step time):", "",
                  _row(["running", "step ms", "tok/s"] + phases + ["outside forward"]),
                  _row(["---:"] * (len(phases) + 4))]
        for lv in profile["levels"]:
            lines.append(_row([str(lv["running"]), fmt_num(lv["step_ms"], ".2f"),
                               fmt_num(lv["decode_tokens_per_s"], ".0f")]
                              + [fmt_num(lv["shares"].get(p), ".1%") for p in phases]
                              + [fmt_num(lv["outside_forward_share"], ".1%")]))
    return "\n".join(lines) + "\n"
