"""The overload benchmark's figures, checks and report on synthetic outcomes (no Ray)."""

from __future__ import annotations

from benchmarks.autoscale_load import Outcome
from benchmarks.overload import format_report, judge, latency_bound, plot, rss_growth, timeline
from benchmarks.overload_load import Phase, SoakPlan, phase_figures

SHED = "RESOURCE_EXHAUSTED: engine queue is full (8 waiting, max_waiting 8); retry later or on another replica"


def _ok(start: float, e2e: float, asked: int = 4) -> Outcome:
    return Outcome(start=start, asked=asked, end=start + e2e, first=start + e2e / 4, tokens=asked,
                   completion_tokens=asked, finish_reason="FINISH_REASON_LENGTH")


def _phases() -> list[Phase]:
    full = Phase("full", 4, 0.0, 10.0, 10.5, [_ok(i, 1.0) for i in range(10)])
    light = Phase("light", 1, 11.0, 21.0, 21.2, [_ok(11 + i, 0.5) for i in range(10)])
    overload = Phase("overload", 20, 22.0, 32.0, 34.0,
                     [_ok(22 + i, 2.0) for i in range(10)]
                     + [Outcome(start=23 + i, asked=4, end=23.1 + i, error=SHED) for i in range(5)])
    recovery = Phase("recovery", 1, 35.0, 45.0, 45.2, [_ok(35 + i, 0.6) for i in range(10)])
    return [full, light, overload, recovery]


def test_plan_leaves_out_empty_phases_and_scales_clients():
    plan = SoakPlan(factor=5, baseline_s=0, warmup_s=1, recovery_s=2, light_share=0.5)
    assert plan.phases(4) == [("warm-up", 4, 1), ("overload", 20, 60.0), ("recovery", 2, 2)]


def test_figures_checks_and_report(tmp_path):
    phases = _phases()
    figures = {p.name: phase_figures(p) for p in phases}
    over = figures["overload"]
    assert (over["requests"], over["admitted"], over["shed"], over["other_errors"]) == (15, 10, 5, 0)
    assert over["shed_with_retry_hint"] == 5 and over["incomplete"] == 0
    assert abs(over["reject_s"]["p50"] - 0.1) < 1e-9 and over["e2e_s"]["p99"] == 2.0
    # 8 queued per replica, 8 slots: one wave ahead, then its own run, each within T = 1 s; +50 %.
    bound = latency_bound(figures, slots=8, max_waiting=8, margin=0.5)
    assert bound == 3.0
    rss = {"start_bytes": 1000, "end_bytes": 1050, "peak_bytes": 1100}
    checks = {c["check"]: c["status"] for c in judge(figures, rss, bound, idle_ok=True, replicas_same=True)}
    assert set(checks.values()) == {"PASS"}, checks
    rss["end_bytes"] = 1200  # +20 %
    figures["overload"]["e2e_s"]["p99"] = 3.5
    failed = {c["check"] for c in judge(figures, rss, bound, True, True) if c["status"] == "FAIL"}
    assert failed == {"RSS end within 10% of start", "admitted p99 E2E bounded"}

    samples = [(t * 0.5, 1000 + t, 12) for t in range(100)]
    where = [(23.0, 20, 8, 8), (24.0, 20, 4, 0)]
    tl = timeline(phases, samples, where, 0.0, 46.0)
    assert sum(row[2] for row in tl["rates"]) == 5  # every shed counted once
    assert [p[0] for p in tl["phases"]] == ["full", "light", "overload", "recovery"]
    results = {"model": "tiny", "replicas": 2, "slots_per_replica": 8, "max_waiting": 8, "capacity_slots": 16,
               "plan": {"max_tokens": 4, "retry_wait_s": 0.05, "factor": 5, "seconds": 10}, "e2e_bound_s": bound,
               "figures": figures, "checks": judge(figures, rss, bound, True, True), "timeline": tl,
               "rss": {**rss, "by_process_growth": rss_growth({"a": 10, "b": 5}, {"a": 30, "b": 5, "c": 1})},
               "environment": {"load_average_at_start": [1.0], "load_average_at_end": [2.0], "cpu_count": 2}}
    text = format_report(results)
    assert "FAIL  admitted p99 E2E bounded" in text and "retry later" in text
    plot(results, tmp_path / "soak.png")
    assert (tmp_path / "soak.png").stat().st_size > 0


def test_rss_growth_orders_by_change():
    assert rss_growth({"a": 10, "b": 5}, {"a": 30, "b": 5, "c": 1}) == [["a", 10, 20], ["c", 0, 1], ["b", 5, 0]]
