"""`EngineCore`: the one place that drives an `LLMEngine` for a front end, and the messages it speaks.

A front end (the API server, or `LLM(engine_process=True)`) never touches the engine. It sends commands; the
core applies them between steps and answers with events. The same core runs on a thread of the server
(`--no-engine-process`: commands through a queue, events handed to the event loop) and in its own process
(`core_process`: the same dataclasses pickled over a socketpair, outputs as deltas), so both modes share one
implementation of every rule below.

Each iteration takes every command queued since the previous step, applies them, runs one step and emits its
outputs as one `StepDone`. It blocks for commands only while the engine has nothing to step; new requests
therefore join the running batch at the next step (continuous batching), and an abort frees its KV blocks
before the next step.

* Adds are all or none: the requests of one `AddRequests` are all accepted, or the ones already added are
  aborted again and `Added.error` says why (ValueError/TypeError: the engine refused the input).
* Admin operations (engine/admin.py) wait until the engine is idle, and every command after one waits with
  it (`HeldCommands`). An abort also reaches requests already running at once, so a load never waits for a
  request nobody reads.
* A failure the engine pins on one request is that request's output (`RequestOutput.error`). A step that
  raises as a whole leaves the engine's state unknown: the core emits `Failed` and stops rather than serve
  wrong numbers.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from detinfer.engine.admin import HeldCommands, run_admin

log = logging.getLogger("detinfer.engine.core")


class EngineCoreError(RuntimeError):
    """The engine core died or failed; nothing it held can be recovered."""


# -- front end -> core -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequests:
    """((request_id, prompt, SamplingParams), ...) added together; answered by `Added`."""

    token: int
    requests: tuple


@dataclass(frozen=True)
class Abort:
    request_ids: tuple


@dataclass(frozen=True)
class AbortAll:
    """Abort every request the core added that has not finished (the end of a drain's grace period)."""


@dataclass(frozen=True)
class Admin:
    """An engine/admin.py operation (load_weights, reset_prefix_cache, weights_fingerprint); answered by `Reply`."""

    token: int
    op: str
    arg: Any = None


@dataclass(frozen=True)
class Call:
    """An engine method without arguments (reset_prefix_cache); answered by `Reply`."""

    token: int
    method: str


@dataclass(frozen=True)
class Shutdown:
    pass


# -- core -> front end -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    info: dict


@dataclass(frozen=True)
class StartupError:
    kind: str  # the exception's type name
    message: str


@dataclass(frozen=True)
class Added:
    token: int
    error: tuple[str, str] | None  # (kind, message); kind "ValueError", "TypeError" or "other"


@dataclass(frozen=True)
class StepDone:
    """One engine step: its seconds, the stats after it, its outputs (RequestOutputs, or their deltas across a
    process boundary)."""

    seconds: float
    stats: dict
    outputs: tuple


@dataclass(frozen=True)
class Stats:
    """The stats after commands that ran no step."""

    stats: dict


@dataclass(frozen=True)
class Reply:
    token: int
    result: Any
    error: tuple[str, str] | None


@dataclass(frozen=True)
class Failed:
    """A step failed as a whole; the core stops after this."""

    message: str


def error_of(e: BaseException) -> tuple[str, str]:
    if isinstance(e, (ValueError, TypeError)):
        return type(e).__name__, str(e)
    return "other", repr(e)


# Exceptions a front end raises as their own type: ValueError/TypeError (the engine refused the input; `error_of`
# names no other), and what a core's start-up may fail with (`StartupError`).
_KNOWN_ERRORS = {e.__name__: e for e in (ValueError, TypeError, OSError, FileNotFoundError, KeyError, RuntimeError)}


def exception_of(error: tuple[str, str], other: Callable[[str], BaseException] = RuntimeError) -> BaseException:
    """The exception a front end raises for an `error_of` pair or a `StartupError`'s (kind, message): the
    known types above as such, anything else as `other(message)`."""
    kind, message = error
    return _KNOWN_ERRORS.get(kind, other)(message)


def stats_dict(raw: Any) -> dict[str, float]:
    """Engine stats (a dict or a dataclass) as a plain dict of numbers."""
    if dataclasses.is_dataclass(raw) and not isinstance(raw, type):
        raw = {f.name: getattr(raw, f.name) for f in dataclasses.fields(raw)}
    return {k: v for k, v in dict(raw or {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def take_from(commands: queue.SimpleQueue) -> Callable[[float | None], list]:
    """EngineCore's `take` over a queue that threads of the same process put commands on."""

    def take(timeout: float | None) -> list:
        taken = []
        try:
            taken.append(commands.get(timeout=timeout))
            while True:
                taken.append(commands.get_nowait())
        except queue.Empty:
            return taken

    return take


class EngineCore:
    """See the module docstring. `take(timeout)` returns the commands queued now, waiting up to `timeout`
    seconds for the first (None: until one comes); `emit(event)` sends an event; `gate(steps_done, engine)`
    (test-only, core_process.StepGate) may hold the core between steps."""

    def __init__(self, engine, take: Callable[[float | None], list], emit: Callable[[Any], None], gate=None):
        self.engine, self.take, self.emit, self.gate = engine, take, emit, gate
        self.steps = 0
        self.live: set[str] = set()  # added and not finished: what AbortAll aborts
        self.held = HeldCommands(lambda c: isinstance(c, Admin))

    def _gate_allows(self) -> bool:
        return self.gate is None or self.gate(self.steps, self.engine)

    def run(self) -> None:
        """Serve until `Shutdown`; raises EngineCoreError after emitting `Failed`."""
        engine = self.engine
        while True:
            self.held.release(lambda: not engine.has_unfinished_requests(), self._apply_now)
            if not engine.has_unfinished_requests():  # block for commands only while there is nothing to step
                commands = self.take(None)
            else:  # a core held by the test gate polls: it still serves aborts and Shutdown meanwhile
                commands = self.take(0 if self._gate_allows() else 0.01)
            for cmd in commands:
                if isinstance(cmd, Shutdown):
                    return
                self._apply(cmd)
            if engine.has_unfinished_requests() and self._gate_allows():
                self._step()
            elif commands:
                self.emit(Stats(stats_dict(engine.stats())))

    def _apply(self, cmd: Any) -> None:
        if isinstance(cmd, (AddRequests, Admin)) and self.held.offer(cmd):
            return  # behind an admin operation waiting for the requests in flight to finish
        if isinstance(cmd, (Abort, AbortAll)) and self.held:
            # Now for requests already running (a load must not wait for a request nobody reads), and again
            # after the held adds (the front end may abort a request whose add is still held here).
            self.held.offer(cmd)
        self._apply_now(cmd)

    def _apply_now(self, cmd: Any) -> None:
        if isinstance(cmd, AddRequests):
            self._add(cmd)
        elif isinstance(cmd, (Abort, AbortAll)):
            for request_id in cmd.request_ids if isinstance(cmd, Abort) else tuple(self.live):
                self._abort(request_id)
        elif isinstance(cmd, Admin):
            self._reply(cmd.token, f"admin operation {cmd.op}", lambda: run_admin(self.engine, cmd.op, cmd.arg))
            self.emit(Stats(stats_dict(self.engine.stats())))
        elif isinstance(cmd, Call):
            self._reply(cmd.token, cmd.method, getattr(self.engine, cmd.method))
        else:
            raise ValueError(f"engine core: unknown command {cmd!r}")

    def _reply(self, token: int, what: str, fn: Callable[[], Any]) -> None:
        try:
            result, err = fn(), None
        except Exception as e:
            if not isinstance(e, (ValueError, TypeError)):
                log.error("%s failed:\n%s", what, traceback.format_exc())
            result, err = None, error_of(e)
        self.emit(Reply(token, result, err))

    def _abort(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        except Exception:
            log.exception("abort_request(%s) failed", request_id)

    def _add(self, cmd: AddRequests) -> None:
        added: list[str] = []
        try:
            for request_id, prompt, params in cmd.requests:
                self.engine.add_request(request_id, prompt, params)
                added.append(request_id)
        except Exception as e:
            for request_id in added:  # all or none: their abort outputs go to no stream
                self._abort(request_id)
            if not isinstance(e, (ValueError, TypeError)):
                log.error("adding request %s failed:\n%s", cmd.requests[len(added)][0], traceback.format_exc())
            self.emit(Added(cmd.token, error_of(e)))
            return
        self.live.update(added)
        self.emit(Added(cmd.token, None))

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:
            # The engine isolates failures it can pin on one request; a step that still raises failed as a
            # whole and the engine's state is unknown: report it and stop rather than serve wrong numbers.
            log.error("engine step failed; the engine core stops:\n%s", traceback.format_exc())
            self.emit(Failed(repr(e)))
            raise EngineCoreError(repr(e)) from e
        self.steps += 1
        self.live.difference_update(o.request_id for o in outputs if o.finished)
        self.emit(StepDone(time.perf_counter() - t0, stats_dict(self.engine.stats()), tuple(outputs)))
