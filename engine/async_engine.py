"""AsyncEngine: the engine loop on its own thread, requests as asyncio streams.

The loop thread owns the LLMEngine; other threads talk to it through an inbox (adds and
aborts, applied before the next step) and receive outputs through their event loop, one
``call_soon_threadsafe`` per step and loop. A slow consumer never slows the loop: its stream
holds every output that arrived since it last looked, handed over at once.

Faults: when the loop dies or the engine is shut down, every open stream fails with
EngineDeadError and new requests are refused at once (registration and closing share a
lock, so no stream is left waiting). ``check_health`` raises when the loop has died, or
when it has work and no step has finished for ``stuck_timeout_s`` (an engine option).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import uuid
from typing import AsyncIterator, Mapping, Sequence

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from engine.kv.hashing import PREFIX_DIGEST_ENTRIES, ROOT_HASH, salted_root
from engine.outputs import EngineStats, StreamOutput
from engine.sampling import SamplingParams

logger = logging.getLogger(__name__)
IDLE_WAIT_S = 0.5
DIGEST_REFRESH_S = 0.25


class _Stream:
    """Outputs of one request waiting for its consumer; merged on read."""

    __slots__ = ("loop", "items", "event", "error")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: list[StreamOutput] = []
        self.event = asyncio.Event()
        self.error: BaseException | None = None

    def push(self, out: StreamOutput) -> None:
        self.items.append(out)
        self.event.set()

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.event.set()

    async def get(self) -> list[StreamOutput]:
        """Everything since the last call, in the engine's order (the output that ends the request
        last). Not merged here: messages are joined where they queue for a reader
        (``deployments.contract.coalesce``), once."""
        while not self.items:
            if self.error is not None:
                raise self.error
            self.event.clear()
            await self.event.wait()
        items, self.items = self.items, []
        return items


class AsyncEngine:
    def __init__(self, config: EngineConfig, launcher=None) -> None:
        """``launcher``: starts tensor-parallel rank workers (see LLMEngine).

        The engine is built on the loop thread that steps it, so every torch op runs on one
        thread: a second thread that has run a parallel op keeps a second OpenMP team, and with
        more OpenMP threads than cores libgomp stops spin-waiting between parallel regions,
        which slows every op (docs/BENCHMARKS.md)."""
        self.config = config
        self._inbox: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        # Guards _streams and _closed together: a request registers before the loop's death
        # (and is failed by it) or after (and sees _closed), never in between.
        self._lock = threading.Lock()
        self._closed: str | None = None
        self._stop = False
        # Time of the last finished step (or of going busy); None while idle: never stuck.
        self._progress_at: float | None = None
        self._digest: list[int] = []
        self._digest_time = 0.0
        built = threading.Event()
        failed: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(config, launcher, built, failed),
                                        name="slotserve-engine-loop", daemon=True)
        self._thread.start()
        built.wait()
        if failed:
            self._thread.join()
            raise failed[0]

    @classmethod
    def from_options(cls, model: str, launcher=None, **options) -> "AsyncEngine":
        return cls(EngineConfig.from_options(model, **options), launcher)

    # Properties frontends need without touching the loop thread's state.
    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_path(self):
        return self.engine.model_path

    @property
    def quantization(self) -> str:
        """How the weights are held (a checkpoint's own scheme included): ``none``, ``gguf``, ``fp8``..."""
        return self.engine.runner.quantization or "none"

    @property
    def hidden_size(self) -> int:
        """Dimensions of the model's embeddings (``SamplingParams.pooling``)."""
        return self.engine.arch.hidden_size

    # ------------------------------------------------------------------ requests
    async def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0,
                       resume_token_ids: Sequence[int] = (),
                       resume_choices: Mapping[int, Sequence[int]] | None = None,
                       lora: str | None = None, cache_salt: str | None = None, tenant: str | None = None,
                       tenant_weight: float = 1.0) -> AsyncIterator[StreamOutput]:
        """Submit a request and stream its outputs (each choice's, with ``n`` > 1); closing the stream
        aborts the request.

        ``resume_token_ids``, ``resume_choices``, ``lora``, ``cache_salt``, ``tenant``, ``tenant_weight``:
        see ``LLMEngine.add_request``."""
        self.check_health()
        params = params or SamplingParams()
        prompt = self.engine.check_request(prompt_token_ids, params, priority)
        if lora is not None:
            self.engine.adapter(lora)  # an unknown name fails here, before anything is queued
        if cache_salt is not None:
            salted_root(ROOT_HASH, cache_salt)  # so does a bad salt
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        stream = _Stream(asyncio.get_running_loop())
        self._register(request_id, stream, ("add", request_id, prompt, params, priority, time.monotonic(),
                                                tuple(resume_token_ids), resume_choices, lora, cache_salt,
                                                tenant, tenant_weight))
        finished = False
        try:
            while not finished:
                for out in await stream.get():
                    finished = out.request_finished
                    yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def _register(self, request_id: str, stream: _Stream, add: tuple) -> None:
        """Open the stream and queue its add, or raise; never concurrently with ``_close``."""
        with self._lock:
            if self._closed is not None:
                raise EngineDeadError(self._closed)
            if request_id in self._streams:
                raise InvalidRequestError(f"request_id {request_id!r} is already in use")
            # Requests still in the inbox will first fill free slots; only the rest will wait.
            waiting = self._stats.waiting + max(0, len(self._inbox) - self._stats.free_slots)
            if waiting >= self.config.scheduler.max_waiting:
                raise EngineOverloadedError(f"engine queue is full ({waiting} waiting, max_waiting "
                                            f"{self.config.scheduler.max_waiting}); retry later or on another "
                                            "replica")
            self._streams[request_id] = stream
            self._inbox.append(add)
        self._wake.set()

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Abort a request, or only its choice ``index``."""
        self._inbox.append(("abort", request_id, index))
        self._wake.set()

    async def load_lora(self, name: str, path: str):
        """``LLMEngine.load_lora`` between two steps (it reads the adapter on the loop thread)."""
        return await self._between_steps(lambda engine: engine.load_lora(name, path))

    async def unload_lora(self, name: str) -> None:
        await self._between_steps(lambda engine: engine.unload_lora(name))

    async def _between_steps(self, fn):
        """``fn(engine)``'s result, run on the loop thread where nothing else touches the engine."""
        self.check_health()
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        with self._lock:  # queued before the loop closes (then failed by _close) or refused after
            if self._closed is not None:
                raise EngineDeadError(self._closed)
            self._inbox.append(("call", fn, loop, done))
        self._wake.set()
        return await done

    # ------------------------------------------------------------------ loop thread
    def _build(self, config: EngineConfig, launcher, built: threading.Event, failed: list) -> bool:
        try:
            self.engine = LLMEngine(config, launcher)
            self._stats = self.engine.stats()
        except BaseException as exc:  # noqa: BLE001 - raised in the constructor's thread
            failed.append(exc)
        finally:
            built.set()
        return not failed

    def _run(self, config: EngineConfig, launcher, built: threading.Event, failed: list) -> None:
        if not self._build(config, launcher, built, failed):
            return
        try:
            while not self._stop:
                # Clear before draining: an add that lands after the drain has set the event
                # again, so the wait below returns at once (no lost wake-up).
                self._wake.clear()
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self._progress_at = None
                    self._publish([])
                    self._wake.wait(IDLE_WAIT_S)
                    continue
                if self._progress_at is None:  # going busy: the stuck clock starts now
                    self._progress_at = time.monotonic()
                outputs = self.engine.step()
                self._progress_at = time.monotonic()
                self._publish(outputs)
        except BaseException as exc:  # noqa: BLE001 - the loop must report any death
            logger.exception("engine loop died")
            self._close(f"engine loop died: {type(exc).__name__}: {exc}")

    def _drain_inbox(self) -> None:
        while self._inbox:
            item = self._inbox.popleft()
            if item[0] == "abort":
                self.engine.abort(item[1], item[2])
                continue
            if item[0] == "call":
                _, fn, loop, done = item
                try:
                    result = fn(self.engine)
                    # What the call changed (a LoRA adapter loaded) is in the stats before its caller
                    # hears back: the next step may be far off, and routers read these.
                    self._stats = self.engine.stats()
                except Exception as exc:  # noqa: BLE001 - the caller's error, raised in its own loop
                    _call_soon(loop, lambda e=exc: done.done() or done.set_exception(e))
                else:
                    _call_soon(loop, lambda r=result: done.done() or done.set_result(r))
                continue
            _, rid, prompt, params, priority, arrival, resume, choices, lora, salt, tenant, weight = item
            try:
                self.engine.add_request(prompt, params, rid, priority, arrival_time=arrival, resume_token_ids=resume,
                                        resume_choices=choices, lora=lora, cache_salt=salt, tenant=tenant,
                                        tenant_weight=weight, checked=True)  # by generate()
            except (InvalidRequestError, EngineOverloadedError) as exc:
                stream = self._streams.get(rid)
                if stream is not None:
                    _call_soon(stream.loop, stream.fail, exc)

    def _publish(self, outputs: list[StreamOutput]) -> None:
        now = time.monotonic()
        self._stats = self.engine.stats()
        if now - self._digest_time > DIGEST_REFRESH_S:
            self._digest = self.engine.prefix_digest(PREFIX_DIGEST_ENTRIES)
            self._digest_time = now
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, StreamOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, pairs in by_loop.items():
            if not _call_soon(loop, _deliver, pairs):  # that event loop is closed: its consumers are gone
                for stream, out in pairs:
                    self.abort(out.request_id)

    def _close(self, reason: str) -> None:
        """Refuse new requests and fail every open stream with EngineDeadError(reason)."""
        with self._lock:
            if self._closed is None:
                self._closed = reason
            reason = self._closed
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            _call_soon(stream.loop, stream.fail, EngineDeadError(reason))
        for item in [i for i in list(self._inbox) if i[0] == "call"]:  # adapter loads no step will run
            _, _, loop, done = item
            _call_soon(loop, lambda d=done: d.done() or d.set_exception(EngineDeadError(reason)))

    # ------------------------------------------------------------------ observability
    def stats(self) -> EngineStats:
        return self._stats

    def prefix_digest(self, max_entries: int = PREFIX_DIGEST_ENTRIES) -> list[int]:
        return self._digest[-max_entries:] if max_entries > 0 else []

    def drain_step_tokens(self) -> list[int]:
        """Tokens computed per step since the last call (for metrics; any thread)."""
        steps = self.engine.step_tokens
        return [steps.popleft() for _ in range(len(steps))]  # popleft: safe against the loop's appends

    def check_health(self) -> None:
        """Raise EngineDeadError if the loop died, was shut down, or has work but made no
        progress (no step finished) for more than ``stuck_timeout_s``."""
        if self._closed is not None:
            raise EngineDeadError(self._closed)
        if not self._thread.is_alive():
            raise EngineDeadError("engine loop is not running")
        since = self._progress_at  # one read: the loop may set it to None meanwhile
        silent = 0.0 if since is None else time.monotonic() - since
        if silent > self.config.stuck_timeout_s:
            raise EngineDeadError(f"engine loop stuck: no step finished for {silent:.1f} s "
                                  f"(stuck_timeout_s {self.config.stuck_timeout_s:g})")
        try:
            self.engine.check_health()  # tensor-parallel ranks (engine.tp)
        except EngineDeadError as exc:
            self._close(str(exc))  # streams fail now, not when a collective times out
            raise

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Fail open streams, refuse new requests, stop the loop (waiting up to ``timeout_s``)."""
        self._close("engine was shut down")
        self._stop = True
        self._wake.set()
        self._thread.join(timeout_s)
        self.engine.shutdown()  # tensor-parallel rank workers, if any


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    """``call_soon_threadsafe``; False when that event loop is already closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        return False
    return True


def _deliver(pairs: list[tuple[_Stream, StreamOutput]]) -> None:
    for stream, out in pairs:
        stream.push(out)
