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
from detinfer.engine.core_process import CoreSpec, EngineCoreError, start_core
from detinfer.engine.outputs import RequestOutput

_ERRORS = {"ValueError": ValueError, "TypeError": TypeError}


def raise_remote(err: tuple[str, str], other_prefix: str) -> None:
    kind, message = err
    if kind in _ERRORS:
        raise _ERRORS[kind](message)
    raise RuntimeError(f"{other_prefix}: {message}")


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
        self._inbox: collections.deque = collections.deque()  # step messages read while waiting for a reply
        self._tokens = itertools.count()
        self._stats: dict[str, float] = {}
        self.error: EngineCoreError | None = None

    # -- transport -------------------------------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        self._check_alive()
        try:
            wire.send(self.core.sock, message)
        except OSError:
            self._died()

    def _recv(self) -> tuple:
        self._check_alive()
        try:
            msg = wire.recv(self.core.sock)
        except (EOFError, OSError):
            self._died()
        if msg[0] == "failed":
            self._died(f"an engine step failed: {msg[1]}")
        return msg

    def _check_alive(self) -> None:
        if self.error is not None:
            raise self.error

    def _died(self, why: str | None = None) -> None:
        how = self.core.exit_description()
        self.error = EngineCoreError(f"the engine core process (pid {self.core.pid}) stopped: "
                                     f"{why or how}; its requests are lost")
        self._unfinished.clear()
        raise self.error

    def _wait_for(self, tag: str, token: int) -> tuple:
        while True:
            msg = self._recv()
            if msg[0] == tag and msg[1] == token:
                return msg
            self._inbox.append(msg)

    # -- LLMEngine's interface -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params=None) -> None:
        self.add_requests([(request_id, prompt, params)])

    def add_requests(self, requests: list[tuple[str, Any, Any]]) -> None:
        """Add these together: all are accepted, or none is (the engine's ValueError/TypeError is raised)."""
        from detinfer.engine.sampling_params import SamplingParams

        token = next(self._tokens)
        batch = tuple((rid, wire.encode_prompt(prompt), SamplingParams() if params is None else params)
                      for rid, prompt, params in requests)
        self._send(("add", token, batch))
        err = self._wait_for("added", token)[2]
        if err is not None:
            raise_remote(err, "the engine core could not add the request")
        self._unfinished.update(rid for rid, _, _ in requests)

    def abort_request(self, request_id: str) -> None:
        if self.error is None and request_id in self._unfinished:
            self._send(("abort", (request_id,)))

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    def get_num_unfinished_requests(self) -> int:
        return len(self._unfinished)

    def step(self) -> list[RequestOutput]:
        """The outputs of the core's next step (waits for it); [] when nothing is unfinished."""
        while self._unfinished:
            msg = self._inbox.popleft() if self._inbox else self._recv()
            if msg[0] == "stats":
                self._stats = msg[1]
            elif msg[0] == "step":
                self._stats = msg[2]
                return self._outputs(msg[3])
        return []

    def _outputs(self, deltas: list) -> list[RequestOutput]:
        outs = []
        for delta in deltas:
            out = self._assembler.apply(delta)
            if out is None:
                continue
            if out.finished:
                self._unfinished.discard(out.request_id)
            outs.append(out)
        return outs

    def reset_prefix_cache(self) -> int:
        return self._call("reset_prefix_cache")

    def stats(self) -> dict[str, float]:
        """The latest engine stats the core sent (as a dict of numbers)."""
        return dict(self._stats)

    def _call(self, method: str) -> Any:
        token = next(self._tokens)
        self._send(("call", token, method))
        _, _, result, err = self._wait_for("reply", token)
        if err is not None:
            raise _ERRORS.get(err[0], RuntimeError)(err[1])
        return result

    def close(self) -> None:
        """Stop the core process (idempotent)."""
        self.core.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
