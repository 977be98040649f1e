"""Slot-occupancy autoscaling (router.autoscale): the pure decision and the Serve adapter, without a cluster."""

from __future__ import annotations

import logging
import random
from types import SimpleNamespace

import pytest

from router.autoscale import (
    AutoscaleConfig,
    ReplicaMetrics,
    SlotOccupancyPolicy,
    autoscaling_config,
    decide,
    metrics_from_context,
    slot_occupancy_policy,
)

CFG = AutoscaleConfig(min_replicas=1, max_replicas=8, upscale_delay_s=5.0, downscale_delay_s=30.0,
                      slots_per_replica=8)


def fleet(n, occupancy, waiting=0.0):
    return [ReplicaMetrics(occupancy, waiting, 8) for _ in range(n)]


class Sim:
    """Ticks the policy like Serve's controller does (every 0.1 s), applying decisions at once."""

    def __init__(self, replicas, cfg=CFG, t=0.0):
        self.replicas, self.cfg, self.t, self.state = replicas, cfg, t, {}
        self.changes = []

    def tick(self, metrics, dt=0.1, **kw):
        self.t += dt
        desired, self.state, reason = decide(metrics, self.replicas, self.cfg, self.state, self.t, **kw)
        if desired != self.replicas:
            self.changes.append((round(self.t, 3), self.replicas, desired))
        self.replicas = desired
        return reason

    def run(self, seconds, metrics_fn, **kw):
        for _ in range(round(seconds / 0.1)):
            self.tick(metrics_fn(self.replicas), **kw)


def test_sustained_high_occupancy_scales_up_after_the_delay():
    sim = Sim(2)
    sim.run(4.8, lambda n: fleet(n, 1.0))
    assert sim.replicas == 2 and sim.state["slot_direction"] == 1
    sim.run(0.5, lambda n: fleet(n, 1.0))
    # demand 2.0 / target 0.75 -> 3 replicas, once, right after the 5 s delay.
    assert sim.changes == [(5.1, 2, 3)]


def test_a_single_spike_does_not_scale():
    sim = Sim(2)
    sim.run(3.0, lambda n: fleet(n, 1.0))
    sim.tick(fleet(2, 0.7))  # back inside the band: the pending scale-up is dropped
    sim.run(4.0, lambda n: fleet(n, 1.0))
    assert sim.replicas == 2 and sim.changes == []


def test_scale_up_goes_to_the_level_sustained_throughout():
    sim = Sim(1)
    sim.run(4.0, lambda n: fleet(n, 1.0))                 # wants 2
    sim.run(1.2, lambda n: fleet(n, 1.0, waiting=40.0))   # a late burst wants 8
    assert sim.changes == [(5.1, 1, 2)]


def test_scale_down_after_the_downscale_delay():
    sim = Sim(4)
    total = 1.2  # busy slots' worth across the fleet: 2 replicas near the target
    sim.run(29.9, lambda n: fleet(n, total / n))
    assert sim.replicas == 4
    sim.run(0.5, lambda n: fleet(n, total / n))
    assert sim.changes == [(30.1, 4, 2)]
    sim.run(120, lambda n: fleet(n, total / n))
    assert sim.replicas == 2


def test_bounds_clamp_the_decision():
    cfg = AutoscaleConfig(min_replicas=2, max_replicas=3, upscale_delay_s=0.0, downscale_delay_s=0.0)
    desired, _, reason = decide(fleet(3, 1.0, waiting=100), 3, cfg, {}, 0.0)
    assert desired == 3 and reason["raw"] > 3
    desired, _, _ = decide(fleet(3, 0.0), 3, cfg, {}, 0.0)
    assert desired == 2
    # A count outside the bounds moves back at once, without waiting for a delay.
    slow = AutoscaleConfig(min_replicas=2, max_replicas=3, upscale_delay_s=100.0, downscale_delay_s=100.0)
    assert decide(fleet(1, 0.75), 1, slow, {}, 0.0)[0] == 2
    assert decide(fleet(5, 0.75), 5, slow, {}, 0.0)[0] == 3


def test_waiting_requests_force_scale_up_at_full_occupancy():
    # Target 0.95 with a 0.1 band: full replicas alone (load 1.0) sit inside the band ...
    cfg = AutoscaleConfig(min_replicas=1, max_replicas=8, target_occupancy=0.95, hysteresis=0.1,
                          upscale_delay_s=0.0, slots_per_replica=8)
    assert decide(fleet(2, 1.0), 2, cfg, {}, 0.0)[0] == 2
    # ... but one request waiting behind them needs another replica.
    desired, _, reason = decide(fleet(2, 1.0, waiting=0.5), 2, cfg, {}, 0.0)
    assert desired == 3 and reason["rule"] == "saturated"
    # Requests queued in Serve's handles count as waiting too.
    assert decide(fleet(2, 1.0), 2, cfg, {}, 0.0, extra_waiting=1.0)[0] == 3


