"""``python -m benchmarks.autoscale [--quick] [--config FILE] [--out-dir D]``: autoscaling on a load step.

Starts a local Ray and the application of a Serve config (``configs/local-cpu.yaml``:
the default model, its autoscaling knobs) on free ports, then:

1. idle, one replica;
2. load step: closed-loop gRPC clients, more streams than one replica has slots
   (the policy sees full slots and a queue), plus a short request every second as new
   arrivals -> time to the scale-up decision, to the second replica RUNNING, to the
   first request it serves;
3. the load drops to a trickle half a replica can hold -> time to the scale-down
   decision and to one replica again; the streams in flight on the stopping replica
   are counted from its access log, and every request is checked for errors and for
   the exact number of tokens asked (failed / truncated).

``--quick``: a tiny random model and fast knobs (what tests/test_autoscale_e2e.py runs).
Prints a table; writes ``autoscale[-quick].json`` and ``.png`` (replicas, occupancy,
in-flight requests over time) to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from benchmarks.autoscale_load import (Clients, Monitor, calls_across, engine_calls, policy_decisions,
                                       replica_start, replica_stop_times, serve_log_dir)
from deployments.ingress_env import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = "configs/local-cpu.yaml"
ARRIVAL_TOKENS, ARRIVAL_INTERVAL_S = 4, 1.0
QUICK_ARGS = {
    "served_model_name": "tiny",
    "engine": {"device": "cpu", "dtype": "float32", "max_num_seqs": 8, "max_waiting": 32, "block_size": 16,
               "num_kv_blocks": 256, "max_model_len": 512},
    "autoscaling": {"min_replicas": 1, "max_replicas": 2, "target_occupancy": 0.75, "upscale_delay_s": 1.0,
                    "downscale_delay_s": 3.0, "metrics_interval_s": 0.5, "look_back_period_s": 1.0},
    "replica_resources": {"num_cpus": 0.5}, "ingress": {"num_cpus": 0.25}, "drain_timeout_s": 20,
}


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.autoscale",
                                description="Autoscaling on a load step: how fast replicas come and go, "
                                            "and whether any request is lost on the way.")
    p.add_argument("--quick", action="store_true", help="tiny random model and fast knobs (about a minute)")
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"Serve config whose first app is run ({DEFAULT_CONFIG})")
    p.add_argument("--model", help="override the config's model (local HF directory or built-in name)")
    p.add_argument("--out-dir", default="bench-out", help="where the JSON and PNG go (default bench-out)")
    p.add_argument("--max-tokens", type=_positive_int, help="tokens per request (default: 200 quick, 32 full)")
    p.add_argument("--step-clients", type=_positive_int, help="streams in the load step (default: 1.75 x max_num_seqs)")
    p.add_argument("--trickle-clients", type=_positive_int, help="streams after the drop (default: max_num_seqs / 2)")
    p.add_argument("--hold-s", type=_seconds, help="seconds at two replicas before the drop (default 3 quick, 10 full)")
    p.add_argument("--num-cpus", type=_positive_int, help="logical CPUs of the local Ray (default: all cores)")
    return p


def app_args(args) -> tuple[dict, str]:
    """(the application's args, a label for the model)."""
    from deployments.cli import load_serve_config

    if args.quick:
        from tests.factories import make_model_dir  # the suite's tiny model: a tokenizer comes with it

        model_dir = Path(args.out_dir) / "tiny-model"
        if not (model_dir / "config.json").exists():
            make_model_dir(model_dir, "llama", seed=0)
        app = {**QUICK_ARGS, "model": str(model_dir)}
    else:
        app = dict(load_serve_config(REPO_ROOT / args.config if not Path(args.config).exists() else args.config)
                   ["applications"][0].get("args") or {})
    if args.model:
        app["model"] = args.model
    if not app.get("autoscaling"):
        raise ValueError(f"{args.config}: the application has no autoscaling section")
    return app, "tiny random Llama" if args.quick and not args.model else app.get("model", "smollm2-135m")


def start(app: dict, num_cpus: int | None):
    """Local Ray + Serve (free ports) + the application; returns (serve, gRPC stub, channel)."""
    import grpc
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    from deployments.app import SERVE_ENV, build_app
    from deployments.grpc_registration import SERVICER_FUNCTIONS
    from deployments.proto_gen.slotserve.v1 import slotserve_pb2_grpc

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local, short-lived cluster
    os.environ.update(SERVE_ENV)
    # The controller imports the policy (router.autoscale) by name; workers inherit the path.
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + path if path else "")
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    grpc_port = free_port()
    serve.start(http_options=HTTPOptions(host="127.0.0.1", port=free_port()),
                grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=list(SERVICER_FUNCTIONS)))
    serve.run(build_app(app), name="slotserve", route_prefix="/")
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    return serve, slotserve_pb2_grpc.SlotServeStub(channel), channel


