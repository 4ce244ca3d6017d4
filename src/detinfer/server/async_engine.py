"""The engine loop thread and its asyncio front end.

`LLMEngine.step()` is synchronous and compute-bound, so it must never run on the event loop. One thread owns
the engine: it is the only code that touches it. Each iteration it takes every command queued since the
previous step (add / abort / stop), applies them, runs one step and hands each request's output to that
request's `RequestStream`, an asyncio queue living on the event loop. New requests therefore join the
running batch at the next step (continuous batching), and an abort frees its KV blocks before the next step.

Crossing threads: the event loop puts commands on a `queue.SimpleQueue`; the engine thread answers with
`loop.call_soon_threadsafe`. Nothing else is shared except plain snapshots (`stats`) that are replaced
whole, never mutated, so readers need no lock.

Admission is bounded (`max_pending_requests`): past the bound `add_request` raises `QueueFullError` (a 429)
instead of letting the queue, and every client's latency, grow without limit.

`Generation` groups the engine requests behind one HTTP request (one per prompt), merges their streams and
aborts them together; `ChoiceTracker` turns cumulative outputs into the deltas a stream sends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from detinfer.server.metrics import ServerMetrics

log = logging.getLogger("detinfer.server")


class QueueFullError(Exception):
    """Too many requests in flight; retry later (429)."""


class EngineUnavailableError(Exception):
    """The engine is shutting down or has failed (503)."""


class RequestAborted(Exception):
    """The request was aborted (server shutdown, or abort() by its owner) before it finished."""


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


def _resolve(fut: asyncio.Future, exc: BaseException | None) -> None:
    # Runs on the event loop.
    if not fut.done():
        fut.set_exception(exc) if exc is not None else fut.set_result(None)


def _normalize_stats(raw: Any) -> dict[str, float]:
    """Engine stats (a dict or a dataclass) as a plain dict of numbers."""
    if dataclasses.is_dataclass(raw) and not isinstance(raw, type):
        raw = dataclasses.asdict(raw)
    return {k: v for k, v in dict(raw or {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class AsyncEngine:
    def __init__(self, engine: Any, *, max_pending_requests: int = 1024, metrics: ServerMetrics | None = None):
        self.engine = engine
        self.max_pending_requests = max_pending_requests
        self.metrics = metrics or ServerMetrics()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._num_pending = 0  # event-loop side only
        self._closing = False
        self.error: BaseException | None = None  # set by the engine thread when a step raised
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
        self._loop.call_later(grace_seconds, self._commands.put, ("abort_all",))

    async def shutdown(self) -> None:
        """Abort whatever is still in flight (each stream ends with RequestAborted) and stop the thread."""
        self._closing = True
        if self._thread is None:
            return
        self._commands.put(("stop",))
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        self.metrics.engine_alive.set(0)

    @property
    def is_healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_pending(self) -> int:
        return self._num_pending

    # -- requests (event loop) -----------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: Any, params: Any) -> RequestStream:
        """Queue a request; returns once the engine accepted it. Raises the engine's ValueError/TypeError
        for input it refuses, QueueFullError past max_pending_requests, EngineUnavailableError when
        shutting down or failed."""
        if self._closing or self._thread is None:
            raise EngineUnavailableError("the server is shutting down")
        if self.error is not None:
            raise EngineUnavailableError(f"the engine failed: {self.error!r}")
        if self._num_pending >= self.max_pending_requests:
            self.metrics.rejected.inc(reason="queue_full")
            raise QueueFullError(f"too many requests in flight ({self._num_pending}); retry later")
        stream = RequestStream(request_id)
        accepted = self._loop.create_future()
        self._num_pending += 1
        self.metrics.pending.set(self._num_pending)
        self._commands.put(("add", request_id, prompt, params, stream, accepted))
        try:
            await asyncio.shield(accepted)
        except asyncio.CancelledError:
            # The caller went away while the engine thread was busy. Undo the add once its fate is known:
            # accepted -> abort it (its stream's final item releases the slot); refused -> release here.
            def undo(fut: asyncio.Future) -> None:
                if fut.exception() is None:
                    self.abort(request_id)
                else:
                    self._release()

            accepted.add_done_callback(undo)
            raise
        except BaseException:
            self._release()  # refused: it never became pending in the engine
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished). Its stream ends with RequestAborted."""
        self._commands.put(("abort", request_id))

    def _release(self) -> None:
        self._num_pending -= 1
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
        while True:
            # Block for commands only while there is nothing to step. (An aborted request still counts:
            # the engine reports its end in the next step, and that step releases its bookkeeping.)
            busy = self.error is None and (bool(streams) or self.engine.has_unfinished_requests())
            commands = [] if busy else [self._commands.get()]
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for cmd in commands:
                if cmd[0] == "stop":
                    self._abort_all(streams, RequestAborted("the server is shutting down"))
                    for late in commands:  # adds queued behind the stop get an answer, not silence
                        if late[0] == "add":
                            self._call(_resolve, late[5], EngineUnavailableError("the server is shutting down"))
                    return
                if cmd[0] == "add":
                    self._apply_add(streams, *cmd[1:])
                elif cmd[0] == "abort":
                    self._apply_abort(streams, cmd[1])
                elif cmd[0] == "abort_all":
                    if streams:
                        log.info("aborting %d request(s) still in flight at shutdown", len(streams))
                    self._abort_all(streams, RequestAborted("the server is shutting down"))
            if self.error is None and self.engine.has_unfinished_requests():
                self._step(streams)
            self._snapshot_stats()

    def _apply_add(self, streams, request_id, prompt, params, stream, accepted) -> None:
        if self.error is not None:
            self._call(_resolve, accepted, EngineUnavailableError(f"the engine failed: {self.error!r}"))
            return
        if request_id in streams:
            self._call(_resolve, accepted, ValueError(f"request id {request_id!r} is already running"))
            return
        try:
            self.engine.add_request(request_id, prompt, params)
        except (ValueError, TypeError) as e:
            self._call(_resolve, accepted, e)
            return
        streams[request_id] = stream
        self._call(_resolve, accepted, None)

    def _apply_abort(self, streams, request_id) -> None:
        stream = streams.pop(request_id, None)
        if stream is None:
            return  # finished already (or never added)
        self.metrics.aborted.inc()
        try:
            self.engine.abort_request(request_id)
        finally:
            self._call(self._deliver, stream, RequestAborted(f"request {request_id} aborted"), True)

    def _abort_all(self, streams, exc: BaseException) -> None:
        for request_id in list(streams):
            stream = streams.pop(request_id)
            self.metrics.aborted.inc()
            if self.error is None:
                try:
                    self.engine.abort_request(request_id)
                except Exception:
                    log.exception("abort_request(%s) failed during shutdown", request_id)
            self._call(self._deliver, stream, exc, True)
        self._snapshot_stats()

    def _step(self, streams) -> None:
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:
            # The engine's state is unknown after a failed step: fail everything in flight (500s, not
            # hangs) and refuse new work (503) rather than risk serving wrong numbers.
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
            if out.finished:
                del streams[out.request_id]
            batch.append((stream, out, out.finished))
        if batch:
            self._call(self._deliver_batch, batch)
        if streams and not self.engine.has_unfinished_requests():
            # Should not happen: the engine reports every request as finished. Never leave a client hanging.
            for request_id in list(streams):
                log.error("engine dropped request %s without finishing it", request_id)
                self._call(self._deliver, streams.pop(request_id),
                           EngineUnavailableError("the engine lost this request"), True)

    def _snapshot_stats(self) -> None:
        try:
            stats = _normalize_stats(self.engine.stats())
        except Exception:
            log.exception("engine.stats() failed")
            return
        self.stats = stats
        self.metrics.update_engine_stats(stats)


