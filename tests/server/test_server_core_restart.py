"""CoreAsyncEngine's restart of a dead engine core, over the scripted fake engine (the core's real loop on a
thread, see test_server_async_engine.py): requests in flight fail, new ones get 503 "restarting" until the
fresh core is attached, then they are served; failed start-ups count against the bound; a shutdown during a
restart closes the core being started; restarts off leaves the engine down; a write that finds the core gone
still reports the core's own failure. (The real process, kill -9 and
bit-identical answers after a restart: tests/server/test_server_engine_process.py.)"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
from test_server_async_engine import FakeEngine, ThreadCore, _collect, run

from detinfer.engine import core_wire as wire
from detinfer.engine.core import Abort, Failed
from detinfer.engine.core_process import EngineCoreError
from detinfer.server.async_engine import EngineUnavailableError
from detinfer.server.core_engine import CoreAsyncEngine


class Restarts:
    """The `restart` callable: each call waits for `release`, then starts the next scripted core (or raises)."""

    def __init__(self, *results, honour_cancel: bool = False):
        self.results, self.started, self.calls = list(results), [], 0
        self.release = threading.Event()
        self.honour_cancel, self.cancelled = honour_cancel, False

    def __call__(self, cancel: threading.Event):
        self.calls += 1
        deadline = time.monotonic() + 5.0
        while not self.release.wait(0.01):
            if self.honour_cancel and cancel.is_set():
                self.cancelled = True
                raise EngineCoreError("engine core start-up cancelled")
            assert time.monotonic() < deadline
        result = self.results.pop(0)
        if isinstance(result, BaseException):
            raise result
        core = ThreadCore(result)
        self.started.append(core)
        return core


async def _until(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)


async def _core_dies(restarts, max_restarts: int, fail_at_step: int = 1, match: str | None = None) -> CoreAsyncEngine:
    """A started CoreAsyncEngine whose core fails while serving a first request (which must fail with an
    EngineUnavailableError matching `match`)."""
    ae = CoreAsyncEngine(ThreadCore(FakeEngine(fail_at_step=fail_at_step)), restart=restarts,
                         max_restarts=max_restarts)
    ae.start()
    s = await ae.add_request("r", [1], 100)
    with pytest.raises(EngineUnavailableError, match=match):
        await _collect(s)
    return ae


def test_a_failed_core_is_replaced_and_serves_again():
    restarts = Restarts(FakeEngine())

    async def main():
        ae = await _core_dies(restarts, 1, fail_at_step=3,
                              match="requests in flight are lost and the server is restarting")
        await _until(lambda: restarts.calls == 1)
        assert not ae.is_healthy
        assert ae.unavailable_reason() == "engine core restarting after the engine failed: RuntimeError('device lost')"
        with pytest.raises(EngineUnavailableError, match="^engine core restarting after the engine failed"):
            await ae.add_request("r2", [1], 1)
        restarts.release.set()
        await _until(lambda: ae.is_healthy)
        assert ae.core is restarts.started[0] and ae.unavailable_reason() is None
        final = await _collect(await ae.add_request("r3", [1, 2], 4))
        assert final.finished and final.outputs[0].token_ids == (7, 7, 7, 7)
        await ae.shutdown()

    run(main())


def test_failed_start_ups_count_against_the_bound():
    restarts = Restarts(RuntimeError("out of memory"), RuntimeError("out of memory"))
    restarts.release.set()

    async def main():
        ae = await _core_dies(restarts, 2)
        await _until(lambda: restarts.calls == 2 and "down" in (ae.unavailable_reason() or ""))
        reason = ae.unavailable_reason()
        assert reason.startswith("the engine core is down after a failed engine core restart (RuntimeError: out of")
        assert "already restarted 2 time(s)" in reason and "--max-core-restarts 2" in reason
        with pytest.raises(EngineUnavailableError, match="the engine core is down"):
            await ae.add_request("r2", [1], 1)
        await ae.shutdown()

    run(main())
    assert restarts.calls == 2  # not a third time


def test_shutdown_during_a_restart_closes_the_core_being_started():
    restarts = Restarts(FakeEngine())

    async def main():
        ae = await _core_dies(restarts, 3)
        await _until(lambda: restarts.calls == 1)
        shutting_down = asyncio.ensure_future(ae.shutdown())
        await asyncio.sleep(0.05)
        restarts.release.set()
        await shutting_down
        assert not ae.is_healthy and ae.core is not restarts.started[0]

    run(main())
    restarts.started[0].thread.join(5.0)
    assert not restarts.started[0].thread.is_alive()  # it was told to shut down


def test_shutdown_cancels_a_start_up_that_is_still_loading():
    restarts = Restarts(FakeEngine(), honour_cancel=True)  # never released: a model load that takes forever

    async def main():
        ae = await _core_dies(restarts, 3)
        await _until(lambda: restarts.calls == 1)
        t = time.monotonic()
        await ae.shutdown()
        assert time.monotonic() - t < 2.0, "shutdown waited for the start-up"
        assert restarts.cancelled and not restarts.started and not ae.is_healthy

    run(main())
    assert restarts.calls == 1  # a cancelled start-up is not retried


def test_restarts_off_leaves_the_engine_down():
    async def main():
        ae = await _core_dies(Restarts(), 0, match="automatic engine core restarts are off")
        await asyncio.sleep(0.1)
        assert "restarts are off" in ae.unavailable_reason()
        await ae.shutdown()

    run(main())


class _ClosedCore:
    """A core that sent its last events and closed its end (what a failed step leaves behind)."""

    pid = 0

    def __init__(self, *events):
        self.sock, theirs = socket.socketpair()
        for event in events:
            wire.send(theirs, event)
        theirs.close()

    def exit_description(self) -> str:
        return "its thread ended"

    def close(self) -> None:
        self.sock.close()


def test_a_write_that_finds_the_core_gone_still_reports_its_failure():
    """The core failed a step (`Failed`, then it closed its socket); the front end writes a command before
    the loop read that event: the write fails, and the requests must still learn the core's cause, not a
    bare "stopped unexpectedly"."""
    async def main():
        ae = CoreAsyncEngine(_ClosedCore(Failed("RuntimeError('device lost')")))
        ae.start()
        ae._send(Abort(("r",)))  # synchronous: the reader callback has not run yet
        assert isinstance(ae.error, EngineUnavailableError)
        assert "the engine failed: RuntimeError('device lost')" in str(ae.error), ae.error
        await ae.shutdown()

    run(main())