def _new_replica(sample, first: str) -> str | None:
    return next((rid for rid in (sample.loads or {}) if rid != first), None)


def run_scenario(serve, stub, plan: dict) -> dict:
    """The load step and the drop; returns the raw observations (times are time.time())."""
    clients = Clients(stub, plan["max_tokens"])
    marks: dict = {}
    with Monitor(serve, stub, "slotserve", clients, period_s=0.25) as monitor:
        idle = monitor.wait_for(lambda s: s.states == {"RUNNING": 1} and s.loads, 120, "one replica running")
        marks["first"] = next(iter(idle.loads))
        time.sleep(2.0)  # an idle baseline on the plot
        try:
            marks["step"] = time.time()
            clients.add(plan["step_clients"])
            # New users arriving with short requests: the first to land on the new replica
            # shows when it serves, without waiting for a long stream to end and free a client.
            arrivals = clients.add_arrivals(ARRIVAL_INTERVAL_S, max_tokens=ARRIVAL_TOKENS)
            marks["running2"] = monitor.wait_for(lambda s: s.states == {"RUNNING": 2}, 300, "a second replica").t
            second = monitor.wait_for(lambda s: _new_replica(s, marks["first"]), 60, "the new replica's load")
            marks["second"] = _new_replica(second, marks["first"])
            time.sleep(plan["hold_s"])
            marks["drop"] = time.time()
            clients.stop_group(arrivals)
            clients.stop(plan["step_clients"] - plan["trickle_clients"])
            marks["one"] = monitor.wait_for(
                lambda s: s.states == {"RUNNING": 1} and s.loads and set(s.loads) == {marks["first"]},
                plan["downscale_bound_s"], "back to one replica").t
            time.sleep(3.0)  # the trickle goes on at one replica
        finally:
            clients.stop()
            clients.join(600)
        marks["end"] = time.time()
    return {"marks": marks, "samples": monitor.samples, "outcomes": clients.outcomes}


def figures(obs: dict, max_tokens: int) -> dict:
    """The measured figures, relative to the load step / the drop, from the samples and Serve's logs."""
    m, outcomes = obs["marks"], obs["outcomes"]
    logs = serve_log_dir()
    decisions = policy_decisions(logs)
    up = next((d for d in decisions if d.t >= m["step"] and d.desired > d.current), None)
    down = next((d for d in decisions if d.t >= m["drop"] and d.desired < d.current), None)
    new_calls = engine_calls(logs, "slotserve", m["second"])
    stopping, stopped = replica_stop_times(logs, m["second"])
    draining = calls_across(new_calls, stopping) if stopping else []
    start = replica_start(logs, m["second"]) or (None, None)
    window = [o for o in outcomes if stopping and stopped and o.start < stopped and o.end > stopping]

    def since(t, origin):
        return None if t is None else round(t - origin, 2)

    return {
        "step_to_decision_s": since(up and up.t, m["step"]),
        "step_to_second_replica_running_s": since(m["running2"], m["step"]),
        "new_replica_start_s": start[0],
        "new_replica_constructor_s": start[1],
        "step_to_first_request_on_new_replica_s": since(new_calls[0][0] if new_calls else None, m["step"]),
        "step_to_first_completion_on_new_replica_s": since(new_calls[0][1] if new_calls else None, m["step"]),
        "drop_to_decision_s": since(down and down.t, m["drop"]),
        "drop_to_one_replica_s": since(stopped, m["drop"]),
        "drain_s": since(stopped, stopping) if stopping else None,
        "in_flight_on_stopping_replica": len(draining),
        "in_flight_on_stopping_replica_not_ok": sum(status != "OK" for *_, status in draining),
        "requests_during_scale_down": len(window),
        "failed_during_scale_down": sum(o.error is not None for o in window),
        "truncated_during_scale_down": sum(o.error is None and not o.complete for o in window),
        "request_e2e_s": _spread([o.end - o.start for o in outcomes]),
        "requests": len(outcomes),
        "failed": sum(o.error is not None for o in outcomes),
        "truncated": sum(o.error is None and not o.complete for o in outcomes),
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
        "decisions": [{"t_s": since(d.t, m["step"]), "from": d.current, "to": d.desired, "rule": d.rule,
                       "inputs": d.inputs, "log_line": d.line} for d in decisions],
    }


