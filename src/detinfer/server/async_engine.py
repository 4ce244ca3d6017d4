"""The server's engine front end: requests in, one asyncio stream of outputs per request out.

The engine is driven by `engine.core.EngineCore` and by nothing else; this front end only sends it commands
and turns its events into answers on the event loop. `AsyncEngine` runs the core on a thread of the server
(`--no-engine-process`: a queue in, `loop.call_soon_threadsafe` out, one wake-up of the loop per step);
`core_engine.CoreAsyncEngine` talks to a core in its own process (the default) and adds only what that needs:
socket I/O, output deltas, restarting a dead core. Everything else is written once, here:

Admission is bounded (`max_pending_requests`, counted in engine requests: one per prompt). The requests
behind one HTTP request are reserved together: all fit (or the HTTP request gets 429 and nothing starts), and
a request with more prompts than the bound can never fit (`RequestTooLargeError`, a 400, not "retry later").
They are added together too (all or none, `engine.core`); a caller that goes away while its add is in flight
has it undone once the core answers.

Bookkeeping follows the order the core applies commands: a request's stream is registered when the core
accepted its add; an abort of a request whose add is still unanswered is applied once the answer comes (the
core received it after the add, too). Each request's slot is released exactly once, with its stream's final
item.

Failure isolation: a failure the engine can pin on one request (`RequestOutput.error`) ends that request's
stream with `RequestFailed`; the engine and every other request carry on. A core that fails as a whole (a step
raised, or its process died) fails every request in flight and every unanswered add or admin operation with
EngineUnavailableError (HTTP 500 / 503); /health turns 503 and says why.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from typing import Any

from detinfer.engine.core import (
    Abort,
    AbortAll,
    Added,
    AddRequests,
    Admin,
    EngineCore,
    EngineCoreError,
    Failed,
    Reply,
    Shutdown,
    Stats,
    StepDone,
    exception_of,
    take_from,
)
from detinfer.engine.outputs import RequestOutput
from detinfer.server.metrics import ServerMetrics

log = logging.getLogger("detinfer.server")
SHUTTING_DOWN = "the server is shutting down"


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
    if not fut.done():
        fut.set_exception(exc) if exc is not None else fut.set_result(result)


def _add_failed(message: str) -> RequestFailed:
    return RequestFailed(f"the engine could not add this request: {message}")


class AsyncEngine:
    """See the module docstring: the front end, with the engine core on a thread. All methods run on the event
    loop (request_drain is also thread- and signal-safe)."""

    def __init__(self, engine: Any, *, max_pending_requests: int = 1024, metrics: ServerMetrics | None = None):
        self._engine = engine
        self.max_pending_requests = max_pending_requests
        self.metrics = metrics or ServerMetrics()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = self._closing = False
        self._num_pending = 0
        self.error: EngineUnavailableError | None = None  # set once the core failed as a whole
        self.stats: dict[str, float] = {}  # the latest engine stats (replaced whole, never mutated)
        self._tokens = itertools.count()
        self._streams: dict[str, RequestStream] = {}
        self._adds: dict[int, tuple[tuple[RequestStream, ...], asyncio.Future]] = {}  # token -> unanswered add
        self._adding: dict[str, int] = {}  # request id -> its unanswered add's token
        self._abort_on_add: dict[str, BaseException] = {}
        self._admins: dict[int, asyncio.Future] = {}  # token -> unanswered admin operation
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    # -- the core on a thread (CoreAsyncEngine overrides _start_core, _send, _outputs, _stop_core) ----
    def _start_core(self) -> None:
        core = EngineCore(self._engine, take_from(self._commands), self._emit_threadsafe)
        self._thread = threading.Thread(target=self._run_core, args=(core,), name="detinfer-engine", daemon=True)
        self._thread.start()

    def _run_core(self, core: EngineCore) -> None:
        try:
            core.run()
        except EngineCoreError:
            pass  # it emitted Failed
        except BaseException as e:  # noqa: BLE001 -- a bug in the loop must not leave requests hanging
            log.exception("the engine thread failed")
            self._emit_threadsafe(Failed(repr(e)))

    def _emit_threadsafe(self, event: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._on_event, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _send(self, command: Any) -> None:
        self._commands.put(command)

    def _outputs(self, outputs: tuple) -> list[RequestOutput]:
        """A step's outputs for the requests that still have a stream."""
        return [o for o in outputs if o.request_id in self._streams]

    async def _stop_core(self) -> None:
        self._send(Shutdown())
        await asyncio.to_thread(self._thread.join)

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        if self._started:
            raise RuntimeError(f"{type(self).__name__} already started")
        self._loop = asyncio.get_running_loop()
        self._start_core()
        self._started = True
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
        self._loop.call_later(grace_seconds, self._abort_all)

    def _abort_all(self) -> None:
        if self._streams:
            log.info("aborting %d request(s) still in flight at shutdown", len(self._streams))
        self._abort(list(self._streams) + list(self._adding), RequestAborted(SHUTTING_DOWN), AbortAll())

    async def shutdown(self) -> None:
        """Abort whatever is still in flight (each stream ends with RequestAborted) and stop the core."""
        self._closing = True
        if not self._started:
            return
        self._abort(list(self._streams), RequestAborted(SHUTTING_DOWN))
        self._refuse_unanswered(EngineUnavailableError(SHUTTING_DOWN))
        await self._stop_core()
        self._started = False
        self.metrics.engine_alive.set(0)

    @property
    def is_healthy(self) -> bool:
        return self._started and self.error is None  # draining is healthy: in-flight requests still run

    def unavailable_reason(self) -> str | None:
        """Why /health answers 503 (None: healthy)."""
        if self.is_healthy:
            return None
        return str(self.error) if self.error is not None else "the engine is not running"

    @property
    def num_pending(self) -> int:
        return self._num_pending

    def _check_available(self) -> None:
        if self._closing or not self._started:
            raise EngineUnavailableError(SHUTTING_DOWN)
        if self.error is not None:
            raise EngineUnavailableError(str(self.error))

    # -- requests ------------------------------------------------------------------------------------
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
        self._check_available()
        k = len(requests)
        if k > self.max_pending_requests:
            raise RequestTooLargeError(f"this request needs {k} engine requests (one per prompt), more than "
                                       f"this server ever admits at once ({self.max_pending_requests}, "
                                       "--max-pending-requests); send fewer prompts per request")
        if self._num_pending + k > self.max_pending_requests:
            self.metrics.rejected.inc(reason="queue_full")
            raise QueueFullError(f"too many requests in flight ({self._num_pending} of "
                                 f"{self.max_pending_requests}); retry later")
        streams = tuple(RequestStream(request_id) for request_id, _, _ in requests)
        accepted = self._loop.create_future()
        self._num_pending += k
        self.metrics.pending.set(self._num_pending)
        token = next(self._tokens)
        self._adds[token] = (streams, accepted)
        self._adding.update((s.request_id, token) for s in streams)
        self._send(AddRequests(token, tuple(tuple(r) for r in requests)))
        try:
            await asyncio.shield(accepted)
        except asyncio.CancelledError:
            # The caller went away while the core was busy. Undo the add once its fate is known:
            # accepted -> abort them (each stream's final item releases its slot); refused -> release here.
            def undo(fut: asyncio.Future) -> None:
                if fut.exception() is None:
                    for s in streams:
                        self.abort(s.request_id)
                else:
                    self._release(k)

            accepted.add_done_callback(undo)
            raise
        except BaseException:
            self._release(k)  # refused: none became pending in the engine
            raise
        return list(streams)

    async def admin(self, op: str, arg: Any = None) -> dict[str, Any]:
        """Run an engine/admin.py operation once the requests already in flight finished (requests sent after
        it wait for it); its result dict, or ValueError (nothing changed), RequestFailed, EngineUnavailableError."""
        self._check_available()
        token = next(self._tokens)
        done = self._admins[token] = self._loop.create_future()
        self._send(Admin(token, op, arg))
        return await asyncio.shield(done)  # a client that leaves does not undo a started weight load

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished). Its stream ends with RequestAborted."""
        self._abort([request_id], None)

    def _abort(self, request_ids: list[str], exc: BaseException | None, command: Any = None) -> None:
        sent = []
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                self.metrics.aborted.inc()
                self._deliver(stream, exc or RequestAborted(f"request {request_id} aborted"), True)
                sent.append(request_id)
            elif request_id in self._adding:
                self._abort_on_add[request_id] = exc or RequestAborted(f"request {request_id} aborted")
                sent.append(request_id)
        if (sent or command is not None) and self.error is None:
            self._send(command or Abort(tuple(sent)))

    def _release(self, k: int = 1) -> None:
        self._num_pending -= k
        self.metrics.pending.set(self._num_pending)

    def _deliver(self, stream: RequestStream, item: Any, final: bool) -> None:
        stream._put(item)
        if final:  # the pending count drops exactly once, with a stream's final item
            self._release()

    # -- events from the core ------------------------------------------------------------------------
    def _on_event(self, event: Any) -> None:
        if isinstance(event, StepDone):
            self._on_step(event)
        elif isinstance(event, Added):
            self._answer_add(event.token, None if event.error is None else exception_of(event.error, _add_failed))
        elif isinstance(event, Stats):
            self._set_stats(event.stats)
        elif isinstance(event, Reply):
            done = self._admins.pop(event.token, None)
            if done is not None:
                _resolve(done, None if event.error is None else exception_of(event.error, RequestFailed), event.result)
        elif isinstance(event, Failed):
            self._fail(f"the engine failed: {event.message}")

    def _answer_add(self, token: int, exc: BaseException | None) -> None:
        entry = self._adds.pop(token, None)
        if entry is None:  # answered already (shutdown, failure)
            return
        streams, accepted = entry
        for s in streams:
            self._adding.pop(s.request_id, None)
            aborted = self._abort_on_add.pop(s.request_id, None)
            if exc is None and aborted is None:
                self._streams[s.request_id] = s
            elif exc is None:  # aborted before the core answered (it got that abort, too)
                self.metrics.aborted.inc()
                self._deliver(s, aborted, True)
        _resolve(accepted, exc)

    def _refuse_unanswered(self, exc: BaseException) -> None:
        """Every add and admin operation the core has not answered gets `exc` (the core will not answer)."""
        for token in list(self._adds):
            self._answer_add(token, exc)
        for token in list(self._admins):
            _resolve(self._admins.pop(token), exc)

    def _set_stats(self, stats: dict[str, float]) -> None:
        self.stats = stats
        self.metrics.update_engine_stats(stats)

    def _on_step(self, event: StepDone) -> None:
        self.metrics.steps.inc()
        self.metrics.step_time.observe(event.seconds)
        self.metrics.last_step.set(event.seconds)
        self._set_stats(event.stats)
        for out in self._outputs(event.outputs):
            stream = self._streams[out.request_id]
            if out.error is not None:  # the engine aborted this request alone; its output is final
                del self._streams[out.request_id]
                log.error("request %s failed (aborted; the engine keeps serving): %s", out.request_id, out.error)
                self._deliver(stream, RequestFailed(out.error), True)
                continue
            if out.finished:
                del self._streams[out.request_id]
            self._deliver(stream, out, out.finished)

    # -- failure of the core as a whole --------------------------------------------------------------
    def _fail(self, cause: str) -> None:
        if self.error is not None:
            return
        restarting = self._can_restart()
        then = (SHUTTING_DOWN if self._closing else
                "the server is restarting the engine core" if restarting else self._down_reason())
        message = f"{cause}; requests in flight are lost and {then}"
        log.error("%s", message)
        self.error = EngineUnavailableError(message)  # set first: deliveries below must not re-enter _fail
        self.metrics.engine_alive.set(0)
        for request_id in list(self._streams):
            self._deliver(self._streams.pop(request_id), EngineUnavailableError(message), True)
        self._refuse_unanswered(EngineUnavailableError(message))
        self._core_failed(cause, restarting)

    def _can_restart(self) -> bool:
        return False  # a thread's engine cannot be replaced: its state is unknown after a failed step

    def _down_reason(self) -> str:
        return "the server cannot serve until it is restarted"

    def _core_failed(self, cause: str, restarting: bool) -> None:
        """What the transport does once the core failed (the process flavour detaches and may restart)."""
