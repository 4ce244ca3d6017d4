"""`CoreAsyncEngine`: the server's engine front end when the engine core runs in its own process (the default;
`--no-engine-process` keeps the engine-loop thread of `async_engine.AsyncEngine`).

Same interface and semantics as `AsyncEngine` (admission bound, all-or-none adds, abort, drain, streams of
cumulative outputs, failure isolation), but nothing here runs a thread: the event loop writes commands to the
core's socket without blocking (what the socket cannot take now is buffered and flushed when writable) and
reads the core's messages as they arrive (`loop.add_reader`), one message per engine step, decoded into the
same `RequestOutput`s the in-process engine returns and handed to each request's `RequestStream`.

Bookkeeping mirrors what the engine thread does, in the order the core applies commands: a request's stream is
registered when the core accepted its add; an abort for a request whose add is still unanswered is applied once
the answer comes (the core received it after the add, too).

Failure: a core that dies (killed, crashed) closes its socket; the EOF fails every in-flight request with
EngineUnavailableError (HTTP 500; streams get an error event and [DONE]), /health turns 503 and new requests
get 503 naming how the core ended. A step that failed as a whole in the core ("failed") is handled the same way.

Restart (like a supervisor): given `restart` (a callable that starts the same core again; its argument is an
event that shutdown sets, to stop waiting for a start-up in progress), the front end then
starts a fresh core in the background (a thread; the event loop keeps answering). Meanwhile /health and new
requests get 503 "engine core restarting after ..."; once the new core is ready it is attached and serving
resumes. At most `max_restarts` restarts within RESTART_WINDOW_S, failed start-ups included, so a core that
dies at start-up does not loop forever; beyond that the server stays down with a message saying so. A fresh
core holds no state of the old one, so in deterministic mode it answers a request with the same bits.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from detinfer.engine import core_wire as wire
from detinfer.engine.core_process import CoreProcess
from detinfer.server.async_engine import (
    Abort,
    AbortAll,
    AddRequests,
    Admin,
    AsyncEngine,
    EngineUnavailableError,
    RequestAborted,
    RequestFailed,
    RequestStream,
    Stop,
    _resolve,
    admin_error,
)
from detinfer.server.metrics import ServerMetrics

log = logging.getLogger("detinfer.server")
READ_CHUNK = 1 << 20
SHUTTING_DOWN = "the server is shutting down"
RESTART_WINDOW_S = 600.0  # max_restarts counts the restarts of the last ten minutes


class _CommandSink:
    """What AsyncEngine's request methods put commands on; here they go to the core instead of a thread."""

    def __init__(self, engine: CoreAsyncEngine):
        self._engine = engine

    def put(self, cmd: Any) -> None:
        self._engine._command(cmd)


