"""The autoscaling benchmark's reading of Serve's logs and its report, on synthetic input (no Ray)."""

from __future__ import annotations

from datetime import datetime

from benchmarks.autoscale import format_table, plot
from benchmarks.autoscale_load import (Outcome, calls_across, engine_calls, policy_decisions, replica_start,
                                       replica_stop_times)

CONTROLLER = """\
INFO 2026-11-22 01:25:10,000 controller 1 -- Adding 1 replica to Deployment(name='EngineReplica', app='slotserve').
INFO 2026-11-22 01:25:13,587 controller 1 -- autoscale 1 -> 2 (saturated): demand=1.750 load=1.750 waiting=6 \
reporting=1 target=0.75±0.10
INFO 2026-11-22 01:25:20,500 controller 1 -- Replica(id='bbb', deployment='EngineReplica', app='slotserve') started \
successfully on node 'n1' after 6.9s (PID: 7). Replica constructor, reconfigure method, and initial health check took 3.1s.
INFO 2026-11-22 01:26:07,863 controller 1 -- autoscale 2 -> 1 (below_band): demand=0.373 load=0.186 waiting=0 \
reporting=2 target=0.75±0.10
INFO 2026-11-22 01:26:08,000 controller 1 -- Stopping Replica(id='bbb', deployment='EngineReplica', app='slotserve') \
(currently ReplicaState.RUNNING).
INFO 2026-11-22 01:26:12,500 controller 1 -- Replica(id='bbb', deployment='EngineReplica', app='slotserve') is stopped.
"""
REPLICA = """\
INFO 2026-11-22 01:26:01,000 slotserve_EngineReplica bbb -- LINK r1 OK 2000.0ms
INFO 2026-11-22 01:26:09,000 slotserve_EngineReplica bbb -- LINK r2 OK 3000.0ms
INFO 2026-11-22 01:26:10,000 slotserve_EngineReplica bbb r3 -- CALL model_info OK 3.0ms
INFO 2026-11-22 01:26:12,000 slotserve_EngineReplica bbb -- LINK r4 ERROR 4500.0ms
INFO 2026-11-22 01:26:12,100 slotserve_EngineReplica bbb r5 -- CALL link_address OK 1.0ms
INFO 2026-11-22 01:26:14,000 slotserve_EngineReplica bbb -- LINK 6f94488976c54b46 OK 6500.0ms
INFO 2026-11-22 01:26:14,100 slotserve_EngineReplica bbb -- LINK 0241 CANCELLED 1000.0ms
"""


def _t(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_serve_log_lines_are_read(tmp_path):
    (tmp_path / "controller_1.log").write_text(CONTROLLER)
    (tmp_path / "replica_slotserve_EngineReplica_bbb.log").write_text(REPLICA)
    decisions = policy_decisions(tmp_path)
    assert [(d.current, d.desired, d.rule) for d in decisions] == [(1, 2, "saturated"), (2, 1, "below_band")]
    assert decisions[0].t == _t("2026-11-22 01:25:13,587") and decisions[0].inputs.startswith("demand=1.750")
    assert replica_start(tmp_path, "bbb") == (6.9, 3.1) and replica_start(tmp_path, "zzz") is None
    stopping, stopped = replica_stop_times(tmp_path, "bbb")
    assert (stopping, stopped) == (_t("2026-11-22 01:26:08,000"), _t("2026-11-22 01:26:12,500"))
    calls = engine_calls(tmp_path, "slotserve", "bbb")
    # by start; model_info and link_address are Serve calls, not requests
    assert [c[2] for c in calls] == ["OK", "OK", "ERROR", "OK", "CANCELLED"]
    # r1 ended before the stop; r2 (started 01:26:06), r4 and 6f94... (both started 01:26:07.5) spanned it.
    assert [c[2] for c in calls_across(calls, stopping)] == ["OK", "ERROR", "OK"]


def test_outcome_is_complete_only_with_every_token():
    def outcome(**kw):
        return Outcome(**{"start": 0.0, "asked": 8, "tokens": 8, "completion_tokens": 8,
                          "finish_reason": "FINISH_REASON_LENGTH", **kw})

    assert outcome().complete
    assert not outcome(asked=9).complete
    assert not outcome(tokens=5).complete                      # the stream lost tokens
    assert not outcome(finish_reason="FINISH_REASON_ABORT").complete
    assert not outcome(error="UNAVAILABLE: gone", tokens=3, finish_reason="").complete


def test_report_table_and_plot(tmp_path):
    figures = {"step_to_decision_s": 1.2, "step_to_second_replica_running_s": 9.5, "new_replica_start_s": 6.9,
               "new_replica_constructor_s": 3.1, "step_to_first_request_on_new_replica_s": 11.0,
               "step_to_first_completion_on_new_replica_s": None, "drop_to_decision_s": 5.0,
               "drop_to_one_replica_s": 6.1, "drain_s": 1.1, "in_flight_on_stopping_replica": 2,
               "requests_during_scale_down": 5, "failed_during_scale_down": 0, "truncated_during_scale_down": 0,
               "requests": 40, "failed": 0, "truncated": 0, "request_e2e_s": {"p50": 2.5, "max": 7.25},
               "decisions": [{"t_s": 1.2, "from": 1, "to": 2}, {"t_s": 20.0, "from": 2, "to": 1}]}
    timeline = [{"t_s": t / 4, "states": {"RUNNING": 1 + (8 <= t < 80)}, "in_flight": 14 if t < 60 else 4,
                 "occupancy": {"a": 0.9, **({"b": 0.5} if 40 <= t < 80 else {})}, "waiting": 0, "load_ok": True}
                for t in range(-8, 100)]
    results = {"model": "tiny", "quick": True, "drain_timeout_s": 20, "max_num_seqs": 8,
               "knobs": {"target_occupancy": 0.75, "min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 1.0,
                         "downscale_delay_s": 3.0, "metrics_interval_s": 0.5, "look_back_period_s": 1.0},
               "load": {"step_clients": 14, "trickle_clients": 4, "max_tokens": 200},
               "environment": {"load_average_at_start": [1.0, 1.0, 1.0]}, "figures": figures,
               "timeline": timeline, "marks_s": {"drop": 15.0}}
    table = format_table(results)
    assert "load step -> 2nd replica RUNNING" in table and "9.5 s" in table
    row = next(line for line in table.splitlines() if line.startswith("load step -> first completion"))
    assert row.split()[-1] == "-"  # not measured: shown as such, not as 0
    assert "upscale 1.0 s, downscale 3.0 s" in table and "0 / 0" in table and "2.5 s / 7.25 s" in table
    plot(results, tmp_path / "a.png")
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
