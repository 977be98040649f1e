"""Load and observation for the autoscaling benchmark (and its end-to-end test).

- ``Clients``: closed-loop gRPC streaming clients; every request asks for exactly
  ``max_tokens`` tokens (``ignore_eos``), so a truncated stream shows in its count.
- ``Monitor``: a thread sampling ``serve.status()`` (replica states), ``GetLoad`` (per
  replica slots, queue, occupancy) and the clients' in-flight count.
- Serve's own log lines, read after the fact: the policy's decisions (controller log),
  when a replica was told to stop and when it was gone, and every ``generate`` call a
  replica served (its access log), so the requests in flight on a stopping replica are
  counted exactly rather than sampled.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Callable

ENGINE_DEPLOYMENT = "EngineReplica"
_TS = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})"
_DECISION = re.compile(_TS + r" .*? -- autoscale (\d+) -> (\d+) \((\w+)\): (.*)$")
_STOPPING = re.compile(_TS + r" .*? -- Stopping Replica\(id='([^']+)', deployment='([^']+)'")
_STOPPED = re.compile(_TS + r" .*? -- Replica\(id='([^']+)', deployment='([^']+)', app='[^']*'\) is stopped")
_STARTED = re.compile(r" -- Replica\(id='([^']+)', deployment='[^']+', app='[^']*'\) started successfully .*?"
                      r"after ([\d.]+)s .*?took ([\d.]+)s")
# A request reaches an engine replica over its ingress's engine link: the link's access lines
# (Serve's own CALL lines are for calls that are not requests: link_address, model_info, stats).
_CALL = re.compile(_TS + r" \S+ (\S+) (?:\S+ )?-- LINK \S+ (\w+) ([\d.]+)ms")


def _wall(ts: str) -> float:
    """A Serve log timestamp (local time) as time.time()."""
    return datetime.strptime(ts, "%Y-%m-%d %H:%M:%S,%f").timestamp()


# ---------------------------------------------------------------------------- clients
@dataclass
class Outcome:
    start: float
    asked: int
    """max_tokens of the request."""
    end: float = 0.0
    first: float = 0.0
    """When the first tokens arrived (0: none did)."""
    tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = ""
    error: str | None = None

    @property
    def complete(self) -> bool:
        """Ended normally with every token asked for (counted on the stream and in the usage)."""
        return (self.error is None and self.finish_reason == "FINISH_REASON_LENGTH"
                and self.tokens == self.completion_tokens == self.asked)

    @property
    def shed(self) -> bool:
        """Refused for overload (RESOURCE_EXHAUSTED), as a full server should."""
        return (self.error or "").startswith("RESOURCE_EXHAUSTED")


class Clients:
    """Streaming clients on threads: closed loop (``add``: each sends its next request when
    its last one ends) or open loop (``add_arrivals``: a request every so often, whatever
    the ones before are doing).

    ``retry_wait_s``: a closed-loop client whose request was shed waits this long before its
    next one, as a client honouring the "retry later" hint would; 0 retries at once."""

    def __init__(self, stub, max_tokens: int, prompt_len: int = 12, vocab: int = 300,
                 retry_wait_s: float = 0.0) -> None:
        self._stub, self.max_tokens, self._prompt_len, self._vocab = stub, max_tokens, prompt_len, vocab
        self.retry_wait_s = retry_wait_s
        self._workers: list[tuple[threading.Thread, threading.Event]] = []
        self._lock = threading.Lock()
        self.outcomes: list[Outcome] = []
        self.in_flight = 0

    def add(self, n: int, max_tokens: int | None = None) -> list[threading.Event]:
        """Start ``n`` closed-loop clients; returns their stop events (see ``stop_group``)."""
        return [self._start(self._loop, max_tokens or self.max_tokens) for _ in range(n)]

    def add_arrivals(self, interval_s: float, max_tokens: int | None = None) -> list[threading.Event]:
        """One request every ``interval_s`` seconds, each on its own thread."""
        return [self._start(self._arrivals, max_tokens or self.max_tokens, interval_s)]

    def _start(self, target, *args) -> threading.Event:
        stop = threading.Event()
        worker = threading.Thread(target=target, args=(len(self._workers), stop, *args), daemon=True)
        self._workers.append((worker, stop))
        worker.start()
        return stop

    def stop(self, n: int | None = None) -> None:
        """Tell ``n`` clients (all by default, newest first) to stop after their current request."""
        live = [stop for _, stop in self._workers if not stop.is_set()]
        self.stop_group(live[len(live) - (len(live) if n is None else min(n, len(live))):])

    @staticmethod
    def stop_group(events: list[threading.Event]) -> None:
        for stop in events:
            stop.set()

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for worker, _ in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        alive = sum(w.is_alive() for w, _ in self._workers)
        if alive:
            raise TimeoutError(f"{alive} clients still streaming after {timeout_s} s")

    def _loop(self, index: int, stop: threading.Event, max_tokens: int) -> None:
        n = 0
        while not stop.is_set():
            outcome = self._record(self._prompt(index, n), max_tokens)
            n += 1
            if outcome.shed and self.retry_wait_s > 0:
                stop.wait(self.retry_wait_s)

    def _arrivals(self, index: int, stop: threading.Event, max_tokens: int, interval_s: float) -> None:
        sent: list[threading.Thread] = []
        n = 0
        while not stop.wait(0 if n == 0 else interval_s):
            one = threading.Thread(target=self._record, args=(self._prompt(index, n), max_tokens), daemon=True)
            one.start()
            sent.append(one)
            n += 1
        for one in sent:  # join() waits for this worker, so for every request it sent
            one.join()

    def _prompt(self, index: int, n: int) -> list[int]:
        # Different prompts: no prefix-cache affinity pulls the streams to one replica.
        return [3 + (index * 31 + n * 7 + k) % self._vocab for k in range(self._prompt_len)]

    def _record(self, prompt: list[int], max_tokens: int) -> Outcome:
        outcome = self._one(prompt, max_tokens)
        with self._lock:
            self.outcomes.append(outcome)
        return outcome

    def _one(self, prompt: list[int], max_tokens: int) -> Outcome:
        import grpc

        from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb

        request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingOptions(
            temperature=0, max_tokens=max_tokens, ignore_eos=True))
        out = Outcome(start=time.time(), asked=max_tokens)
        with self._lock:
            self.in_flight += 1
        try:
            for message in self._stub.Generate(request, timeout=600):
                if message.token_ids and not out.tokens:
                    out.first = time.time()
                out.tokens += len(message.token_ids)
                if message.finish_reason:
                    out.finish_reason = pb.FinishReason.Name(message.finish_reason)
                    out.completion_tokens = message.usage.completion_tokens
        except grpc.RpcError as exc:
            out.error = f"{exc.code().name}: {exc.details()}"
        finally:
            out.end = time.time()
            with self._lock:
                self.in_flight -= 1
        return out


# ---------------------------------------------------------------------------- monitor
@dataclass(frozen=True)
class Sample:
    t: float
    """time.time()"""
    states: dict[str, int]
    """Serve's replica states of the engine deployment, e.g. {"RUNNING": 2, "STOPPING": 1}."""
    loads: dict[str, dict] | None
    """Per replica id: running, waiting, max_num_seqs, slot_occupancy, num_finished, updated_at (when the
    replica took them: the ingress reports its router's last poll); None: GetLoad failed."""
    in_flight: int