class CoreAsyncEngine(AsyncEngine):
    """See the module docstring. All methods run on the event loop (request_drain is also signal-safe)."""

    def __init__(self, core: CoreProcess, *, max_pending_requests: int = 1024, metrics: ServerMetrics | None = None,
                 restart: Callable[[threading.Event], CoreProcess] | None = None, max_restarts: int = 0):
        super().__init__(None, max_pending_requests=max_pending_requests, metrics=metrics)
        self.core = core
        self._restart = restart
        self.max_restarts = max_restarts if restart is not None else 0
        self._restart_times: collections.deque[float] = collections.deque()
        self._restart_task: asyncio.Task | None = None
        self._restart_cancel = threading.Event()  # set by shutdown: `restart` stops waiting for a start-up
        self._commands = _CommandSink(self)
        self._started = False
        self._streams: dict[str, RequestStream] = {}
        self._adds: dict[int, AddRequests] = {}  # token -> the add the core has not answered yet
        self._adding: dict[str, int] = {}  # request id -> its unanswered add's token
        self._abort_on_add: dict[str, BaseException] = {}
        self._admins: dict[int, Admin] = {}  # token -> the admin operation the core has not answered yet
        self._assembler = wire.OutputAssembler()
        self._reader = wire.FrameReader()
        self._tokens = itertools.count()
        self._out = bytearray()  # written frames the socket could not take yet

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        if self._started:
            raise RuntimeError("CoreAsyncEngine already started")
        self._loop = asyncio.get_running_loop()
        self._attach(self.core)
        self._started = True

    def _attach(self, core: CoreProcess) -> None:
        """Read from `core` from now on (at start, and a restarted core with fresh per-connection state)."""
        self.core = core
        self._reader = wire.FrameReader()
        self._assembler = wire.OutputAssembler()
        self._out.clear()
        core.sock.setblocking(False)
        self._loop.add_reader(core.sock.fileno(), self._on_readable)
        self.error = None
        self.metrics.engine_alive.set(1)

    def _running(self) -> bool:
        return self._started

    def _failure_message(self) -> str:
        return str(self.error)

    @property
    def is_healthy(self) -> bool:
        return self._started and self.error is None  # draining is healthy: in-flight requests still run

    async def shutdown(self) -> None:
        """Abort whatever is still in flight (streams end with RequestAborted) and stop the core process."""
        self._closing = True
        if not self._started:
            return
        if self._restart_task is not None:
            self._restart_cancel.set()  # a start-up in progress stops waiting for its model to load
            await self._restart_task  # a core that still finished starting is closed (we are closing)
        self._command(Stop())
        self._detach()
        await asyncio.to_thread(self._close_core)
        self._started = False
        self.metrics.engine_alive.set(0)

    def _close_core(self) -> None:
        try:
            self.core.sock.setblocking(True)
            if self._out and self.error is None:  # never leave half a frame in front of "shutdown"
                self.core.sock.sendall(self._out)
        except OSError:
            pass
        self._out.clear()
        self.core.close()

    def _detach(self) -> None:
        if self._loop is not None and self.core.sock.fileno() >= 0:
            self._loop.remove_reader(self.core.sock.fileno())
            self._loop.remove_writer(self.core.sock.fileno())

    # -- commands (from AsyncEngine's methods) -------------------------------------------------------
    def _command(self, cmd: Any) -> None:
        if isinstance(cmd, AddRequests):
            token = next(self._tokens)
            self._adds[token] = cmd
            for r in cmd.requests:
                self._adding[r.request_id] = token
            self._write(("add", token, tuple((r.request_id, wire.encode_prompt(r.prompt), r.params)
                                             for r in cmd.requests)))
        elif isinstance(cmd, Admin):  # the core holds it (and what follows) until its engine is idle
            token = next(self._tokens)
            self._admins[token] = cmd
            self._write(("admin", token, cmd.op, cmd.arg))
        elif isinstance(cmd, Abort):
            self._abort([cmd.request_id], None)
        elif isinstance(cmd, AbortAll):
            if self._streams:
                log.info("aborting %d request(s) still in flight at shutdown", len(self._streams))
            self._abort(list(self._streams) + list(self._adding), RequestAborted(SHUTTING_DOWN))
        elif isinstance(cmd, Stop):
            self._abort(list(self._streams), RequestAborted(SHUTTING_DOWN))
            for token in list(self._adds):
                self._answer_add(token, EngineUnavailableError(SHUTTING_DOWN))
            self._fail_admins(EngineUnavailableError(SHUTTING_DOWN))

    def _abort(self, request_ids: list[str], exc: BaseException | None) -> None:
        sent = []
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                self.metrics.aborted.inc()
                self._assembler.forget(request_id)
                self._deliver(stream, exc or RequestAborted(f"request {request_id} aborted"), True)
                sent.append(request_id)
            elif request_id in self._adding:
                self._abort_on_add[request_id] = exc or RequestAborted(f"request {request_id} aborted")
                sent.append(request_id)
        if sent and self.error is None:
            self._write(("abort", tuple(sent)))

    # -- socket --------------------------------------------------------------------------------------
    def _write(self, message: tuple) -> None:
        if self.error is not None:
            return
        frame = wire.pack(message)
        if not self._out:
            try:
                frame = frame[self.core.sock.send(frame):]
            except BlockingIOError:
                pass
            except OSError:
                self._core_gone()
                return
            if not frame:
                return
            self._loop.add_writer(self.core.sock.fileno(), self._flush)
        self._out += frame

    def _flush(self) -> None:
        try:
            del self._out[:self.core.sock.send(self._out)]
        except BlockingIOError:
            return
        except OSError:
            self._core_gone()
            return
        if not self._out:
            self._loop.remove_writer(self.core.sock.fileno())

    def _on_readable(self) -> None:
        try:
            data = self.core.sock.recv(READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._core_gone()
            return
        for msg in self._reader.feed(data):
            self._handle(msg)

    def _core_gone(self) -> None:
        if self.error is None and not self._closing:
            how = self.core.exit_description()
            self._fail(f"the engine core process (pid {self.core.pid}) stopped unexpectedly ({how})")
        self._detach()

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
        for token in list(self._adds):
            self._answer_add(token, EngineUnavailableError(message))
        self._fail_admins(EngineUnavailableError(message))
        self._out.clear()
        if restarting:
            self.error = EngineUnavailableError(f"engine core restarting after {cause}")
            self._restart_task = self._loop.create_task(self._restart_core(cause))

    # -- restart -------------------------------------------------------------------------------------
    def _can_restart(self) -> bool:
        now = time.monotonic()
        while self._restart_times and now - self._restart_times[0] > RESTART_WINDOW_S:
            self._restart_times.popleft()
        return not self._closing and len(self._restart_times) < self.max_restarts

    def _down_reason(self) -> str:
        if self.max_restarts == 0:
            return "the server cannot serve until it is restarted (automatic engine core restarts are off)"
        return (f"the server cannot serve until it is restarted (the engine core was already restarted "
                f"{len(self._restart_times)} time(s) in the last {RESTART_WINDOW_S:.0f} s, --max-core-restarts "
                f"{self.max_restarts})")

    async def _restart_core(self, cause: str) -> None:
        """Start fresh cores until one is ready or the restart budget is spent (see the module docstring)."""
        old: CoreProcess | None = self.core
        while True:
            self._restart_times.append(time.monotonic())
            log.warning("restarting the engine core (restart %d of at most %d within %.0f s) after %s",
                        len(self._restart_times), self.max_restarts, RESTART_WINDOW_S, cause)
            try:
                core = await asyncio.to_thread(self._start_replacement, old)
            except Exception as e:  # noqa: BLE001 -- any start-up failure counts as a failed restart
                old = None
                if self._closing:
                    return  # cancelled by shutdown (or failed while closing): nothing to restart for
                cause = f"a failed engine core restart ({type(e).__name__}: {e})"
                log.error("restarting the engine core failed: %s: %s", type(e).__name__, e)
                if self._can_restart():
                    self.error = EngineUnavailableError(f"engine core restarting after {cause}")
                    continue
                self.error = EngineUnavailableError(f"the engine core is down after {cause}; {self._down_reason()}")
                log.error("%s", self.error)
                return
            if self._closing:
                await asyncio.to_thread(core.close)
                return
            self._attach(core)
            log.warning("engine core restarted (engine process pid %d); serving again", core.pid)
            return

    def _start_replacement(self, old: CoreProcess | None) -> CoreProcess:
        if old is not None:
            old.close()  # reaps the dead process and closes its socket
        return self._restart(self._restart_cancel)

    # -- messages from the core ----------------------------------------------------------------------
    def _handle(self, msg: tuple) -> None:
        tag = msg[0]
        if tag == "step":
            self._on_step(msg[1], msg[2], msg[3])
        elif tag == "added":
            err = msg[2]
            if err is None:
                self._answer_add(msg[1], None)
            elif err[0] in ("ValueError", "TypeError"):
                self._answer_add(msg[1], (ValueError if err[0] == "ValueError" else TypeError)(err[1]))
            else:
                self._answer_add(msg[1], RequestFailed(f"the engine could not add this request: {err[1]}"))
        elif tag == "stats":
            self._set_stats(msg[1])
        elif tag == "reply":
            cmd = self._admins.pop(msg[1], None)
            if cmd is not None:
                _resolve(cmd.done, None if msg[3] is None else admin_error(*msg[3]), msg[2])
        elif tag == "failed":
            self._fail(f"the engine failed: {msg[1]}")
            self._detach()

    def _fail_admins(self, exc: BaseException) -> None:
        for token in list(self._admins):
            _resolve(self._admins.pop(token).done, exc)

    def _answer_add(self, token: int, exc: BaseException | None) -> None:
        cmd = self._adds.pop(token)
        aborted = {}
        for r in cmd.requests:
            self._adding.pop(r.request_id, None)
            aborted[r.request_id] = self._abort_on_add.pop(r.request_id, None)
        if exc is None:
            for r in cmd.requests:
                self._streams[r.request_id] = r.stream
                if aborted[r.request_id] is not None:  # aborted before the core answered (it got that too)
                    self._streams.pop(r.request_id)
                    self.metrics.aborted.inc()
                    self._deliver(r.stream, aborted[r.request_id], True)
        _resolve(cmd.accepted, exc)

    def _set_stats(self, stats: dict[str, float]) -> None:
        self.stats = stats
        self.metrics.update_engine_stats(stats)

    def _on_step(self, seconds: float, stats: dict[str, float], deltas: list) -> None:
        self.metrics.steps.inc()
        self.metrics.step_time.observe(seconds)
        self.metrics.last_step.set(seconds)
        self._set_stats(stats)
        for delta in deltas:
            request_id = delta[0]
            stream = self._streams.get(request_id)
            if stream is None:  # aborted here already, or refused as part of an add
                self._assembler.forget(request_id)
                continue
            out = self._assembler.apply(delta)
            if out is None:  # cannot happen (the add's answer precedes its first delta); never crash the loop
                continue
            if out.error is not None:  # the engine aborted this request alone; its output is final
                del self._streams[request_id]
                log.error("request %s failed (aborted; the engine keeps serving): %s", request_id, out.error)
                self._deliver(stream, RequestFailed(out.error), True)
                continue
            if out.finished:
                del self._streams[request_id]
            self._deliver(stream, out, out.finished)
