"""The server's engine front ends over a scripted fake engine: AsyncEngine (the engine core on a thread +
asyncio streams) and CoreAsyncEngine (the engine core's real loop and wire format, here with the core on a
thread of the test process so the fake engine can be scripted): admission bound, aborts, engine failure, shutdown and
drain, cancellation while adding. Every test runs against both, so they keep the same semantics. Each test
runs its own event loop and bounds every wait, so a bug shows as a failure, never as a hung CI job."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import traceback

import pytest

from detinfer.engine import core_wire as wire
from detinfer.engine.core import EngineCoreError, Shutdown
from detinfer.engine.core_process import serve_core
from detinfer.engine.outputs import CompletionOutput, EngineStats, RequestOutput
from detinfer.server.async_engine import (
    AsyncEngine,
    EngineUnavailableError,
    QueueFullError,
    RequestAborted,
    RequestFailed,
    RequestStream,
    RequestTooLargeError,
)
from detinfer.server.core_engine import CoreAsyncEngine

WAIT_S = 10.0


class FakeEngine:
    """Follows LLMEngine's contract: the prompt is a list of ids, each step appends token 7 to every
    request; a request holds one KV block until it ends; abort frees at once and reports in the next step."""

    def __init__(self, step_seconds: float = 0.0, fail_at_step: int | None = None, fail_request: str | None = None):
        self.step_seconds, self.fail_at_step, self.fail_request = step_seconds, fail_at_step, fail_request
        self.requests: dict[str, dict] = {}
        self.aborted: list[str] = []
        self.steps = 0
        self.thread_ids: set[int] = set()

    def add_request(self, request_id, prompt, params):
        self.thread_ids.add(threading.get_ident())
        if not prompt:
            raise ValueError("prompt is empty")
        self.requests[request_id] = {"prompt": tuple(prompt), "out": [], "max": params, "aborted": False}

    def abort_request(self, request_id):
        self.thread_ids.add(threading.get_ident())
        if request_id in self.requests:
            self.requests[request_id]["aborted"] = True
            self.aborted.append(request_id)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        self.thread_ids.add(threading.get_ident())
        self.steps += 1
        if self.fail_at_step is not None and self.steps >= self.fail_at_step:
            raise RuntimeError("device lost")
        time.sleep(self.step_seconds)
        outs = []
        for rid, r in list(self.requests.items()):
            if not r["aborted"]:
                r["out"].append(7)
            failed = rid == self.fail_request and len(r["out"]) == 2  # LLMEngine's isolation, scripted
            reason = "abort" if r["aborted"] or failed else "length" if len(r["out"]) >= r["max"] else None
            comp = CompletionOutput(0, "x" * len(r["out"]), tuple(r["out"]), None, None, reason)
            outs.append(RequestOutput(rid, None, r["prompt"], None, (comp,), reason is not None,
                                      "RuntimeError: injected" if failed else None))
            if reason is not None:
                del self.requests[rid]
        return outs

    def stats(self):
        live = sum(not r["aborted"] for r in self.requests.values())
        return EngineStats(live, 0, live, 0, 64, self.steps, 0, 0, 0, 0, 0, 0, 0.0, 0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, WAIT_S))


class ThreadCore:
    """Stands in for a started CoreProcess: the real EngineCore over `engine`, on a thread, across a socketpair."""

    pid = 0

    def __init__(self, engine):
        self.sock, self._theirs = socket.socketpair()
        self.thread = threading.Thread(target=self._run, args=(engine,), daemon=True)
        self.thread.start()

    def _run(self, engine) -> None:
        try:
            serve_core(engine, self._theirs)
        except (EOFError, ConnectionError, EngineCoreError):
            pass
        except Exception:  # what an uncaught error does to the process: its traceback, then the exit
            traceback.print_exc()
        finally:
            self._theirs.close()  # what a process's exit does: the front end sees EOF

    def exit_description(self) -> str:
        return "its thread ended"

    def close(self) -> None:
        try:
            wire.send(self.sock, Shutdown())
            wire.drain_until_closed(self.sock, WAIT_S)
        except OSError:
            pass
        self.sock.close()
        self.thread.join(WAIT_S)


@pytest.fixture(params=["thread", "core"])
def front(request) -> str:
    return request.param


async def _started(front: str, engine, **kw) -> AsyncEngine:
    ae = AsyncEngine(engine, **kw) if front == "thread" else CoreAsyncEngine(ThreadCore(engine), **kw)
    ae.start()
    return ae


async def _collect(stream: RequestStream):
    outs = [out async for out in stream]
    return outs[-1]


def test_requests_run_on_the_engine_thread_and_finish(front):
    fake = FakeEngine()

    async def main():
        ae = await _started(front, fake)
        streams = [await ae.add_request(f"r{i}", [1, 2], 3 + i) for i in range(4)]
        finals = await asyncio.gather(*map(_collect, streams))
        assert [len(f.outputs[0].token_ids) for f in finals] == [3, 4, 5, 6]
        assert all(f.finished for f in finals) and ae.num_pending == 0
        await ae.shutdown()
        return ae

    ae = run(main())
    assert len(fake.thread_ids) == 1 and threading.get_ident() not in fake.thread_ids
    assert ae.metrics.steps.get() == fake.steps and ae.metrics.engine_alive.get() == 0


def test_refused_request_raises_and_releases_its_slot(front):
    async def main():
        ae = await _started(front, FakeEngine(), max_pending_requests=1)
        with pytest.raises(ValueError, match="empty"):
            await ae.add_request("bad", [], 3)
        assert ae.num_pending == 0
        await _collect(await ae.add_request("good", [1], 2))  # the slot is free again
        await ae.shutdown()

    run(main())


def test_admission_bound_raises_queue_full(front):
    async def main():
        ae = await _started(front, FakeEngine(step_seconds=0.01), max_pending_requests=2)
        a = await ae.add_request("a", [1], 50)
        b = await ae.add_request("b", [1], 50)
        with pytest.raises(QueueFullError):
            await ae.add_request("c", [1], 1)
        assert ae.metrics.rejected.get(reason="queue_full") == 1
        ae.abort("a")
        with pytest.raises(RequestAborted):
            await _collect(a)
        await _collect(await ae.add_request("c", [1], 1))  # admitted once a slot freed
        await _collect(b)
        await ae.shutdown()

    run(main())


def test_abort_frees_the_request_in_the_engine(front):
    fake = FakeEngine(step_seconds=0.005)

    async def main():
        ae = await _started(front, fake)
        s = await ae.add_request("long", [1], 10_000)
        await s.__anext__()
        ae.abort("long")
        with pytest.raises(RequestAborted):
            await _collect(s)
        ae.abort("long")  # twice, or after the end: a no-op
        for _ in range(200):  # the engine reports the abort in its next step and forgets the request
            if not fake.requests and ae.stats.get("kv_blocks_used") == 0:
                break
            await asyncio.sleep(0.01)
        assert fake.aborted == ["long"] and not fake.requests and ae.stats["kv_blocks_used"] == 0
        assert ae.metrics.aborted.get() == 1 and ae.num_pending == 0
        await ae.shutdown()

    run(main())


def test_stream_skips_to_the_latest_cumulative_output():
    async def main():
        s = RequestStream("r")
        for k in range(1, 4):
            comp = CompletionOutput(0, "", (7,) * k, None, None, "length" if k == 3 else None)
            s._put(RequestOutput("r", None, (1,), None, (comp,), k == 3))
        outs = [o async for o in s]
        assert len(outs) == 1 and len(outs[0].outputs[0].token_ids) == 3

    run(main())


def _assert_failed_core_fails_requests_and_refuses_new_ones(front, engine, match=None):
    """A request in flight gets EngineUnavailableError (matching `match`), the front end turns unhealthy with
    nothing pending, and a new request is refused."""
    async def main():
        ae = await _started(front, engine)
        s = await ae.add_request("r", [1], 100)
        with pytest.raises(EngineUnavailableError, match=match):
            await _collect(s)
        assert not ae.is_healthy and ae.num_pending == 0
        with pytest.raises(EngineUnavailableError):
            await ae.add_request("r2", [1], 1)
        await ae.shutdown()

    run(main())


def test_engine_failure_fails_requests_and_refuses_new_ones(front):
    _assert_failed_core_fails_requests_and_refuses_new_ones(front, FakeEngine(fail_at_step=3), match="device lost")


def test_shutdown_aborts_in_flight_and_refuses_new(front):
    fake = FakeEngine(step_seconds=0.005)

    async def main():
        ae = await _started(front, fake)
        s = await ae.add_request("r", [1], 10_000)
        await ae.shutdown()
        with pytest.raises(RequestAborted):
            await _collect(s)
        with pytest.raises(EngineUnavailableError):
            await ae.add_request("r2", [1], 1)
        assert ae.num_pending == 0

    run(main())
    assert fake.aborted == ["r"]


def test_drain_lets_short_requests_finish_then_aborts_the_rest(front):
    async def main():
        ae = await _started(front, FakeEngine(step_seconds=0.002))
        short = await ae.add_request("short", [1], 3)
        long = await ae.add_request("long", [1], 100_000)
        t0 = time.monotonic()
        ae.request_drain(0.3)
        await asyncio.sleep(0)  # the drain is scheduled through the loop (it is signal-safe)
        await asyncio.sleep(0.01)
        with pytest.raises(EngineUnavailableError):
            await ae.add_request("late", [1], 1)
        assert (await _collect(short)).outputs[0].finish_reason == "length"
        with pytest.raises(RequestAborted):
            await _collect(long)
        assert time.monotonic() - t0 >= 0.3
        await ae.shutdown()

    run(main())


def test_cancelled_add_is_undone(front):
    """A client that disconnects while its add waits for a busy engine thread must not leak the request."""
    fake = FakeEngine(step_seconds=0.2)

    async def main():
        ae = await _started(front, fake)
        busy = await ae.add_request("busy", [1], 3)  # keeps the thread inside slow steps
        task = asyncio.ensure_future(ae.add_request("gone", [1], 10_000))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _collect(busy)
        for _ in range(300):
            if ae.num_pending == 0 and not fake.requests:
                break
            await asyncio.sleep(0.01)
        assert ae.num_pending == 0 and "gone" in fake.aborted and not fake.requests
        await ae.shutdown()

    run(main())


def test_requests_of_one_http_request_are_admitted_together(front):
    """A request with k prompts reserves k slots at once: all fit, or none starts (429); k above the bound
    can never fit (RequestTooLargeError -> 400, not "retry later")."""
    fake = FakeEngine(step_seconds=0.01)

    async def main():
        ae = await _started(front, fake, max_pending_requests=4)
        with pytest.raises(RequestTooLargeError, match="more than this server ever admits"):
            await ae.add_requests([(f"big{i}", [1], 1) for i in range(5)])
        held = await ae.add_requests([("a", [1], 50), ("b", [1], 50)])
        with pytest.raises(QueueFullError):
            await ae.add_requests([(f"c{i}", [1], 1) for i in range(3)])
        assert ae.num_pending == 2 and not any(r.startswith(("big", "c")) for r in fake.requests)
        # one refused prompt: none of the group stays in the engine, and every slot comes back
        with pytest.raises(ValueError, match="empty"):
            await ae.add_requests([("d0", [1], 1), ("d1", [], 1)])
        assert ae.num_pending == 2
        await asyncio.gather(*map(_collect, await ae.add_requests([("e0", [1], 1), ("e1", [1], 2)])))
        for s in held:
            ae.abort(s.request_id)
        await ae.shutdown()
        assert ae.num_pending == 0 and "d0" in fake.aborted

    run(main())


def test_a_request_failure_ends_only_its_stream(front):
    """An output carrying `error` (the engine aborted that request alone) ends its stream with RequestFailed;
    the engine stays healthy and the other requests run to the end."""
    async def main():
        ae = await _started(front, FakeEngine(fail_request="bad"))
        good = await ae.add_request("good", [1], 5)
        bad = await ae.add_request("bad", [1], 5)
        with pytest.raises(RequestFailed, match="injected"):
            await _collect(bad)
        assert (await _collect(good)).outputs[0].finish_reason == "length"
        assert ae.is_healthy and ae.num_pending == 0
        await _collect(await ae.add_request("after", [1], 2))
        await ae.shutdown()

    run(main())


def test_an_unexpected_add_failure_is_that_request_s_error(front):
    class Exploding(FakeEngine):
        def add_request(self, request_id, prompt, params):
            if request_id == "boom":
                raise KeyError("tokenizer state")
            super().add_request(request_id, prompt, params)

    async def main():
        ae = await _started(front, Exploding())
        with pytest.raises(RequestFailed, match="could not add"):
            await ae.add_request("boom", [1], 2)
        assert ae.is_healthy and ae.num_pending == 0
        await _collect(await ae.add_request("fine", [1], 2))
        await ae.shutdown()

    run(main())


def test_admin_waits_for_requests_in_flight_and_holds_later_ones(front):
    """An admin operation runs once the requests before it finished, with none of the requests sent after it
    started; its errors come back as ValueError (bad op) or EngineUnavailableError (the engine failed)."""
    class Admins(FakeEngine):
        def reset_prefix_cache(self):
            self.seen_at_reset = (self.steps, dict(self.requests))
            return 0

    fake = Admins(step_seconds=0.002)

    async def main():
        ae = await _started(front, fake)
        first = await ae.add_request("a", [1], 5)
        admin = asyncio.ensure_future(ae.admin("reset_prefix_cache"))
        await asyncio.sleep(0)  # the operation is sent before the next request
        later = asyncio.ensure_future(ae.add_request("b", [1], 2))
        assert await admin == {"prefix_cache_blocks_dropped": 0}
        assert fake.seen_at_reset[0] >= 5 and not fake.seen_at_reset[1]  # "a" had finished, "b" not added
        assert (await _collect(first)).finished and (await _collect(await later)).finished
        with pytest.raises(ValueError, match="unknown admin operation"):
            await ae.admin("nope")
        await ae.shutdown()

    run(main())


def test_an_admin_operation_waiting_when_the_engine_fails_gets_503(front):
    async def main():
        ae = await _started(front, FakeEngine(fail_at_step=3))
        s = await ae.add_request("r", [1], 100)
        admin = asyncio.ensure_future(ae.admin("reset_prefix_cache"))  # held behind "r", which never ends
        with pytest.raises(EngineUnavailableError, match="device lost"):
            await _collect(s)
        with pytest.raises(EngineUnavailableError, match="device lost"):
            await admin
        await ae.shutdown()

    run(main())


def test_an_unexpected_error_in_the_core_fails_requests_instead_of_hanging(front):
    """A core whose loop breaks outside a step (here the engine's has_unfinished_requests raises) ends: its
    requests get EngineUnavailableError and /health turns 503, in both modes (the engine thread used to die
    silently, leaving its requests waiting forever)."""
    class Broken(FakeEngine):
        def has_unfinished_requests(self):
            if self.steps >= 2:
                raise RuntimeError("scheduler state corrupt")
            return super().has_unfinished_requests()

    _assert_failed_core_fails_requests_and_refuses_new_ones(front, Broken())