@dataclass
class Monitor:
    """Samples replica states and loads every ``period_s`` on its own thread."""

    serve: object
    stub: object
    app: str
    clients: Clients | None = None
    period_s: float = 0.25
    samples: list[Sample] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._new = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Monitor":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def sample(self) -> Sample:
        status = self.serve.status().applications[self.app].deployments[ENGINE_DEPLOYMENT]
        states = {str(getattr(s, "value", s)): n for s, n in status.replica_states.items() if n}
        return Sample(time.time(), states, self._loads(), self.clients.in_flight if self.clients else 0)

    def _loads(self) -> dict[str, dict] | None:
        import grpc

        from deployments.proto_gen.slotserve.v1 import slotserve_pb2 as pb

        try:
            report = self.stub.GetLoad(pb.GetLoadRequest(), timeout=10)
        except grpc.RpcError:
            return None
        return {r.replica_id: {"running": r.running, "waiting": r.waiting, "max_num_seqs": r.max_num_seqs,
                               "slot_occupancy": r.slot_occupancy, "num_finished": r.num_finished,
                               "updated_at": r.updated_at}
                for r in report.replicas}

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                sample = self.sample()
            except Exception:  # noqa: BLE001 - a failed poll (controller busy) is a missing point
                sample = None
            if sample is not None:
                with self._new:
                    self.samples.append(sample)
                    self._new.notify_all()
            self._stop.wait(max(0.0, self.period_s - (time.monotonic() - started)))

    def wait_for(self, predicate: Callable[[Sample], object], timeout_s: float, what: str) -> Sample:
        """The first new sample for which ``predicate`` holds; TimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._new:
            seen = len(self.samples)
            while True:
                for sample in self.samples[seen:]:
                    if predicate(sample):
                        return sample
                seen = len(self.samples)
                left = deadline - time.monotonic()
                if left <= 0:
                    last = self.samples[-1].states if self.samples else None
                    raise TimeoutError(f"{what}: not within {timeout_s} s (last states {last})")
                self._new.wait(min(left, 1.0))


# ---------------------------------------------------------------------------- Serve's logs
def serve_log_dir() -> Path:
    """This Ray session's Serve log folder (not ``session_latest``: other sessions may run)."""
    import ray

    return Path(ray._private.worker.global_worker.node.get_logs_dir_path()) / "serve"


