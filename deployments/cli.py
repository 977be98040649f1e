"""The ``slotserve`` command.

    slotserve serve [--config configs/local-cpu.yaml]   # local Ray + the app; Ctrl-C stops it
    slotserve generate --target 127.0.0.1:9000 "Hello"  # stream a completion over gRPC
    slotserve generate --chat "Write a haiku"           # the same, through the chat template
    slotserve load --target 127.0.0.1:9000              # per-replica load, as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from deployments.ingress_env import INGRESS_MODES, INGRESS_NAMES, check_client_ports, default_ingress, ingress_env

DEFAULT_CONFIG = "configs/local-cpu.yaml"
DEFAULT_TARGET = "127.0.0.1:9000"
OWN_SESSION_ENV = "SLOTSERVE_SERVE_OWN_SESSION"
"""Set in the process that runs ``serve`` in a session of its own (see ``supervise``)."""


def _stub(target: str):
    import grpc

    from deployments.proto_gen.slotserve.v1 import slotserve_pb2_grpc
    return slotserve_pb2_grpc.SlotServeStub(grpc.insecure_channel(target))


def _metadata(api_key: str | None) -> list[tuple[str, str]]:
    key = api_key or os.environ.get("SLOTSERVE_API_KEY")
    return [("authorization", f"Bearer {key}")] if key else []


def cmd_generate(args: argparse.Namespace) -> int:
    import grpc

    from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb

    sampling = pb.SamplingOptions(max_tokens=args.max_tokens, temperature=args.temperature, n=args.n)
    if args.seed is not None:
        sampling.seed = args.seed
    if args.json_schema is not None:
        sampling.structured_outputs.json = args.json_schema
    elif args.regex is not None:
        sampling.structured_outputs.regex = args.regex
    elif args.choice:
        sampling.structured_outputs.choice.values.extend(args.choice)
    request = pb.GenerateRequest(sampling=sampling, model=args.model or "")
    if args.chat:
        request.messages.messages.add(role="user", content=args.prompt)
    else:
        request.prompt = args.prompt
    call = _stub(args.target).Generate(request, timeout=args.timeout, metadata=_metadata(args.api_key))
    texts: dict[int, list[str]] = {}
    try:
        for response in call:
            reason = pb.FinishReason.Name(response.finish_reason).removeprefix("FINISH_REASON_").lower()
            if args.n == 1:  # streamed as it comes
                sys.stdout.write(response.text)
                sys.stdout.flush()
            else:  # each choice whole, once it ends
                texts.setdefault(response.index, []).append(response.text)
                if response.finish_reason:
                    print(f"--- choice {response.index} ({reason}) ---\n{''.join(texts.pop(response.index))}")
            if response.HasField("usage"):
                usage = response.usage
                print(f"\n[{reason}; {usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens]",
                      file=sys.stderr)
    except grpc.RpcError as exc:
        print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        call.cancel()
        return 130
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb

    try:
        report = _stub(args.target).GetLoad(pb.GetLoadRequest(), timeout=args.timeout,
                                            metadata=_metadata(args.api_key))
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(json.dumps(MessageToDict(report, always_print_fields_with_no_presence=True), indent=2))
    return 0


def load_serve_config(path: str | Path, http_port: int | None = None, grpc_port: int | None = None,
                      speculative_config: dict | None = None) -> dict:
    """A Serve config file, checked by Serve's own schema, with optional port overrides and an
    engine ``speculative_config`` for every application (checked when the app is built)."""
    import yaml
    from ray.serve.schema import HTTPOptionsSchema, ServeDeploySchema, gRPCOptionsSchema

    with open(path) as f:
        config = yaml.safe_load(f)
    if not isinstance(config, dict) or not config.get("applications"):
        raise ValueError(f"{path}: not a Serve config file (no 'applications' list)")
    if http_port is not None:
        config.setdefault("http_options", {})["port"] = http_port
    if grpc_port is not None:
        config.setdefault("grpc_options", {})["port"] = grpc_port
    ServeDeploySchema(**config)
    # Serve's schema ignores unknown keys: a misspelt ssl_certfile would silently serve plain HTTP.
    for section, schema in (("http_options", HTTPOptionsSchema), ("grpc_options", gRPCOptionsSchema)):
        unknown = sorted(set(config.get(section) or {}) - set(schema.model_fields))
        if unknown:
            raise ValueError(f"{path}: unknown {section} key(s) {', '.join(unknown)}; "
                             f"allowed: {', '.join(schema.model_fields)}")
    for app in config["applications"]:
        if app.get("deployments"):
            raise ValueError(f"{path}: application {app.get('name')!r} has per-deployment overrides, which "
                             "`slotserve serve` does not apply; put them in args, or use `serve run`")
        if speculative_config is not None:
            args = app.setdefault("args", None) or {}
            app["args"] = {**args, "engine": {**(args.get("engine") or {}), "speculative_config": speculative_config}}
    return config


def _json_object(text: str) -> dict:
    """An argparse type: a JSON object (vLLM's ``--speculative-config`` takes the same)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _import_path(path: str):
    """``module:attr`` or ``module.attr``, as Serve's import_path."""
    import importlib

    module, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module or not attr:
        raise ValueError(f"import_path must look like 'package.module:builder', got {path!r}")
    return getattr(importlib.import_module(module), attr)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def cmd_serve(args: argparse.Namespace) -> int:
    config = load_serve_config(args.config, args.http_port, args.grpc_port, args.speculative_config)
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    http = {"host": "127.0.0.1", "port": 8000, **(config.get("http_options") or {})}
    grpc_options = {"port": 9000, **(config.get("grpc_options") or {})}
    for key in ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs"):  # HTTPS; fail here, not in the proxy
        if http.get(key) and not Path(http[key]).is_file():
            raise ValueError(f"http_options.{key}: {http[key]} is not a file")
    from deployments.app import SERVE_ENV
    from deployments.host_fit import fit_cpu_engines

    tls = bool(http.get("ssl_certfile"))
    ingress = args.ingress or default_ingress(tls)
    if ingress == "haproxy" and tls:
        raise ValueError("http_options.ssl_certfile: HAProxy mode serves plain HTTP; for HTTPS use --ingress proxy")
    check_client_ports(http["host"], {"grpc_options.port": grpc_options["port"], "http_options.port": http["port"]})
    env = {**SERVE_ENV, **ingress_env(ingress)}
    http_options, grpc_serve_options = HTTPOptions(**http), gRPCOptions(**grpc_options)
    for key, value in env.items():  # the local cluster's processes inherit it
        os.environ.setdefault(key, value)
    ray.init(num_cpus=args.num_cpus, include_dashboard=args.dashboard, _metrics_export_port=args.metrics_port)
    # After ray.init, which sets its own. SIGINT too: a shell starts background jobs with SIGINT
    # ignored, and `kill -INT` from a script must drain like Ctrl-C.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _interrupt)
    try:
        serve.start(http_options=http_options, grpc_options=grpc_serve_options)
        from deployments.app import build_app
        cores = args.num_cpus or len(os.sched_getaffinity(0))
        for app in config["applications"]:
            target = _import_path(app["import_path"])
            app_args = app.get("args") or {}
            if target is build_app:
                app_args, chosen = fit_cpu_engines(app_args, cores)
                if chosen:
                    print(chosen, flush=True)
            application = target(app_args) if callable(target) else target
            serve.run(application, name=app.get("name", "default"), route_prefix=app.get("route_prefix", "/"),
                      blocking=False)
        host, scheme = http["host"], "https" if http.get("ssl_certfile") else "http"
        grpc_port, http_port = grpc_options["port"], http["port"]
        print(f"slotserve is up (ingress: {INGRESS_NAMES[ingress]}):\n"
              f"  gRPC  {host}:{grpc_port} (slotserve.v1.SlotServe, "
              f"grpc.health.v1.Health; plaintext, on all interfaces)\n"
              f"  HTTP  {scheme}://{host}:{http_port}/v1 (OpenAI API)\n"
              f"  Prometheus metrics  http://127.0.0.1:{ray.nodes()[0]['MetricsExportPort']}/metrics "
              "(docs/OBSERVABILITY.md)\nCtrl-C stops it.", flush=True)
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        print("shutting down (draining running requests)...", flush=True)
    finally:
        # A second Ctrl-C (or a supervisor's repeated signal) must not cut the drain short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _drain(serve, config)
        serve.shutdown()
        ray.shutdown()
    return 0


def _drain(serve, config: dict) -> None:
    """Delete the applications first: their replicas finish running requests (up to
    drain_timeout_s) while the proxies still carry the streams to the clients.
    ``serve.shutdown()`` alone stops the proxies at once and cuts every open stream."""
    for app in config["applications"]:
        try:
            serve.delete(app.get("name", "default"))
        except Exception as exc:  # noqa: BLE001 - shut down anyway
            print(f"warning: application {app.get('name')!r} did not drain: {exc}", file=sys.stderr, flush=True)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slotserve", description="Serve and query LLMs on Ray Serve.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="start a local Ray, deploy a Serve config, block until Ctrl-C")
    s.add_argument("--config", default=DEFAULT_CONFIG, help=f"Serve config file (default {DEFAULT_CONFIG})")
    s.add_argument("--http-port", type=int, help="override http_options.port")
    s.add_argument("--grpc-port", type=int, help="override grpc_options.port")
    s.add_argument("--speculative-config", type=_json_object, metavar="JSON",
                   help="the engines' speculative_config, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' "
                        "(vLLM's names; docs/SPECULATIVE.md)")
    s.add_argument("--num-cpus", type=int, help="CPUs for the local Ray (default: all)")
    s.add_argument("--dashboard", action="store_true", help="also start the Ray dashboard")
    s.add_argument("--metrics-port", type=int, help="Ray's Prometheus metrics port (default: Ray picks a free one)")
    s.add_argument("--ingress", choices=INGRESS_MODES,
                   help="what takes the client ports: haproxy (Ray Serve's HAProxy mode: HAProxy forwards to the "
                        "ingress replicas' own servers; the default, or proxy when http_options has a certificate) "
                        "or proxy (Serve's Python proxy, which also serves HTTPS). docs/SERVING.md")
    s.set_defaults(func=cmd_serve)

    g = sub.add_parser("generate", help="stream a completion over gRPC")
    g.add_argument("prompt")
    g.add_argument("--target", default=DEFAULT_TARGET, help=f"gRPC host:port (default {DEFAULT_TARGET})")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    g.add_argument("--seed", type=int)
    g.add_argument("--n", type=int, default=1, help="choices to generate (each printed whole when it ends)")
    g.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    shape = g.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", help="hold the output to this JSON schema (JSON text)")
    shape.add_argument("--regex", help="hold the output to this regular expression")
    shape.add_argument("--choice", action="append", help="the output is one of these strings (repeat the flag)")
    g.add_argument("--model", help="model id (default: the served one)")
    g.add_argument("--timeout", type=float, help="deadline in seconds; the request is aborted when it passes")
    g.add_argument("--api-key", help="API key (default: $SLOTSERVE_API_KEY)")
    g.set_defaults(func=cmd_generate)

    lo = sub.add_parser("load", help="print the engine replicas' load (GetLoad) as JSON")
    lo.add_argument("--target", default=DEFAULT_TARGET)
    lo.add_argument("--timeout", type=float, default=10.0)
    lo.add_argument("--api-key")
    lo.set_defaults(func=cmd_load)
    return p


