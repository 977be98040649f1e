"""What the benchmark report computes and judges: per-request figures, ratios, and the targets
(reached, missed, or not applicable, with their margins), from made-up system results."""

from __future__ import annotations

import pytest

from benchmarks.metrics import RequestTrace, percentiles, time_weighted_mean
from benchmarks.report import judge_targets, ratios, served_lines


def test_trace_figures_share_a_message_gap_between_its_tokens():
    trace = RequestTrace("r", arrival_s=1.0, requested_tokens=6, prompt_len=3)
    trace.add(1.5, 2)
    trace.add(1.5, 0)
    trace.add(2.1, 3)
    trace.add(2.5, 1)
    assert trace.output_tokens == 6
    assert trace.ttft_s == pytest.approx(0.5)
    assert trace.e2e_s == pytest.approx(1.5)
    assert trace.itl_samples() == pytest.approx([0.0, 0.2, 0.2, 0.2, 0.4])


def test_time_weighted_mean_and_percentiles():
    # 1.0 for 1 s, then 0.5 for 3 s.
    assert time_weighted_mean([(0.0, 1.0), (1.0, 0.5)], end=4.0) == pytest.approx(0.625)
    assert time_weighted_mean([], end=1.0) is None
    p = percentiles(list(range(101)))
    assert (p["p50"], p["p90"], p["p99"]) == (50.0, 90.0, 99.0)


def _fake(tok_s, ttft, e2e):
    lat = {"p50": ttft, "p90": ttft, "p99": ttft}
    return {"output_tokens_per_s": tok_s, "requests_per_s": tok_s / 10, "ttft_s": lat,
            "e2e_s": {"p50": e2e, "p90": e2e, "p99": e2e}}


def test_ratios_and_targets_reached_missed_and_not_applicable():
    systems = {"continuous": _fake(100.0, 0.1, 1.0), "static": _fake(20.0, 0.4, 3.0),
               "hf_generate": _fake(40.0, 0.2, 2.0), "hf_generate_batch": _fake(80.0, 0.1, 1.5)}
    table = ratios(systems)
    assert table["static"]["output_tokens_per_s"] == pytest.approx(5.0)
    assert table["static"]["ttft_p50"] == pytest.approx(4.0)
    profile = {"levels": [{"running": 32, "outside_forward_share": 0.14}]}
    judged = {t["target"]: t for t in judge_targets("mixed", table, profile, {"ratio": 1.5})}
    statuses = [t["status"] for t in judged.values()]
    # The last three judge the served app, which did not run here.
    assert statuses == ["reached", "missed", "missed", "missed", "n/a", "n/a", "n/a"]
    assert judged["continuous >= 4x static on mixed"]["margin"] == pytest.approx(0.25)
    assert judged["continuous >= 4x HF generate on mixed"]["margin"] == pytest.approx(-0.375)
    assert "schedule bound for this request list: 1.50x" in judged["continuous >= 4x static on mixed"]["detail"]
    other = judge_targets("uniform", table, None)
    assert [t["status"] for t in other] == ["n/a", "n/a", "missed", "n/a", "n/a", "n/a", "n/a"]


def _probe(p50: float, p99: float, engine: float = 0.002) -> dict:
    return {"p50": p50, "p90": p50 * 2, "p99": p99, "engine_ttft_s": {"p50": engine, "p99": engine}}