@dataclass(frozen=True)
class Decision:
    t: float
    current: int
    desired: int
    rule: str
    inputs: str
    line: str


def policy_decisions(log_dir: Path) -> list[Decision]:
    """The policy's logged changes of the replica count, in time order."""
    found = []
    for path in log_dir.glob("controller_*.log"):
        for line in path.read_text(errors="replace").splitlines():
            m = _DECISION.search(line)
            if m:
                found.append(Decision(_wall(m[1]), int(m[2]), int(m[3]), m[4], m[5], line))
    return sorted(found, key=lambda d: d.t)


def replica_stop_times(log_dir: Path, replica_id: str) -> tuple[float | None, float | None]:
    """(when the controller told ``replica_id`` to stop, when it was gone)."""
    stopping = stopped = None
    for path in log_dir.glob("controller_*.log"):
        for line in path.read_text(errors="replace").splitlines():
            m = _STOPPING.search(line)
            if m and m[2] == replica_id and stopping is None:
                stopping = _wall(m[1])
            m = _STOPPED.search(line)
            if m and m[2] == replica_id:
                stopped = _wall(m[1])
    return stopping, stopped


def replica_start(log_dir: Path, replica_id: str) -> tuple[float, float] | None:
    """(seconds from creation to ready, of which in the constructor and first health check)."""
    for path in log_dir.glob("controller_*.log"):
        for line in path.read_text(errors="replace").splitlines():
            m = _STARTED.search(line)
            if m and m[1] == replica_id:
                return float(m[2]), float(m[3])
    return None


def engine_calls(log_dir: Path, app: str, replica_id: str) -> list[tuple[float, float, str]]:
    """(start, end, status) of every request the replica served over engine links (deployments.link),
    from its Serve log."""
    calls = []
    for path in log_dir.glob(f"replica_{app}_{ENGINE_DEPLOYMENT}_{replica_id}*.log"):
        for line in path.read_text(errors="replace").splitlines():
            m = _CALL.search(line)
            if m and m[2] == replica_id:
                end = _wall(m[1])
                calls.append((end - float(m[4]) / 1000.0, end, m[3]))
    return sorted(calls)


def calls_across(calls: list[tuple[float, float, str]], t: float) -> list[tuple[float, float, str]]:
    """The calls that had started before ``t`` and ended after it (log times have ms resolution)."""
    return [c for c in calls if c[0] < t < c[1]]
