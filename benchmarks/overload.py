"""``python -m benchmarks.overload [--seconds 60] [--factor 5] ...``: the served app far past its capacity.

Starts a local Ray and the served application (gRPC proxy, Router ingress, ``--replicas``
engine replicas of ``--slots`` slots and a bounded queue of ``--max-waiting`` each) on a
tiny random Llama, reads its capacity (slots x replicas, from GetLoad), then runs the
phases of ``overload_load``: warm-up, two baselines (full occupancy, light load),
``--factor`` x capacity closed-loop clients for ``--seconds``, and the light load again.

What it checks (the report prints PASS / FAIL for each):

- memory: the summed RSS of this process and every Ray process (``served_system.TreeRss``,
  every 0.5 s), median over the recovery phase within 10 % of the median over the light
  baseline (same load, before and after the overload);
- shedding: overload is refused with RESOURCE_EXHAUSTED and a retry hint, nothing else
  fails, every admitted stream gets exactly its tokens;
- bounded latency: admitted p99 E2E under overload <= (ceil(max_waiting / slots) + 1) x
  T x (1 + margin), T = p99 E2E at full occupancy (``full`` phase). An admitted request
  finds at most ``max_waiting`` requests queued ahead of it on its replica; they leave
  the queue ``slots`` at a time, each wave within T, then it runs for T itself. The margin
  covers what sheds cost the shared CPU (the proxy and ingress answer them);
- recovery: no error of any kind at the light load afterwards, p50 E2E within 1.5x of
  the light baseline's, and the engines idle with no KV block in use.

Writes ``overload.json`` to ``--out-dir`` and the plot (RSS, admitted and shed requests/s,
admitted E2E over time) to ``--plot``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.served_system import per_process
from benchmarks.overload_load import (SoakPlan, app_args, capacity, idle, phase_figures, served, soak,
                                      where_requests_are)

RSS_TOLERANCE = 0.10
RECOVERY_SLACK = 1.5
IDLE_TIMEOUT_S = 30.0
BIN_S = 1.0
GIB = 1024 ** 3


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {value}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.overload",
                                description="Overload soak of the served app: sheds, memory, bounded latency, "
                                            "recovery.")
    p.add_argument("--seconds", type=_positive(float), default=60.0, help="overload phase length (default 60)")
    p.add_argument("--factor", type=_positive(float), default=5.0, help="clients = factor x slots (default 5)")
    p.add_argument("--replicas", type=_positive(int), default=2, help="engine replicas (default 2)")
    p.add_argument("--slots", type=_positive(int), default=8, help="max_num_seqs per replica (default 8)")
    p.add_argument("--max-waiting", type=_positive(int), default=8, help="engine queue bound (default 8)")
    p.add_argument("--max-tokens", type=_positive(int), default=32, help="tokens per request (default 32)")
    p.add_argument("--baseline-s", type=_positive(float), default=10.0, help="each baseline phase (default 10)")
    p.add_argument("--recovery-s", type=_positive(float), default=10.0, help="recovery phase (default 10)")
    p.add_argument("--retry-wait-s", type=float, default=0.05,
                   help="a shed client waits this long before its next request (default 0.05; 0: at once)")
    p.add_argument("--latency-margin", type=float, default=0.5, help="margin on the E2E bound (default 0.5)")
    p.add_argument("--num-cpus", type=_positive(int), default=None, help="logical CPUs of the local Ray")
    p.add_argument("--model", default=None, help="local HF model directory (default: a tiny random Llama)")
    p.add_argument("--out-dir", default="bench-out", help="where overload.json goes (default bench-out)")
    p.add_argument("--plot", default=None, help="plot path (default OUT_DIR/overload-soak.png)")
    return p


def _median_rss(samples: list, start: float, end: float) -> float | None:
    inside = [b for t, b, _ in samples if start <= t <= end]
    return float(np.median(inside)) if inside else None


def judge(figures: dict, rss: dict, bound_s: float | None, idle_ok: bool, replicas_same: bool) -> list[dict]:
    """Every check, PASS or FAIL with the numbers behind it."""
    over, rec, light = figures["overload"], figures.get("recovery"), figures.get("light")
    checks = []

    def check(name: str, ok: bool | None, detail: str) -> None:
        checks.append({"check": name, "status": "n/a" if ok is None else ("PASS" if ok else "FAIL"),
                       "detail": detail})

    start, end = rss.get("start_bytes"), rss.get("end_bytes")
    change = None if not start or end is None else end / start - 1
    check(f"RSS end within {RSS_TOLERANCE:.0%} of start", None if change is None else abs(change) <= RSS_TOLERANCE,
          "-" if change is None else f"{start / GIB:.2f} -> {end / GIB:.2f} GiB ({change:+.1%}), "
                                     f"peak {rss['peak_bytes'] / GIB:.2f} GiB")
    check("no replica restarted (no OOM kill)", replicas_same, "same engine replica ids before and after")
    check("overload is shed", over["shed"] > 0, f"{over['shed']} of {over['requests']} requests")
    check("every shed carries a retry hint and no tokens",
          over["shed"] > 0 and over["shed_with_retry_hint"] == over["shed"] and over["shed_after_tokens"] == 0,
          f"{over['shed_with_retry_hint']} with 'retry' in the message; {over['shed_after_tokens']} after tokens")
    other = sum(f["other_errors"] for f in figures.values())
    incomplete = sum(f["incomplete"] for f in figures.values())
    check("no error but RESOURCE_EXHAUSTED, every admitted stream complete", other == 0 and incomplete == 0,
          f"{other} other errors, {incomplete} incomplete streams")
    p99 = over["e2e_s"]["p99"]
    check("admitted p99 E2E bounded", None if bound_s is None or p99 is None else p99 <= bound_s,
          "-" if bound_s is None or p99 is None else f"{p99:.2f} s vs bound {bound_s:.2f} s")
    if rec is not None:
        bad = rec["other_errors"] + rec["shed"] + rec["incomplete"]
        check("recovery: zero errors", bad == 0 and rec["requests"] > 0,
              f"{rec['requests']} requests, {rec['shed']} shed, {rec['other_errors']} other errors")
        base, now = (light or {}).get("e2e_s", {}).get("p50"), rec["e2e_s"]["p50"]
        check(f"recovery: p50 E2E within {RECOVERY_SLACK}x of the light baseline",
              None if not base or now is None else now <= RECOVERY_SLACK * base,
              "-" if not base or now is None else f"{now:.3f} s vs {base:.3f} s")
    check("engines idle, no KV block in use afterwards", idle_ok, f"waited up to {IDLE_TIMEOUT_S:.0f} s")
    return checks


def latency_bound(figures: dict, slots: int, max_waiting: int, margin: float) -> float | None:
    full = figures.get("full", {}).get("e2e_s", {}).get("p99")
    return None if full is None else (math.ceil(max_waiting / slots) + 1) * full * (1 + margin)


def timeline(phases, rss_samples: list, where: list, t0: float, t1: float) -> dict:
    """Per BIN_S, by end time: admitted requests done, sheds, admitted p99 E2E. RSS and where the
    requests were, as sampled; all from ``t0`` (warm-up) to ``t1`` (before shutdown)."""
    outcomes = [o for p in phases for o in p.outcomes]
    bins = int(math.ceil((t1 - t0) / BIN_S)) + 1
    admitted, shed = np.zeros(bins), np.zeros(bins)
    e2e: list[list[float]] = [[] for _ in range(bins)]
    for o in outcomes:
        i = int((o.end - t0) // BIN_S)
        if o.shed:
            shed[i] += 1
        elif o.error is None:
            admitted[i] += 1
            e2e[i].append(o.end - o.start)
    return {"bin_s": BIN_S,
            "rates": [[round(i * BIN_S, 2), admitted[i] / BIN_S, shed[i] / BIN_S,
                       float(np.percentile(e, 99)) if e else None] for i, e in enumerate(e2e)],
            "rss": [[round(t - t0, 2), b, n] for t, b, n in rss_samples if t0 <= t <= t1],
            "where": [[round(t - t0, 2), *rest] for t, *rest in where],
            "phases": [[p.name, round(p.start - t0, 2), round(p.stop - t0, 2)] for p in phases]}


def _model_dir(args, scratch: Path) -> str:
    from benchmarks.models import make_tiny_model_dir
    from benchmarks.served_system import with_tokenizer

    model = args.model or str(make_tiny_model_dir(scratch / "tiny-llama"))
    return with_tokenizer(model, scratch / "served")  # the ingress detokenizes: a tokenizer must be there


def rss_by_process() -> dict[str, int]:
    """RSS of this process and its descendants, summed per kind (Ray names its workers ``ray::Class``)."""
    return per_process(lambda proc: proc.memory_info().rss)


def rss_growth(before: dict[str, int], after: dict[str, int], top: int = 5) -> list[list]:
    """[kind, bytes before, change] for the kinds that changed most."""
    rows = [[k, before.get(k, 0), after.get(k, 0) - before.get(k, 0)] for k in sorted(set(before) | set(after))]
    return sorted(rows, key=lambda row: -abs(row[2]))[:top]


def rss_figures(rss, by_name: dict, snapshots: dict) -> dict:
    """Start: median over the light baseline; end: median over the recovery (the same load)."""
    def median_over(name: str) -> float | None:
        phase = by_name.get(name)
        return None if phase is None else _median_rss(rss.samples, phase.start, phase.stop)

    over = by_name["overload"]
    return {"start_bytes": median_over("light"), "end_bytes": median_over("recovery"), "peak_bytes": rss.peak_bytes,
            "overload_peak_bytes": max((b for t, b, _ in rss.samples if over.start <= t <= over.end), default=None),
            "processes": rss.processes_at_peak,
            "by_process_growth": rss_growth(snapshots.get("light", {}), snapshots.get("end", {}))
            if snapshots.get("light") else []}


def soak_with_progress(stub, plan: SoakPlan, slots: int) -> tuple[list, list[tuple], dict]:
    """The phases under a tqdm bar (seconds), sampling where the requests are on every tick;
    RSS per process early in the light baseline and after the recovery."""
    import grpc
    from tqdm import tqdm

    where: list[tuple] = []
    snapshots: dict[str, dict] = {}
    with tqdm(total=round(sum(s for *_, s in plan.phases(slots))), dynamic_ncols=True, file=sys.stderr,
              bar_format="{l_bar}{bar}| {n:.0f}/{total} s [{elapsed}<{remaining}{postfix}]") as bar:
        def tick(phase, step):
            try:
                where.append(where_requests_are(stub, phase))
            except grpc.RpcError:  # a load report that timed out under overload is a missing point
                pass
            bar.set_description(phase.name)
            bar.set_postfix(admitted=sum(o.error is None for o in phase.outcomes),
                            shed=sum(o.shed for o in phase.outcomes), refresh=False)
            bar.update(min(step, bar.total - bar.n))
            if phase.name == "light" and "light" not in snapshots:
                snapshots["light"] = rss_by_process()
        phases = soak(stub, plan, slots, tick)
    snapshots["end"] = rss_by_process()
    return phases, where, snapshots


def wait_idle(stub) -> bool:
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while not idle(stub):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def run(args) -> dict:
    from benchmarks.harness import host_cpu_busy
    from benchmarks.report import environment, load_average
    from benchmarks.served_system import TreeRss

    plan = SoakPlan(seconds=args.seconds, factor=args.factor, max_tokens=args.max_tokens,
                    baseline_s=args.baseline_s, recovery_s=args.recovery_s, retry_wait_s=args.retry_wait_s)
    load_at_start, busy_before = load_average(), host_cpu_busy()
    with tempfile.TemporaryDirectory(prefix="slotserve-overload-") as scratch:
        app = app_args(_model_dir(args, Path(scratch)), args.replicas, args.slots, args.max_waiting, args.max_tokens)
        with TreeRss() as rss, served(app, args.num_cpus) as stub:
            slots, before = capacity(stub, args.replicas)
            phases, where, snapshots = soak_with_progress(stub, plan, slots)
            idle_ok = wait_idle(stub)
            _, after = capacity(stub, args.replicas)
            t1 = time.time()
    figures = {p.name: phase_figures(p) for p in phases if p.name != "warm-up"}
    rss_figs = rss_figures(rss, {p.name: p for p in phases}, snapshots)
    bound = latency_bound(figures, args.slots, args.max_waiting, args.latency_margin)
    return {"command": "python -m benchmarks.overload " + " ".join(sys.argv[1:]),
            "model": args.model or "tiny random Llama (benchmarks/models.py)",
            "replicas": args.replicas, "slots_per_replica": args.slots, "max_waiting": args.max_waiting,
            "capacity_slots": slots, "plan": dataclasses.asdict(plan),
            "phases": [[n, c, s] for n, c, s in plan.phases(slots)],
            "latency_margin": args.latency_margin, "e2e_bound_s": bound, "figures": figures, "rss": rss_figs,
            "checks": judge(figures, rss_figs, bound, idle_ok, before == after),
            "environment": {**environment(None, load_at_start), "host_cpu_busy_before": busy_before},
            "timeline": timeline(phases, rss.samples, where, phases[0].start, t1)}


def _ms(p: dict, key: str) -> str:
    return "-" if p.get(key) is None else f"{p[key] * 1e3:.0f}"


def _pct(value) -> str:
    return "-" if value is None else f"{value:.0%}"


def format_report(r: dict) -> str:
    env = r["environment"]
    lines = [f"overload soak: {r['model']}; {r['replicas']} replicas x {r['slots_per_replica']} slots "
             f"(capacity {r['capacity_slots']}), max_waiting {r['max_waiting']} per replica, "
             f"{r['plan']['max_tokens']} tokens per request, shed clients retry after {r['plan']['retry_wait_s']} s",
             f"host: {_pct(env.get('host_cpu_busy_before'))} of the CPUs busy before the run (other work); load "
             f"average {env.get('load_average_at_start')} at start, {env.get('load_average_at_end')} at end "
             f"({env.get('cpu_count')} cores; the soak's own client threads count in the latter)", "",
             f"{'phase':<9}{'clients':>8}{'s':>6}{'requests':>9}{'admitted':>9}{'shed':>7}{'other':>6}"
             f"{'adm/s':>7}{'shed/s':>7}  {'TTFT p50/p99 ms':>16}  {'E2E p50/p99 ms':>15}  {'reject p50/p99 ms':>17}"]
    for name, f in r["figures"].items():
        lines.append(f"{name:<9}{f['clients']:>8}{f['seconds']:>6.0f}{f['requests']:>9}{f['admitted']:>9}"
                     f"{f['shed']:>7}{f['other_errors']:>6}{f['admitted_per_s']:>7.1f}{f['shed_per_s']:>7.1f}  "
                     f"{_ms(f['ttft_s'], 'p50') + '/' + _ms(f['ttft_s'], 'p99'):>16}  "
                     f"{_ms(f['e2e_s'], 'p50') + '/' + _ms(f['e2e_s'], 'p99'):>15}  "
                     f"{_ms(f['reject_s'], 'p50') + '/' + _ms(f['reject_s'], 'p99'):>17}")
    shed_msg = r["figures"]["overload"]["shed_message"]
    lines += ["", f"a shed request reads: {shed_msg}", ""]
    growth = ", ".join(f"{k} {d / 2**20:+.0f} MiB (of {b / 2**20:.0f})" for k, b, d in r["rss"]["by_process_growth"])
    lines += [f"RSS change per process, light baseline -> after recovery: {growth or '-'}", ""]
    lines += [f"{c['status']:<5} {c['check']}: {c['detail']}" for c in r["checks"]]
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = r["timeline"]
    fig, axes = plt.subplots(4, 1, figsize=(9, 9.5), sharex=True)
    rss = [s[1] / GIB for s in tl["rss"]]
    axes[0].plot([s[0] for s in tl["rss"]], rss, label="RSS, client + every Ray process")
    axes[0].set_ylim(0, max(rss, default=1) * 1.15)  # from zero: a 10 % change looks like one
    axes[0].set_ylabel("GiB")
    t = [row[0] for row in tl["rates"]]
    axes[1].step(t, [row[1] for row in tl["rates"]], where="post", label="admitted requests done/s")
    axes[1].step(t, [row[2] for row in tl["rates"]], where="post", label="shed requests/s (RESOURCE_EXHAUSTED)")
    axes[1].set_ylabel("requests/s")
    w = tl["where"]
    axes[2].plot([x[0] for x in w], [x[1] for x in w], label="streams open at the clients")
    axes[2].plot([x[0] for x in w], [x[2] + x[3] for x in w], label="in engines (running + waiting)")
    axes[2].axhline(r["replicas"] * (r["slots_per_replica"] + r["max_waiting"]), color="gray", linestyle=":",
                    label="engines' bound (slots + max_waiting)")
    axes[2].set_ylabel("requests")
    axes[3].plot(t, [np.nan if row[3] is None else row[3] for row in tl["rates"]], ".",
                 label="admitted E2E p99 (per second)")
    if r["e2e_bound_s"]:
        axes[3].axhline(r["e2e_bound_s"], color="tab:red", linestyle="--", label="bound")
        axes[3].set_ylim(0, max([r["e2e_bound_s"]] + [row[3] or 0 for row in tl["rates"]]) * 1.1)
    axes[3].set_ylabel("seconds")
    axes[3].set_xlabel("seconds since the warm-up started")
    for ax in axes:
        for name, start, stop in tl["phases"]:
            if name == "overload":
                ax.axvspan(start, stop, color="gray", alpha=0.15)
            if ax is axes[0] and name != "warm-up":  # too short to label
                ax.annotate(name, (start, 1.0), xycoords=("data", "axes fraction"), fontsize=7, va="bottom")
        ax.legend(fontsize=7, loc="lower right" if ax is axes[0] else "upper right")
    fig.suptitle(f"Overload soak: {r['plan']['factor']:g}x capacity ({r['capacity_slots']} slots) for "
                 f"{r['plan']['seconds']:g} s; shaded: overload", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        results = run(args)
    except (ValueError, FileNotFoundError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    from benchmarks.report import write_json

    out = Path(args.out_dir)
    plot_path = Path(args.plot) if args.plot else out / "overload-soak.png"
    results["plot"] = str(plot_path)
    write_json(out / "overload.json", results)
    plot(results, plot_path)
    print(format_report(results))
    print(f"\nwrote {out / 'overload.json'} and {plot_path}")
    return 0 if all(c["status"] != "FAIL" for c in results["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