def test_each_served_system_run_is_judged():
    notes = {"added_ttft_s": _probe(0.003, 0.009), "ingress": "haproxy"}
    table = ratios({"continuous": _fake(100.0, 0.1, 1.0), "served_haproxy": {**_fake(60.0, 0.1, 1.0), "notes": notes}})
    judged = judge_targets("uniform", table, None, quick=True)[-3:]
    assert [t["target"].split(" >= ")[0].split(" path")[0] for t in judged] == ["served via HAProxy,"] * 3
    assert [t["status"] for t in judged] == ["reached", "reached", "reached"]
    both = ratios({"continuous": _fake(100.0, 0.1, 1.0), "served": {**_fake(40.0, 0.1, 1.0), "notes": notes},
                   "served_haproxy": {**_fake(55.0, 0.1, 1.0), "notes": {"added_ttft_s": _probe(0.004, 0.02)}}})
    judged = judge_targets("uniform", both, None, quick=True)[-6:]
    assert [t["target"].split(" >= ")[0].split(" path")[0] for t in judged] == \
        ["served"] * 3 + ["served via HAProxy,"] * 3
    assert [t["status"] for t in judged] == ["missed", "reached", "reached", "reached", "reached", "missed"]
    for ingress, hops in [("haproxy", "no such hop"), ("proxy", "one such hop")]:
        floor = {"ingress": ingress, "serve_call_floor_s": {"p50": 0.004, "p90": 0.005}}
        lines = served_lines({"served_x": {"notes": floor}}, "served_x")
        assert lines and all(line.startswith("served_x: ") for line in lines) and hops in lines[-1]


def test_served_targets_judge_throughput_share_and_added_ttft_p50_and_p99():
    def judged(tok_s, added_p50, added_p99=0.010, engine=0.002, quick=False):
        served = {**_fake(tok_s, 0.1, 1.0), "notes": {"added_ttft_s": _probe(added_p50, added_p99, engine)}}
        table = ratios({"continuous": _fake(100.0, 0.1, 1.0), "served": served})
        return table, judge_targets("uniform", table, None, quick=quick)[-3:]

    table, (share, p50, p99) = judged(90.0, 0.004)
    assert table["served"]["throughput_share"] == pytest.approx(0.9)
    assert table["served"]["output_tokens_per_s"] == pytest.approx(100 / 90)
    assert (share["status"], p50["status"], p99["status"]) == ("reached", "reached", "reached")
    assert share["margin"] == pytest.approx(0.0)
    assert "4.0 ms vs 5 ms: under by 1.0 ms (p90 8.0 ms)" in p50["detail"]
    assert p99["target"].endswith("adds <= 15 ms to TTFT (p99, light load)") and "10.0 ms vs 15 ms" in p99["detail"]
    _, (share, p50, p99) = judged(80.0, 0.0065, added_p99=0.0165)
    assert (share["status"], p50["status"], p99["status"]) == ("missed", "missed", "missed")
    assert "short by 11%" in share["detail"] and "over by 1.5 ms" in p50["detail"] and "over by 1.5" in p99["detail"]
    # The tiny model (--quick) stands in for a fast GPU engine: judged against 0.5x.
    _, (share, _, _) = judged(45.0, 0.004, quick=True)
    assert share["status"] == "missed" and "0.45x vs 0.5x" in share["detail"]
    _, (share, _, _) = judged(55.0, 0.004, quick=True)
    assert share["status"] == "reached" and share["target"].endswith("(tiny model)")
    # An engine TTFT of 150 ms drifts by more than 5 ms between processes: no verdict.
    _, (_, p50, p99) = judged(90.0, 0.0065, engine=0.150)
    assert p50["status"] == p99["status"] == "n/a" and "not resolvable" in p50["detail"]
    # Results from before the probe measured a p99 have none to judge.
    old = {**_fake(90.0, 0.1, 1.0), "notes": {"added_ttft_s": {"p50": 0.004, "p90": 0.008,
                                                                "engine_ttft_s": {"p50": 0.002}}}}
    p99 = judge_targets("uniform", ratios({"continuous": _fake(100.0, 0.1, 1.0), "served": old}), None)[-1]
    assert p99["status"] == "n/a" and "no p99" in p99["detail"]


def test_added_ttft_pairs_each_probe_request():
    from benchmarks.served_client import added_ttft

    added = added_ttft([0.010, 0.012, 0.020], [0.001, 0.002, 0.004])
    assert added["p50"] == pytest.approx(0.010)
    assert added["served_ttft_s"]["p50"] == pytest.approx(0.012)
    assert added["engine_ttft_s"]["p50"] == pytest.approx(0.002)
    with pytest.raises(ValueError, match="differ in length"):
        added_ttft([0.01], [])