class ChoiceTracker:
    """Per-choice progress of a streamed request: what was already sent, to emit only the new part."""

    def __init__(self, n: int):
        self.n = n
        self.text_sent: dict[int, int] = {}
        self.tokens_sent: dict[int, int] = {}
        self.finished: dict[int, str] = {}

    def deltas(self, prompt_index: int, out: Any):
        """(choice index, new text, new logprob entries or None, finish_reason newly reached or None)."""
        for o in out.outputs:
            c = prompt_index * self.n + o.index
            if c in self.finished:
                continue
            t0, k0 = self.text_sent.get(c, 0), self.tokens_sent.get(c, 0)
            text, new_lp = o.text[t0:], (o.logprobs[k0:] if o.logprobs is not None else None)
            self.text_sent[c], self.tokens_sent[c] = len(o.text), len(o.token_ids)
            if o.finish_reason is not None:
                self.finished[c] = o.finish_reason
            if text or new_lp or o.finish_reason is not None:
                yield c, text, new_lp, o.finish_reason


class Generation:
    """The engine requests behind one HTTP request: one per prompt, each with the request's n samples.
    Whatever way its user exits, `abort()` (idempotent) must run: it frees whatever is still running."""

    def __init__(self, engine: AsyncEngine, request_id: str, prompts: list[list[int]], params: Any):
        self.engine, self.request_id, self.prompts, self.params = engine, request_id, prompts, params
        self.streams: list = []
        self.latest: list[Any] = [None] * len(prompts)

    async def start(self) -> None:
        """Add every prompt's request; on any failure (AsyncEngine.add_request's errors) none stays."""
        try:
            for i, ids in enumerate(self.prompts):
                self.streams.append(await self.engine.add_request(f"{self.request_id}-{i}", ids, self.params))
        finally:
            if len(self.streams) < len(self.prompts):
                self.abort()

    def abort(self) -> None:
        for s in self.streams:
            if not s.finished:
                self.engine.abort(s.request_id)

    async def updates(self) -> AsyncIterator[tuple[int, Any]]:
        """(prompt index, latest RequestOutput) as they come, until every prompt's request finished."""
        pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(self.streams)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = pending.pop(task)
                    try:
                        out = task.result()
                    except StopAsyncIteration:
                        continue
                    self.latest[i] = out
                    yield i, out
                    if not out.finished:
                        pending[asyncio.ensure_future(anext(self.streams[i]))] = i
        finally:
            for task in pending:
                task.cancel()

    async def run_to_end(self, client_gone: Callable[[], Awaitable[Any]]) -> list[Any]:
        """Every prompt's final output. If `client_gone()` completes first, aborts everything and raises
        ClientDisconnected; RequestAborted / EngineUnavailableError from the streams propagate."""

        async def consume():
            async for _ in self.updates():
                pass

        work, watch = asyncio.ensure_future(consume()), asyncio.ensure_future(client_gone())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # nobody is left to answer; the finally below aborts the requests
                raise ClientDisconnected(self.request_id)
            work.result()
            return self.latest
        finally:
            work.cancel()
            watch.cancel()
            self.abort()

    def token_counts(self) -> tuple[int, int]:
        """(prompt tokens, completion tokens) so far, over every prompt and sample."""
        completion = sum(len(o.token_ids) for out in self.latest if out is not None for o in out.outputs)
        return sum(len(p) for p in self.prompts), completion
