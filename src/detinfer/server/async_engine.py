"""The engine loop thread and its asyncio front end.

`LLMEngine.step()` is synchronous and compute-bound, so it must never run on the event loop. One thread owns
the engine: it is the only code that touches it. Each iteration it takes every command queued since the
previous step (`AddRequests` / `Abort` / `AbortAll` / `Stop`), applies them, runs one step and hands each
request's output to that request's `RequestStream`, an asyncio queue living on the event loop. New requests
therefore join the running batch at the next step (continuous batching), and an abort frees its KV blocks
before the next step.

Crossing threads: the event loop puts commands on a `queue.SimpleQueue`; the engine thread answers with
`loop.call_soon_threadsafe`. Nothing else is shared except plain snapshots (`stats`) that are replaced
whole, never mutated, so readers need no lock.

Admission is bounded (`max_pending_requests`, counted in engine requests: one per prompt). The requests
behind one HTTP request are reserved together: all fit (or the HTTP request gets 429 and nothing starts), and
a request with more prompts than the bound can never fit (`RequestTooLargeError`, a 400, not "retry later").

Failure isolation: a failure the engine can pin on one request (`RequestOutput.error`) ends that request's
stream with `RequestFailed`; the engine and every other request carry on. Only a step that fails as a whole
(the engine cannot tell whose fault it is) stops the engine.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

from detinfer.engine.admin import HeldCommands, run_admin
from detinfer.engine.core_wire import error_of, stats_dict
from detinfer.server.metrics import ServerMetrics

log = logging.getLogger("detinfer.server")


class QueueFullError(Exception):
    """Too many requests in flight; retry later (429)."""


class RequestTooLargeError(Exception):
    """The request needs more pending slots than the server ever has (400: retrying cannot help)."""


class EngineUnavailableError(Exception):
    """The engine is shutting down or has failed (503)."""


class RequestAborted(Exception):
    """The request was aborted (server shutdown, or abort() by its owner) before it finished."""


class RequestFailed(Exception):
    """The engine failed on this request alone (it was aborted; the engine keeps serving the others)."""


class ClientDisconnected(Exception):
    """The HTTP client went away before its answer was ready."""


# -- commands from the event loop to the engine thread -----------------------------------------------------
@dataclass(frozen=True)
class NewRequest:
    request_id: str
    prompt: Any
    params: Any
    stream: RequestStream


@dataclass(frozen=True)
class AddRequests:
    """Add these requests together: all are accepted, or none stays (`accepted` gets the error)."""

    requests: tuple[NewRequest, ...]
    accepted: asyncio.Future


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class AbortAll:
    """End the drain's grace period: abort everything still in flight."""


@dataclass(frozen=True)
class Admin:
    """An engine/admin.py operation: held with every later command until the engine is idle."""

    op: str
    arg: Any
    done: asyncio.Future  # gets the operation's result dict or its exception


@dataclass(frozen=True)
class Stop:
    """Abort everything and end the engine thread."""


class RequestStream:
    """Event-loop side of one engine request: async-iterates its cumulative RequestOutputs until finished.

    Outputs are cumulative, so a consumer that falls behind only needs the latest one: `__anext__` skips
    ahead to the newest queued output (never past an error or the final output).
    """

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.finished = False
        self._queue: asyncio.Queue = asyncio.Queue()

    def _put(self, item: Any) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        while not isinstance(item, BaseException) and not item.finished and not self._queue.empty():
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item


def _resolve(fut: asyncio.Future, exc: BaseException | None, result: Any = None) -> None:
    # Runs on the event loop.
    if not fut.done():
        fut.set_exception(exc) if exc is not None else fut.set_result(result)


def admin_error(kind: str, message: str) -> BaseException:
    """An admin operation's failure as the server reports it: ValueError/TypeError (HTTP 400) or RequestFailed."""
    return {"ValueError": ValueError, "TypeError": TypeError}.get(kind, RequestFailed)(message)


