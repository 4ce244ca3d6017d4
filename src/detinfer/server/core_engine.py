"""`CoreAsyncEngine`: the server's engine front end when the engine core runs in its own process (the default;
`--no-engine-process` keeps the core on a thread, `async_engine.AsyncEngine`).

Everything a front end does is inherited from `AsyncEngine`; this adds only what a process needs. Nothing
here runs a thread: the event loop writes commands to the core's socket without blocking (what the socket
cannot take now is buffered and flushed when writable) and reads the core's events as they arrive
(`loop.add_reader`); a step's output deltas are assembled into the same `RequestOutput`s the in-process
engine returns.

Failure: a core that dies (killed, crashed) closes its socket; the EOF fails every in-flight request with
EngineUnavailableError (HTTP 500; streams get an error event and [DONE]), /health turns 503 and new requests
get 503 naming how the core ended. A step that failed as a whole in the core (`Failed`) is handled the same way.

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
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from detinfer.engine import core_wire as wire
from detinfer.engine.core_process import CoreProcess
from detinfer.engine.outputs import RequestOutput
from detinfer.server.async_engine import AsyncEngine, EngineUnavailableError
from detinfer.server.metrics import ServerMetrics

log = logging.getLogger("detinfer.server")
READ_CHUNK = 1 << 20
RESTART_WINDOW_S = 600.0  # max_restarts counts the restarts of the last ten minutes


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
        self._assembler = wire.OutputAssembler()
        self._reader = wire.FrameReader()
        self._out = bytearray()  # written frames the socket could not take yet

    # -- AsyncEngine's transport -----------------------------------------------------------------------
    def _start_core(self) -> None:
        self._attach(self.core)

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

    def _outputs(self, deltas: tuple) -> list[RequestOutput]:
        return self._assembler.apply_step(deltas, self._streams.__contains__)

    async def _stop_core(self) -> None:
        if self._restart_task is not None:
            self._restart_cancel.set()  # a start-up in progress stops waiting for its model to load
            await self._restart_task  # a core that still finished starting is closed (we are closing)
        self._detach()
        await asyncio.to_thread(self._close_core)

    def _close_core(self) -> None:
        try:
            self.core.sock.setblocking(True)
            if self._out and self.error is None:  # never leave half a frame in front of Shutdown
                self.core.sock.sendall(self._out)
        except OSError:
            pass
        self._out.clear()
        self.core.close()

    def _detach(self) -> None:
        if self._loop is not None and self.core.sock.fileno() >= 0:
            self._loop.remove_reader(self.core.sock.fileno())
            self._loop.remove_writer(self.core.sock.fileno())

    # -- socket --------------------------------------------------------------------------------------
    def _send(self, command: Any) -> None:
        """Write `command` now as far as the socket takes it; the rest is flushed when it is writable."""
        if self.error is not None:
            return
        frame = wire.pack(wire.encode_prompts(command))
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
        self._handle(data)

    def _handle(self, data: bytes) -> None:
        for event in self._reader.feed(data):
            self._on_event(event)

    def _core_gone(self) -> None:
        if self.error is None and not self._closing:
            # A write can fail (the core closed its end) before the loop has read what the core sent last:
            # a `Failed` naming the cause, which is the better message for the requests in flight.
            self._read_what_is_left()
        if self.error is None and not self._closing:
            how = self.core.exit_description()
            self._fail(f"the engine core process (pid {self.core.pid}) stopped unexpectedly ({how})")
        self._detach()

    def _read_what_is_left(self) -> None:
        """Handle the events still unread in the socket of a core that is gone (the socket is non-blocking:
        a read returns data, EOF or an error at once)."""
        while self.error is None:
            try:
                data = self.core.sock.recv(READ_CHUNK)
            except OSError:  # nothing more (BlockingIOError), or the socket is closed / reset
                return
            if not data:
                return
            self._handle(data)

    def _core_failed(self, cause: str, restarting: bool) -> None:
        self._out.clear()
        self._detach()
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