def test_steady_load_at_target_never_oscillates():
    rng = random.Random(0)
    sim = Sim(3, AutoscaleConfig(min_replicas=1, max_replicas=8, upscale_delay_s=1.0, downscale_delay_s=3.0))
    demand = 3 * 0.75
    # Noise of +-0.08 per replica around the target, sampled every tick, for 10 simulated minutes.
    sim.run(600, lambda n: [ReplicaMetrics(demand / n + rng.uniform(-0.08, 0.08)) for _ in range(n)])
    assert sim.changes == []


def test_a_short_lull_does_not_scale_down():
    def busy(n):  # 3 replicas' worth of busy slots: 4 replicas run at the target
        return fleet(n, 3.0 / n)

    sim = Sim(4)
    sim.run(60, busy)
    sim.run(20, lambda n: fleet(n, 0.0))  # idle for less than the 30 s downscale delay
    sim.run(60, busy)
    assert sim.changes == []


@pytest.mark.parametrize("start", [1, 2])
def test_a_load_between_two_counts_holds_either_count(start):
    # 0.8 replica's worth of busy slots: one replica runs at 0.8 (inside the band), two
    # would be needed to get under the target (ceil(0.8 / 0.75) = 2). Whichever count the
    # fleet has, it keeps: the band and the rounding overlap instead of fighting.
    rng = random.Random(start)
    sim = Sim(start, AutoscaleConfig(min_replicas=1, max_replicas=4, upscale_delay_s=1.0, downscale_delay_s=3.0))
    sim.run(600, lambda n: [ReplicaMetrics((0.8 + rng.uniform(-0.04, 0.04)) / n) for _ in range(n)])
    assert sim.changes == [] and sim.replicas == start


def test_the_log_line_carries_the_decision_inputs(caplog):
    with caplog.at_level(logging.INFO, logger="router.autoscale"):
        cfg = AutoscaleConfig(min_replicas=1, max_replicas=4, downscale_delay_s=0.0)
        decide(fleet(3, 0.1), 3, cfg, {}, 0.0)
    (rec,) = caplog.records
    message = rec.getMessage()
    assert message.startswith("autoscale 3 -> 1 (below_band): ")
    for field in ("demand=0.300", "load=0.100", "waiting=0", "reporting=3", "target=0.75"):
        assert field in message, message


def test_load_steps_settle_without_flapping():
    sim = Sim(1, AutoscaleConfig(min_replicas=1, max_replicas=8, upscale_delay_s=1.0, downscale_delay_s=3.0))
    for busy in (0.5, 3.0, 5.5, 1.0, 0.2):  # total busy slots' worth, held for a minute each
        sim.run(60, lambda n: fleet(n, min(busy / n, 1.0), waiting=max(busy - n, 0) * 8 / n))
    # Each step moves the count at most once, in the step's direction.
    assert [c[2] for c in sim.changes] == [4, 8, 2, 1]


def test_scale_to_zero_and_back():
    cfg = AutoscaleConfig(min_replicas=0, max_replicas=4, scale_to_zero=True, upscale_delay_s=10.0,
                          downscale_delay_s=5.0)
    sim = Sim(1, cfg)
    sim.run(6, lambda n: fleet(n, 0.0))
    assert sim.replicas == 0
    sim.run(5, lambda n: [])
    assert sim.replicas == 0
    # A request waiting at zero replicas brings one up on the next tick despite the 10 s delay.
    sim.tick([], extra_waiting=1.0)
    assert sim.replicas == 1


def test_without_scale_to_zero_an_idle_fleet_keeps_one():
    sim = Sim(3, AutoscaleConfig(min_replicas=1, max_replicas=4, downscale_delay_s=1.0))
    sim.run(10, lambda n: fleet(n, 0.0))
    assert sim.replicas == 1


def test_no_reports_yet_keeps_the_count():
    cfg = AutoscaleConfig(min_replicas=1, max_replicas=4, upscale_delay_s=0.0, downscale_delay_s=0.0)
    desired, _, reason = decide([], 3, cfg, {}, 0.0)
    assert desired == 3 and reason["rule"] == "no_metrics"
    # Requests queued in the handles are evidence enough.
    assert decide([], 1, cfg, {}, 0.0, extra_waiting=64.0)[0] > 1


def test_decisions_that_change_the_count_are_logged(caplog):
    with caplog.at_level(logging.INFO, logger="router.autoscale"):
        cfg = AutoscaleConfig(min_replicas=1, max_replicas=4, upscale_delay_s=0.0)
        decide(fleet(1, 0.7), 1, cfg, {}, 0.0)       # in band: no change, no log
        assert caplog.records == []
        decide(fleet(1, 1.0, waiting=4), 1, cfg, {}, 0.0)
    (rec,) = caplog.records
    assert "autoscale 1 -> " in rec.getMessage() and "saturated" in rec.getMessage()