class AsyncEngine:
    """Drives an engine with LLMEngine's interface (add_request, abort_request, step,
    has_unfinished_requests, stats) from its own thread; see the module docstring."""

    def __init__(self, engine: Any, *, max_pending_requests: int = 1024, metrics: ServerMetrics | None = None):
        self._engine = engine
        self.max_pending_requests = max_pending_requests
        self.metrics = metrics or ServerMetrics()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._num_pending = 0  # event-loop side only
        self._closing = False
        self.error: BaseException | None = None  # set by the engine thread when a whole step failed
        self.stats: dict[str, float] = {}

    # -- lifecycle (event loop) ----------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="detinfer-engine", daemon=True)
        self._thread.start()
        self.metrics.engine_alive.set(1)

    def request_drain(self, grace_seconds: float) -> None:
        """Start a graceful shutdown (thread- and signal-safe): refuse new requests now (503), let those in
        flight run for `grace_seconds`, then abort the rest so each ends cleanly with finish_reason "abort"
        (streams) or a 503 (non-streaming) before the HTTP server stops."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._begin_drain, grace_seconds)

    def _begin_drain(self, grace_seconds: float) -> None:
        if self._closing:
            return
        self._closing = True
        log.info("draining: %d request(s) in flight get %.1f s to finish", self._num_pending, grace_seconds)
        self._loop.call_later(grace_seconds, self._commands.put, AbortAll())

    async def shutdown(self) -> None:
        """Abort whatever is still in flight (each stream ends with RequestAborted) and stop the thread."""
        self._closing = True
        if self._thread is None:
            return
        self._commands.put(Stop())
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        self.metrics.engine_alive.set(0)

    @property
    def is_healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def _running(self) -> bool:
        return self._thread is not None

    def unavailable_reason(self) -> str | None:
        """Why /health answers 503 (None: healthy)."""
        if self.is_healthy:
            return None
        return self._failure_message() if self.error is not None else "the engine is not running"

    def _failure_message(self) -> str:
        return f"the engine failed: {self.error!r}"

    @property
    def num_pending(self) -> int:
        return self._num_pending

    # -- requests (event loop) -----------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: Any, params: Any) -> RequestStream:
        """One request; see `add_requests`."""
        (stream,) = await self.add_requests([(request_id, prompt, params)])
        return stream

    async def add_requests(self, requests: list[tuple[str, Any, Any]]) -> list[RequestStream]:
        """Queue requests (request_id, prompt, params) together; returns their streams once the engine
        accepted all of them. Raises the engine's ValueError/TypeError for input it refuses (then none was
        added), RequestFailed for any other failure to add, RequestTooLargeError when they could never fit
        in max_pending_requests, QueueFullError when they do not fit now, EngineUnavailableError when
        shutting down or failed."""
        if self._closing or not self._running():
            raise EngineUnavailableError("the server is shutting down")
        if self.error is not None:
            raise EngineUnavailableError(self._failure_message())
        k = len(requests)
        if k > self.max_pending_requests:
            raise RequestTooLargeError(f"this request needs {k} engine requests (one per prompt), more than "
                                       f"this server ever admits at once ({self.max_pending_requests}, "
                                       "--max-pending-requests); send fewer prompts per request")
        if self._num_pending + k > self.max_pending_requests:
            self.metrics.rejected.inc(reason="queue_full")
            raise QueueFullError(f"too many requests in flight ({self._num_pending} of "
                                 f"{self.max_pending_requests}); retry later")
        new = tuple(NewRequest(rid, prompt, params, RequestStream(rid)) for rid, prompt, params in requests)
        accepted = self._loop.create_future()
        self._num_pending += k
        self.metrics.pending.set(self._num_pending)
        self._commands.put(AddRequests(new, accepted))
        try:
            await asyncio.shield(accepted)
        except asyncio.CancelledError:
            # The caller went away while the engine thread was busy. Undo the add once its fate is known:
            # accepted -> abort them (each stream's final item releases its slot); refused -> release here.
            def undo(fut: asyncio.Future) -> None:
                if fut.exception() is None:
                    for r in new:
                        self.abort(r.request_id)
                else:
                    self._release(k)

            accepted.add_done_callback(undo)
            raise
        except BaseException:
            self._release(k)  # refused: none became pending in the engine
            raise
        return [r.stream for r in new]

    async def admin(self, op: str, arg: Any = None) -> dict[str, Any]:
        """Run an engine/admin.py operation once the requests already in flight finished (requests sent after
        it wait for it); its result dict, or ValueError (nothing changed), RequestFailed, EngineUnavailableError."""
        if self._closing or not self._running():
            raise EngineUnavailableError("the server is shutting down")
        if self.error is not None:
            raise EngineUnavailableError(self._failure_message())
        done = self._loop.create_future()
        self._commands.put(Admin(op, arg, done))
        return await asyncio.shield(done)  # a client that leaves does not undo a started weight load

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished). Its stream ends with RequestAborted."""
        self._commands.put(Abort(request_id))

    def _release(self, k: int = 1) -> None:
        self._num_pending -= k
        self.metrics.pending.set(self._num_pending)

    # -- engine thread -------------------------------------------------------------------------------
    def _call(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _deliver(self, stream: RequestStream, item: Any, final: bool) -> None:
        # Runs on the event loop. The pending count drops exactly once, with a stream's final item.
        stream._put(item)
        if final:
            self._release()

    def _deliver_batch(self, batch) -> None:
        for stream, item, final in batch:
            self._deliver(stream, item, final)

    def _run(self) -> None:
        streams: dict[str, RequestStream] = {}
        held = HeldCommands(lambda c: isinstance(c, Admin))
        while True:
            held.release(lambda: not (streams or self._engine.has_unfinished_requests()),
                         lambda c: self._run_admin(c) if isinstance(c, Admin) else self._apply_add(streams, c))
            # Block for commands only while there is nothing to step. (An aborted request still counts:
            # the engine reports its end in the next step, and that step releases its bookkeeping.)
            busy = self.error is None and (bool(streams) or self._engine.has_unfinished_requests())
            commands = [] if busy else [self._commands.get()]
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for cmd in commands:
                if isinstance(cmd, Stop):
                    self._abort_all(streams, RequestAborted("the server is shutting down"))
                    for late in held.drain() + commands:  # adds queued behind the stop get an answer
                        if isinstance(late, (AddRequests, Admin)):
                            self._call(_resolve, late.accepted if isinstance(late, AddRequests) else late.done,
                                       EngineUnavailableError("the server is shutting down"))
                    return
                if isinstance(cmd, (AddRequests, Admin)) and held.offer(cmd):
                    continue
                if isinstance(cmd, AddRequests):
                    self._apply_add(streams, cmd)
                elif isinstance(cmd, Abort):
                    self._apply_abort(streams, cmd.request_id)
                elif isinstance(cmd, AbortAll):
                    if streams:
                        log.info("aborting %d request(s) still in flight at shutdown", len(streams))
                    self._abort_all(streams, RequestAborted("the server is shutting down"))
            if self.error is None and self._engine.has_unfinished_requests():
                self._step(streams)
            self._snapshot_stats()

    def _apply_add(self, streams: dict[str, RequestStream], cmd: AddRequests) -> None:
        if self.error is not None:
            self._call(_resolve, cmd.accepted, EngineUnavailableError(f"the engine failed: {self.error!r}"))
            return
        added: list[str] = []
        try:
            for r in cmd.requests:
                if r.request_id in streams:
                    raise ValueError(f"request id {r.request_id!r} is already running")
                self._engine.add_request(r.request_id, r.prompt, r.params)
                added.append(r.request_id)
        except Exception as e:
            for request_id in added:  # all or none: their abort outputs go to no stream
                self._engine_abort(request_id)
            if not isinstance(e, (ValueError, TypeError)):
                log.error("adding request %s failed:\n%s", cmd.requests[len(added)].request_id,
                          traceback.format_exc())
                e = RequestFailed(f"the engine could not add this request: {e!r}")
            self._call(_resolve, cmd.accepted, e)
            return
        for r in cmd.requests:
            streams[r.request_id] = r.stream
        self._call(_resolve, cmd.accepted, None)

    def _run_admin(self, cmd: Admin) -> None:
        if self.error is not None:
            self._call(_resolve, cmd.done, EngineUnavailableError(self._failure_message()))
            return
        try:
            result, exc = run_admin(self._engine, cmd.op, cmd.arg), None
        except Exception as e:
            if not isinstance(e, (ValueError, TypeError)):
                log.error("admin operation %s failed:\n%s", cmd.op, traceback.format_exc())
            result, exc = None, admin_error(*error_of(e))
        self._call(_resolve, cmd.done, exc, result)
        self._snapshot_stats()

    def _engine_abort(self, request_id: str) -> None:
        try:
            self._engine.abort_request(request_id)
        except Exception:
            log.exception("abort_request(%s) failed", request_id)

    def _apply_abort(self, streams, request_id) -> None:
        stream = streams.pop(request_id, None)
        if stream is None:
            return  # finished already (or never added)
        self.metrics.aborted.inc()
        self._engine_abort(request_id)
        self._call(self._deliver, stream, RequestAborted(f"request {request_id} aborted"), True)

    def _abort_all(self, streams, exc: BaseException) -> None:
        for request_id in list(streams):
            stream = streams.pop(request_id)
            self.metrics.aborted.inc()
            if self.error is None:
                self._engine_abort(request_id)
            self._call(self._deliver, stream, exc, True)
        self._snapshot_stats()

    def _step(self, streams) -> None:
        t0 = time.perf_counter()
        try:
            outputs = self._engine.step()
        except Exception as e:
            # The engine isolates failures it can pin on one request (see RequestOutput.error); a step that
            # still raises failed as a whole, and the engine's state is unknown: fail everything in flight
            # (500s, not hangs) and refuse new work (503) rather than risk serving wrong numbers.
            log.error("engine step failed; refusing further requests:\n%s", traceback.format_exc())
            self.error = e
            self.metrics.engine_alive.set(0)
            failure = EngineUnavailableError(f"the engine failed: {e!r}")
            for request_id in list(streams):
                self._call(self._deliver, streams.pop(request_id), failure, True)
            return
        dt = time.perf_counter() - t0
        self.metrics.steps.inc()
        self.metrics.step_time.observe(dt)
        self.metrics.last_step.set(dt)
        # One wake-up of the event loop per step, not one per request: each call_soon_threadsafe writes to
        # the loop's self-pipe and makes the two threads trade the GIL, which slowed 64-request steps.
        batch = []
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:
                continue
            if out.error is not None:  # the engine aborted this request alone; its output is final
                del streams[out.request_id]
                log.error("request %s failed (aborted; the engine keeps serving): %s", out.request_id, out.error)
                batch.append((stream, RequestFailed(out.error), True))
                continue
            if out.finished:
                del streams[out.request_id]
            batch.append((stream, out, out.finished))
        if batch:
            self._call(self._deliver_batch, batch)
        if streams and not self._engine.has_unfinished_requests():
            # Should not happen: the engine reports every request as finished. Never leave a client hanging.
            for request_id in list(streams):
                log.error("engine dropped request %s without finishing it", request_id)
                self._call(self._deliver, streams.pop(request_id),
                           EngineUnavailableError("the engine lost this request"), True)

    def _snapshot_stats(self) -> None:
        try:
            stats = stats_dict(self._engine.stats())
        except Exception:
            log.exception("engine.stats() failed")
            return
        self.stats = stats
        self.metrics.update_engine_stats(stats)
