"""Replica autoscaling on slot occupancy: a pure decision function and its Serve adapter.

Every replica reports ``slot_occupancy`` (running / max_num_seqs, or KV usage when
higher; capped at 1) and ``waiting`` (requests queued in its engine). Demand is measured
in replicas' worth of slots:

    demand  = sum_i occupancy_i + sum_i waiting_i / slots_i + queued_at_handles / slots
    desired = ceil(demand / target_occupancy)

``slots_i`` is the replica's ``max_num_seqs`` metric when it reports one, else
``slots_per_replica``. Replicas that have not reported yet count as idle; with no report
at all the count is kept. The count only changes when ``demand / current`` leaves the
band ``target_occupancy ± hysteresis`` (no flapping), or when every replica is full and
requests wait (then at least one more replica). A change must be wanted for the whole
``upscale_delay_s`` / ``downscale_delay_s``; it then moves to the count that was wanted
throughout (the smallest proposal seen while scaling up, the largest while scaling
down), so a single spike moves nothing. Serve itself steps down to zero through one
replica, so going from N to zero takes the downscale delay twice.

Self-contained on purpose (stdlib only): Serve cloudpickles the policy by value and runs
it in the controller about every 0.1 s.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

logger = logging.getLogger(__name__)

POLICY_PATH = "router.autoscale:SlotOccupancyPolicy"
_SATURATED = 1.0 - 1e-6
_STATE_KEYS = ("slot_direction", "slot_since", "slot_bound")


def _number(name: str, value: Any, lo: float, hi: float = math.inf, *, lo_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < lo or value > hi or (lo_open and value == lo):
        bounds = f"{'(' if lo_open else '['}{lo}, {hi}{']' if math.isfinite(hi) else ')'}"
        raise ValueError(f"{name} must be a number in {bounds}, got {value!r}")


def _integer(name: str, value: Any, lo: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")


UPSCALE_DELAY_S = 30.0
DOWNSCALE_DELAY_S = 600.0
"""Ray Serve's own defaults, wherever a deployment says nothing (the app config, the policy's kwargs)."""


@dataclass(frozen=True, kw_only=True)
class AutoscaleConfig:
    min_replicas: int
    max_replicas: int
    target_occupancy: float = 0.75
    """Slot occupancy per replica the policy steers towards, in (0, 1]."""
    hysteresis: float = 0.1
    """Half-width of the band around the target inside which the count is kept."""
    upscale_delay_s: float = UPSCALE_DELAY_S
    downscale_delay_s: float = DOWNSCALE_DELAY_S
    scale_to_zero: bool = False
    """Allows ``min_replicas=0``; a request waiting at zero replicas then brings one up at once."""
    slots_per_replica: int = 32
    """Slots of a replica that does not report ``max_num_seqs`` (and of queued-at-handle demand)."""

    def __post_init__(self) -> None:
        if not isinstance(self.scale_to_zero, bool):
            raise ValueError(f"scale_to_zero must be a bool, got {self.scale_to_zero!r}")
        _integer("min_replicas", self.min_replicas, 0 if self.scale_to_zero else 1)
        _integer("max_replicas", self.max_replicas, max(self.min_replicas, 1))
        _number("target_occupancy", self.target_occupancy, 0.0, 1.0, lo_open=True)
        _number("hysteresis", self.hysteresis, 0.0, self.target_occupancy)
        if self.hysteresis >= self.target_occupancy:
            raise ValueError(f"hysteresis must be below target_occupancy ({self.target_occupancy}), "
                             f"got {self.hysteresis!r}")
        _number("upscale_delay_s", self.upscale_delay_s, 0.0)
        _number("downscale_delay_s", self.downscale_delay_s, 0.0)
        _integer("slots_per_replica", self.slots_per_replica, 1)


@dataclass(frozen=True)
class ReplicaMetrics:
    slot_occupancy: float
    waiting: float = 0.0
    max_num_seqs: int | None = None


def _demand(reps: Sequence[ReplicaMetrics], cfg: AutoscaleConfig, extra_waiting: float) -> tuple[float, float]:
    """(demand in replicas' worth of slots, total waiting requests)."""
    occupancy = sum(min(max(m.slot_occupancy, 0.0), 1.0) for m in reps)
    waiting = max(extra_waiting, 0.0)
    queued = waiting / cfg.slots_per_replica
    for m in reps:
        w = max(m.waiting, 0.0)
        waiting += w
        slots = m.max_num_seqs if m.max_num_seqs and m.max_num_seqs > 0 else cfg.slots_per_replica
        queued += w / slots
    return occupancy + queued, waiting


def _propose(reps, current: int, cfg: AutoscaleConfig, extra_waiting: float) -> tuple[int, dict]:
    demand, waiting = _demand(reps, cfg, extra_waiting)
    raw = max(math.ceil(demand / cfg.target_occupancy - 1e-9), 0)
    load = demand / current if current else math.inf if demand > 0 else 0.0
    saturated = bool(reps) and waiting > 0 and all(m.slot_occupancy >= _SATURATED for m in reps)
    if current == 0:
        proposal, rule = (max(raw, 1), "cold_start") if demand > 0 else (0, "idle")
    elif not reps and waiting == 0:
        # No replica has reported yet (just started): no evidence to scale down on.
        proposal, rule = current, "no_metrics"
    elif saturated:
        proposal, rule = max(raw, current + 1), "saturated"
    elif abs(load - cfg.target_occupancy) <= cfg.hysteresis + 1e-9:
        proposal, rule = current, "in_band"
    else:
        proposal, rule = raw, "above_band" if load > cfg.target_occupancy else "below_band"
    lo = cfg.min_replicas if cfg.scale_to_zero else max(cfg.min_replicas, 1)
    clamped = min(max(proposal, lo), cfg.max_replicas)
    reason = {"rule": rule, "demand": round(demand, 4), "load": round(load, 4), "waiting": waiting,
              "reporting": len(reps), "raw": raw, "proposal": clamped}
    return clamped, reason


def decide(
    metrics: Sequence[ReplicaMetrics] | Mapping[Any, ReplicaMetrics],
    current_replicas: int,
    cfg: AutoscaleConfig,
    state: Mapping[str, Any] | None,
    now: float,
    *,
    extra_waiting: float = 0.0,
    log: logging.Logger | None = None,
) -> tuple[int, dict, dict]:
    """One autoscaling tick: ``(desired replicas, new state, reason)``.

    ``current_replicas`` is the count currently aimed at (Serve's target, which may be
    ahead of the replicas already running); ``metrics`` come from the running replicas.
    ``extra_waiting`` counts requests waiting outside any replica (queued in Serve
    handles). ``state`` is the previous tick's state (or empty); it is not mutated, and
    keys this policy does not own are carried over. Changes of the count are logged.
    """
    _integer("current_replicas", current_replicas, 0)
    _number("now", now, -math.inf)
    reps = list(metrics.values()) if isinstance(metrics, Mapping) else list(metrics)
    proposal, reason = _propose(reps, current_replicas, cfg, extra_waiting)
    new_state = dict(state or {})
    direction = (proposal > current_replicas) - (proposal < current_replicas)
    out_of_bounds = not (cfg.min_replicas <= current_replicas <= cfg.max_replicas)
    if direction == 0 or out_of_bounds or (current_replicas == 0 and proposal > 0):
        # Nothing to wait for: no change, a count outside the bounds, or requests stuck at zero.
        desired = proposal
        new_state.update(dict.fromkeys(_STATE_KEYS))
    else:
        desired, pending = _sustain(direction, proposal, current_replicas, cfg, new_state, now)
        reason["pending_s"] = round(pending, 3)
    if desired != current_replicas:
        (log or logger).info(
            "autoscale %d -> %d (%s): demand=%.3f load=%.3f waiting=%g reporting=%d target=%.2f±%.2f",
            current_replicas, desired, reason["rule"], reason["demand"], reason["load"], reason["waiting"],
            reason["reporting"], cfg.target_occupancy, cfg.hysteresis)
    return desired, new_state, reason


def _sustain(direction: int, proposal: int, current: int, cfg: AutoscaleConfig,
             state: dict, now: float) -> tuple[int, float]:
    """Apply a change only once it has been wanted, in the same direction, for the whole delay."""
    since, bound = state.get("slot_since"), state.get("slot_bound")
    if state.get("slot_direction") != direction or not isinstance(since, (int, float)) or not isinstance(bound, int):
        since, bound = now, proposal
    bound = min(bound, proposal) if direction > 0 else max(bound, proposal)
    delay = cfg.upscale_delay_s if direction > 0 else cfg.downscale_delay_s
    pending = now - since
    if pending + 1e-6 >= delay:
        state.update(dict.fromkeys(_STATE_KEYS))
        return bound, pending
    state.update(slot_direction=direction, slot_since=since, slot_bound=bound)
    return current, pending


# ---------------------------------------------------------------- Ray Serve adapter
# No ray import: Serve hands the policy an AutoscalingContext and only its attributes are read.

_KNOBS = ("target_occupancy", "hysteresis", "upscale_delay_s", "downscale_delay_s", "slots_per_replica")
_SERVE_LOGGER = logging.getLogger("ray.serve")  # the controller's log file; plain loggers go nowhere there
_GAUGE_HELP = {
    "slotserve_autoscaler_desired_replicas": "Replicas SlotOccupancyPolicy asks for (after bounds and delays).",
    "slotserve_autoscaler_current_replicas": "Replicas running, as the policy saw them.",
    "slotserve_autoscaler_demand": "Demand in replicas' worth of slots (occupancy + queued / slots).",
}
AUTOSCALER_METRICS = dict.fromkeys(_GAUGE_HELP, "gauge")
"""Prometheus gauges the policy records from Serve's controller (tags: application, deployment)."""


class _PolicyGauges:
    """The policy's decisions as Prometheus gauges. The policy runs in Serve's controller, a
    Ray actor but no replica: plain ``ray.util.metrics`` (ray.serve.metrics would add nothing).
    Never lets a metrics failure reach the policy."""

    def __init__(self) -> None:
        self._gauges: dict | None = None
        self._failed = False

    def record(self, ctx: Any, desired: int, demand: float) -> None:
        ray = sys.modules.get("ray")
        if self._failed or ray is None or not ray.is_initialized():  # unit tests, offline use
            return
        try:
            if self._gauges is None:
                from ray.util.metrics import Gauge
                self._gauges = {name: Gauge(name, help_, tag_keys=("application", "deployment"))
                                for name, help_ in _GAUGE_HELP.items()}
            tags = {"application": str(ctx.app_name or ""), "deployment": str(ctx.deployment_name)}
            values = (desired, ctx.current_num_replicas, demand)
            for gauge, value in zip(self._gauges.values(), values):
                gauge.set(float(value), tags)
        except Exception as exc:  # noqa: BLE001 - no ray, or an odd context: scale anyway
            self._failed = True
            _SERVE_LOGGER.warning("SlotOccupancyPolicy: autoscaler metrics disabled: %s", exc)


def metrics_from_context(ctx: Any) -> list[ReplicaMetrics]:
    """Per-replica metrics from ``ctx.aggregated_metrics`` ({name: {ReplicaID: mean over the look-back}})."""
    agg = ctx.aggregated_metrics or {}
    occupancy = agg.get("slot_occupancy") or {}
    waiting = agg.get("waiting") or {}
    seqs = agg.get("max_num_seqs") or {}
    return [ReplicaMetrics(float(occ), float(waiting.get(rid, 0.0)), int(seqs[rid]) if rid in seqs else None)
            for rid, occ in occupancy.items()]


class SlotOccupancyPolicy:
    """Serve's custom autoscaling policy, class form: Serve builds it once with ``policy_kwargs``.

    The knobs (``_KNOBS``) come from ``policy_kwargs``; the bounds from Serve's
    ``min_replicas`` / ``max_replicas`` (adjusted for target capacity; ``min_replicas=0``
    means scale to zero). The delays are the policy's own: Serve applies its
    ``upscale_delay_s`` / ``downscale_delay_s`` on top of any custom policy, so those
    must be 0 (``autoscaling_config`` sets them).
    """

    def __init__(self, **knobs: Any) -> None:
        unknown = sorted(set(knobs) - set(_KNOBS))
        if unknown:
            raise ValueError(f"unknown policy_kwargs {unknown}; allowed: {list(_KNOBS)}")
        AutoscaleConfig(min_replicas=1, max_replicas=1, **knobs)  # fail at deploy time, not every tick
        self._knobs = dict(knobs)
        self._configs: dict[tuple[int, int], AutoscaleConfig] = {}
        self._warned_serve_delays = False
        self._gauges = _PolicyGauges()

    def __call__(self, ctx: Any) -> tuple[int, dict]:
        hi = int(ctx.capacity_adjusted_max_replicas)
        state = ctx.policy_state or {}
        if hi <= 0:  # target capacity 0: nothing may run
            return 0, dict(state)
        lo = min(int(ctx.capacity_adjusted_min_replicas), hi)
        cfg = self._configs.get((lo, hi))
        if cfg is None:
            cfg = self._configs[(lo, hi)] = AutoscaleConfig(
                min_replicas=lo, max_replicas=hi, scale_to_zero=lo == 0, **self._knobs)
        self._warn_on_serve_delays(ctx.config)
        queued = ctx.total_queued_requests or 0.0
        now = ctx.current_time if ctx.current_time is not None else time.time()
        desired, new_state, reason = decide(metrics_from_context(ctx), int(ctx.target_num_replicas), cfg, state,
                                            now, extra_waiting=float(queued), log=_SERVE_LOGGER)
        self._gauges.record(ctx, desired, reason["demand"])
        return desired, new_state

    def _warn_on_serve_delays(self, serve_config: Any) -> None:
        if self._warned_serve_delays or serve_config is None:
            return
        up = getattr(serve_config, "upscale_delay_s", 0) or 0
        down = getattr(serve_config, "downscale_delay_s", 0) or 0
        if up or down:
            self._warned_serve_delays = True
            _SERVE_LOGGER.warning(
                "Serve's upscale_delay_s=%s / downscale_delay_s=%s add to SlotOccupancyPolicy's own delays; "
                "set them to 0 (router.autoscale.autoscaling_config does).", up, down)


_DEFAULT_POLICY = SlotOccupancyPolicy()


def slot_occupancy_policy(ctx: Any) -> tuple[int, dict]:
    """Function form with the default knobs (Serve passes no kwargs to a plain function)."""
    return _DEFAULT_POLICY(ctx)


def autoscaling_config(
    min_replicas: int,
    max_replicas: int,
    *,
    target_occupancy: float = 0.75,
    hysteresis: float = 0.1,
    upscale_delay_s: float = UPSCALE_DELAY_S,
    downscale_delay_s: float = DOWNSCALE_DELAY_S,
    scale_to_zero: bool = False,
    slots_per_replica: int = 32,
    metrics_interval_s: float = 0.5,
    look_back_period_s: float = 1.0,
    initial_replicas: int | None = None,
) -> dict:
    """A deployment's ``autoscaling_config`` (Python or Serve YAML) running ``SlotOccupancyPolicy``.

    ``metrics_interval_s`` is how often replicas push ``record_autoscaling_stats``
    (deprecated in Serve's schema, still honoured in 2.60); the look-back must exceed it.
    """
    knobs = dict(target_occupancy=target_occupancy, hysteresis=hysteresis, upscale_delay_s=upscale_delay_s,
                 downscale_delay_s=downscale_delay_s, slots_per_replica=slots_per_replica)
    AutoscaleConfig(min_replicas=min_replicas, max_replicas=max_replicas, scale_to_zero=scale_to_zero, **knobs)
    _number("metrics_interval_s", metrics_interval_s, 0.0, lo_open=True)
    _number("look_back_period_s", look_back_period_s, metrics_interval_s, lo_open=True)
    config = {
        "min_replicas": min_replicas,
        "max_replicas": max_replicas,
        "metrics_interval_s": float(metrics_interval_s),
        "look_back_period_s": float(look_back_period_s),
        # The policy sustains changes itself; Serve's own delays would add to it.
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0,
        "downscale_to_zero_delay_s": 0.0,
        "policy": {"policy_function": POLICY_PATH, "policy_kwargs": knobs},
    }
    if initial_replicas is not None:
        _integer("initial_replicas", initial_replicas, min_replicas)
        if initial_replicas > max_replicas:
            raise ValueError(f"initial_replicas must be <= max_replicas ({max_replicas}), got {initial_replicas}")
        config["initial_replicas"] = initial_replicas
    return config
