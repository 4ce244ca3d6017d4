"""`EngineCoreClient`: `LLMEngine`'s interface (add_request, abort_request, step, has_unfinished_requests,
reset_prefix_cache, stats, tokenizer) over an engine core in its own process, for synchronous callers such as
`LLM(engine_process=True)`.

The core steps on its own; `step()` returns the outputs of the core's next step (waiting for it), so a caller
written against `LLMEngine` gets the same cumulative `RequestOutput`s, bit for bit, one step at a time.
Requests added together cost one round trip (`add_requests`). If the core dies, the call that notices raises
`EngineCoreError` naming how it ended, and the client then reports no unfinished requests, so cleanup loops
written for the in-process engine end instead of hanging.
"""

from __future__ import annotations

import collections
import itertools
from pathlib import Path
from typing import Any

from detinfer.engine import core_wire as wire
from detinfer.engine.core import Abort, Added, AddRequests, Call, Failed, Reply, Stats, StepDone, exception_of
from detinfer.engine.core_process import CoreSpec, EngineCoreError, start_core
from detinfer.engine.outputs import RequestOutput


class EngineCoreClient:
    """See the module docstring. Not thread-safe (one caller, like LLMEngine)."""

    def __init__(self, model_dir: str | Path, config=None, device=None, *, attention_backend: str = "auto"):
        from detinfer.engine.config import EngineConfig
        from detinfer.models.hub import resolve_model_path
        from detinfer.models.loader import load_tokenizer

        model_dir = resolve_model_path(model_dir)  # download here, once, not in the core
        self.core = start_core(CoreSpec(str(model_dir), EngineConfig() if config is None else config,
                                        None if device is None else str(device), attention_backend))
        self.config = self.core.info["config"]
        self.vocab_size = self.core.info["vocab_size"]
        try:
            self.tokenizer = load_tokenizer(model_dir)
        except BaseException:
            self.core.close()
            raise
        self._assembler = wire.OutputAssembler()
        self._unfinished: set[str] = set()
        self._inbox: collections.deque = collections.deque()  # events read while waiting for an answer
        self._tokens = itertools.count()
        self._stats: dict[str, float] = {}
        self.error: EngineCoreError | None = None

    # -- transport -------------------------------------------------------------------------------------
    def _send(self, command: Any) -> None:
        self._check_alive()
        try:
            wire.send(self.core.sock, wire.encode_prompts(command))
        except OSError:
            self._died()

    def _recv(self) -> Any:
        self._check_alive()
        try:
            event = wire.recv(self.core.sock)
        except (EOFError, OSError):
            self._died()
        if isinstance(event, Failed):
            self._died(f"an engine step failed: {event.message}")
        return event

    def _check_alive(self) -> None:
        if self.error is not None:
            raise self.error

    def _died(self, why: str | None = None) -> None:
        how = self.core.exit_description()
        self.error = EngineCoreError(f"the engine core process (pid {self.core.pid}) stopped: "
                                     f"{why or how}; its requests are lost")
        self._unfinished.clear()
        raise self.error

    def _answer(self, command: Any) -> Any:
        """Send `command` and wait for its answer (`Added` / `Reply`); the events before it wait for step()."""
        self._send(command)
        while True:
            event = self._recv()
            if isinstance(event, (Added, Reply)) and event.token == command.token:
                if event.error is not None:
                    raise exception_of(event.error)
                return event
            self._inbox.append(event)

    # -- LLMEngine's interface -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params=None) -> None:
        self.add_requests([(request_id, prompt, params)])

    def add_requests(self, requests: list[tuple[str, Any, Any]]) -> None:
        """Add these together: all are accepted, or none is (the engine's ValueError/TypeError is raised)."""
        from detinfer.engine.sampling_params import SamplingParams

        batch = tuple((rid, prompt, SamplingParams() if params is None else params) for rid, prompt, params in requests)
        self._answer(AddRequests(next(self._tokens), batch))
        self._unfinished.update(rid for rid, _, _ in requests)

    def abort_request(self, request_id: str) -> None:
        if self.error is None and request_id in self._unfinished:
            self._send(Abort((request_id,)))

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    def get_num_unfinished_requests(self) -> int:
        return len(self._unfinished)

    def step(self) -> list[RequestOutput]:
        """The outputs of the core's next step (waits for it); [] when nothing is unfinished."""
        while self._unfinished:
            event = self._inbox.popleft() if self._inbox else self._recv()
            if isinstance(event, (Stats, StepDone)):
                self._stats = event.stats
            if isinstance(event, StepDone):
                return self._outputs(event.outputs)
        return []

    def _outputs(self, deltas: tuple) -> list[RequestOutput]:
        outs = self._assembler.apply_step(deltas)
        self._unfinished.difference_update(out.request_id for out in outs if out.finished)
        return outs

    def reset_prefix_cache(self) -> int:
        return self._answer(Call(next(self._tokens), "reset_prefix_cache")).result

    def stats(self) -> dict[str, float]:
        """The latest engine stats the core sent (as a dict of numbers)."""
        return dict(self._stats)

    def close(self) -> None:
        """Stop the core process (idempotent)."""
        self.core.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