def test_state_is_not_mutated_and_foreign_keys_survive():
    state = {"serve_internal": 3}
    _, new_state, _ = decide(fleet(2, 1.0), 2, CFG, state, 0.0)
    assert state == {"serve_internal": 3}
    assert new_state["serve_internal"] == 3 and new_state["slot_direction"] == 1


@pytest.mark.parametrize("kwargs, field", [
    ({"target_occupancy": 0.0}, "target_occupancy"), ({"target_occupancy": 1.5}, "target_occupancy"),
    ({"hysteresis": -0.1}, "hysteresis"), ({"hysteresis": 0.75}, "hysteresis"),
    ({"min_replicas": 0}, "min_replicas"), ({"max_replicas": 0}, "max_replicas"),
    ({"min_replicas": 3, "max_replicas": 2}, "max_replicas"), ({"upscale_delay_s": -1}, "upscale_delay_s"),
    ({"downscale_delay_s": float("nan")}, "downscale_delay_s"), ({"scale_to_zero": 1}, "scale_to_zero"),
    ({"slots_per_replica": 0}, "slots_per_replica"), ({"min_replicas": True}, "min_replicas"),
])
def test_config_validation_names_the_field(kwargs, field):
    base = {"min_replicas": 1, "max_replicas": 4}
    with pytest.raises(ValueError, match=field):
        AutoscaleConfig(**{**base, **kwargs})


def test_decide_rejects_a_bad_current_count():
    with pytest.raises(ValueError, match="current_replicas"):
        decide([], -1, CFG, {}, 0.0)


# ----------------------------------------------------------------------------- Serve adapter
def ctx(occupancy, waiting=None, *, target=2, lo=1, hi=4, state=None, queued=0.0, t=0.0, config=None):
    waiting = waiting or {}
    return SimpleNamespace(
        aggregated_metrics={"slot_occupancy": occupancy, "waiting": waiting},
        capacity_adjusted_min_replicas=lo, capacity_adjusted_max_replicas=hi,
        target_num_replicas=target, current_num_replicas=len(occupancy), policy_state=state or {},
        total_queued_requests=queued, current_time=t,
        config=config or SimpleNamespace(upscale_delay_s=0.0, downscale_delay_s=0.0))


def test_adapter_reads_the_context_and_carries_state():
    policy = SlotOccupancyPolicy(upscale_delay_s=1.0, slots_per_replica=8)
    desired, state = policy(ctx({"r1": 1.0, "r2": 1.0}, {"r1": 2.0}, t=0.0))
    assert desired == 2 and state["slot_direction"] == 1
    desired, state = policy(ctx({"r1": 1.0, "r2": 1.0}, {"r1": 2.0}, state=state, t=1.0))
    assert desired == 3
    assert metrics_from_context(ctx({"r": 0.5}, {"r": 3.0}))[0] == ReplicaMetrics(0.5, 3.0, None)


def test_adapter_bounds_and_scale_to_zero_come_from_serve():
    policy = SlotOccupancyPolicy(downscale_delay_s=0.0)
    assert policy(ctx({"r1": 0.0}, target=1, lo=0))[0] == 0
    assert policy(ctx({"r1": 0.0}, target=1, lo=1))[0] == 1
    assert policy(ctx({}, target=0, lo=0, queued=2.0))[0] == 1
    assert policy(ctx({"r1": 1.0}, target=1, hi=0))[0] == 0
    assert slot_occupancy_policy(ctx({"r1": 0.7, "r2": 0.8}))[0] == 2


def test_adapter_rejects_unknown_knobs():
    with pytest.raises(ValueError, match="unknown policy_kwargs"):
        SlotOccupancyPolicy(target=0.5)
    with pytest.raises(ValueError, match="hysteresis"):
        SlotOccupancyPolicy(hysteresis=0.9)


def test_autoscaling_config_is_accepted_by_serve():
    import yaml
    from ray.serve.config import AutoscalingConfig

    d = autoscaling_config(1, 4, target_occupancy=0.6, upscale_delay_s=2.0)
    parsed = AutoscalingConfig(**yaml.safe_load(yaml.safe_dump(d)))  # the Serve YAML form
    assert parsed.policy.policy_function == "router.autoscale:SlotOccupancyPolicy"
    assert parsed.policy.policy_kwargs["target_occupancy"] == 0.6
    assert parsed.upscale_delay_s == parsed.downscale_delay_s == 0.0
    instance = parsed.policy.get_policy()(**parsed.policy.policy_kwargs)
    assert isinstance(instance, SlotOccupancyPolicy)


@pytest.mark.parametrize("kwargs, field", [
    ({"min_replicas": 0}, "min_replicas"), ({"look_back_period_s": 0.5}, "look_back_period_s"),
    ({"initial_replicas": 9}, "initial_replicas"), ({"target_occupancy": 2}, "target_occupancy"),
])
def test_autoscaling_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        autoscaling_config(**{"min_replicas": 1, "max_replicas": 4, **kwargs})