def _spread(values: list[float]) -> dict:
    """Median and maximum: the longest request is what the drain timeout has to cover."""
    if not values:
        return {"p50": None, "max": None}
    values = sorted(values)
    return {"p50": round(values[len(values) // 2], 2), "max": round(values[-1], 2)}


def timeline(obs: dict) -> list[dict]:
    origin = obs["marks"]["step"]
    rows = []
    for s in obs["samples"]:
        loads = s.loads or {}
        rows.append({"t_s": round(s.t - origin, 2), "states": s.states, "in_flight": s.in_flight,
                     "occupancy": {rid: round(v["slot_occupancy"], 3) for rid, v in loads.items()},
                     "waiting": sum(v["waiting"] for v in loads.values()), "load_ok": s.loads is not None})
    return rows


def format_table(results: dict) -> str:
    f, k = results["figures"], results["knobs"]
    plan = results["load"]

    def cell(v, unit=" s"):
        return "-" if v is None else f"{v}{unit}"

    rows = [
        ("load step -> scale-up decision", cell(f["step_to_decision_s"])),
        ("load step -> 2nd replica RUNNING", cell(f["step_to_second_replica_running_s"])),
        ("  of which the replica's start (constructor)",
         f"{cell(f['new_replica_start_s'])} ({cell(f['new_replica_constructor_s'])})"),
        ("load step -> first request on the new replica", cell(f["step_to_first_request_on_new_replica_s"])),
        ("load step -> first completion on the new replica", cell(f["step_to_first_completion_on_new_replica_s"])),
        ("drop -> scale-down decision", cell(f["drop_to_decision_s"])),
        ("drop -> back to 1 replica", cell(f["drop_to_one_replica_s"])),
        ("drain of the stopping replica", cell(f["drain_s"])),
        ("streams in flight on the stopping replica", cell(f["in_flight_on_stopping_replica"], "")),
        ("requests overlapping the scale-down", cell(f["requests_during_scale_down"], "")),
        ("  failed / truncated", f"{f['failed_during_scale_down']} / {f['truncated_during_scale_down']}"),
        ("all requests: total / failed / truncated", f"{f['requests']} / {f['failed']} / {f['truncated']}"),
        ("request duration: median / longest",
         f"{cell(f['request_e2e_s']['p50'])} / {cell(f['request_e2e_s']['max'])}"),
    ]
    width = max(len(r[0]) for r in rows) + 2
    head = [f"autoscaling, model {results['model']} ({'quick' if results['quick'] else 'full'}); "
            f"knobs: target {k.get('target_occupancy')}, replicas {k.get('min_replicas')}..{k.get('max_replicas')}, "
            f"upscale {k.get('upscale_delay_s')} s, downscale {k.get('downscale_delay_s')} s, "
            f"metrics {k.get('metrics_interval_s')} s, look-back {k.get('look_back_period_s')} s, "
            f"drain {results['drain_timeout_s']} s",
            f"load: {plan['step_clients']} streams of {plan['max_tokens']} tokens (+ a {ARRIVAL_TOKENS}-token request "
            f"every {ARRIVAL_INTERVAL_S} s) -> {plan['trickle_clients']} streams; {results['max_num_seqs']} slots per "
            f"replica; host load average "
            f"{results['environment'].get('load_average_at_start')} at start", ""]
    return "\n".join(head + [f"{name:<{width}}{value}" for name, value in rows])


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["timeline"]
    t = [r["t_s"] for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(9, 7.5), sharex=True)
    axes[0].step(t, [r["states"].get("RUNNING", 0) for r in rows], where="post", label="RUNNING")
    axes[0].step(t, [sum(r["states"].values()) for r in rows], where="post", linestyle="--",
                 label="all (incl. STARTING / STOPPING)")
    axes[0].set_ylabel("replicas")
    ids = sorted({rid for r in rows for rid in r["occupancy"]})
    for rid in ids:
        axes[1].plot(t, [r["occupancy"].get(rid, float("nan")) for r in rows], label=f"replica {rid}")
    axes[1].axhline(results["knobs"].get("target_occupancy", 0.75), color="gray", linestyle=":", label="target")
    axes[1].set_ylabel("slot occupancy")
    axes[1].set_ylim(-0.05, 1.05)
    axes[2].plot(t, [r["in_flight"] for r in rows], label="client requests in flight")
    axes[2].plot(t, [r["waiting"] for r in rows], label="waiting in engines")
    axes[2].set_ylabel("requests")
    axes[2].set_xlabel("seconds since the load step")
    for d in results["figures"]["decisions"]:
        for ax in axes:
            ax.axvline(d["t_s"], color="tab:red", alpha=0.4, linewidth=1)
    drop = results["marks_s"]["drop"]
    for ax in axes:
        ax.axvline(drop, color="black", alpha=0.4, linestyle="--", linewidth=1)
        ax.legend(fontsize=7, loc="upper right")
    axes[0].set_title(f"Autoscaling on a load step ({results['model']}); red: policy decisions, dashed: drop")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> dict:
    from benchmarks.report import environment, load_average
    from deployments.app import AppConfig

    app, label = app_args(args)
    cfg = AppConfig.from_args(app)  # bad args fail here, before Ray starts
    if not args.quick:
        from engine.models_hub import resolve_model

        resolve_model(cfg.model)  # convert the default model once, outside the timed part
    slots = cfg.engine_scheduler().max_num_seqs
    knobs = app["autoscaling"]
    plan = {"max_tokens": args.max_tokens or (200 if args.quick else 32),
            "step_clients": args.step_clients or slots + (3 * slots + 3) // 4,
            "trickle_clients": args.trickle_clients or max(1, slots // 2),
            "hold_s": args.hold_s if args.hold_s is not None else (3.0 if args.quick else 10.0),
            "downscale_bound_s": float(knobs.get("downscale_delay_s", 600)) + 180.0}
    if plan["trickle_clients"] >= plan["step_clients"]:
        raise ValueError(f"--trickle-clients ({plan['trickle_clients']}) must be below --step-clients "
                         f"({plan['step_clients']}): the load has to drop")
    load_at_start = load_average()
    serve, stub, channel = start(app, args.num_cpus)
    try:
        obs = run_scenario(serve, stub, plan)
        found = figures(obs, plan["max_tokens"])
    finally:
        import ray

        channel.close()
        serve.shutdown()
        ray.shutdown()
    m = obs["marks"]
    return {"model": label, "quick": args.quick, "config": None if args.quick else args.config,
            "command": "python -m benchmarks.autoscale " + " ".join(sys.argv[1:]),
            "knobs": {**{f: getattr(cfg.autoscaling, f) for f in cfg.autoscaling.__dataclass_fields__}, **knobs},
            "drain_timeout_s": cfg.drain_timeout_s, "max_num_seqs": slots, "engine": dict(cfg.engine),
            "replica_resources": app.get("replica_resources"), "load": plan, "figures": found,
            "marks_s": {k: round(v - m["step"], 2) for k, v in m.items() if isinstance(v, float)},
            "environment": environment(None, load_at_start), "timeline": timeline(obs)}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        results = run(args)
    except (ValueError, FileNotFoundError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    from benchmarks.report import write_json

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = "autoscale-quick" if args.quick else "autoscale"
    results["plot"] = str(out / f"{name}.png")
    write_json(out / f"{name}.json", results)
    plot(results, out / f"{name}.png")
    print(format_table(results))
    print(f"\nwrote {out / (name + '.json')} and {out / (name + '.png')}")
    f = results["figures"]
    return 0 if f["failed"] == 0 and f["truncated"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