def supervise(argv: list[str]) -> int:
    """Run ``slotserve serve`` in a child process with a session of its own, and stop it
    gracefully whatever stops this one.

    The local Ray's daemons (GCS, raylet, HAProxy) would otherwise share the caller's process
    group, and a signal to the whole group (``timeout``, a shell's job control) killed the GCS
    together with the driver: the drain then waited 60 s for a GCS that was gone and left
    Ray's HAProxy holding the client ports. Here only this process gets such a signal; it
    passes SIGINT, SIGTERM and SIGHUP on as SIGTERM (the child's Ctrl-C path) and waits for
    the drain. If this process dies, even by SIGKILL, the kernel sends the child SIGTERM
    (Linux). A stop of the whole control group (systemd's default KillMode) still reaches
    every process: use ``KillMode=mixed`` there."""
    parent = os.getpid()

    def preexec() -> None:  # in the child, before exec
        if sys.platform.startswith("linux"):
            import ctypes

            ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
            if os.getppid() != parent:  # this process died before the line above
                os._exit(1)

    child = subprocess.Popen([sys.executable, "-m", "deployments.cli", *argv], start_new_session=True,
                             env={**os.environ, OWN_SESSION_ENV: "1"}, preexec_fn=preexec)

    def forward(signum, frame) -> None:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, forward)
    code = child.wait()
    return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell reports it


def main(argv: list[str] | None = None) -> int:
    """The command line; ``serve`` from it (``argv`` None) runs under ``supervise`` on POSIX.
    Explicit ``argv`` (tests, embedding) runs every command in this process."""
    if argv is None and sys.argv[1:2] == ["serve"] and os.name == "posix" and not os.environ.get(OWN_SESSION_ENV):
        return supervise(sys.argv[1:])
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
