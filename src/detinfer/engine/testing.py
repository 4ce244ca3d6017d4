"""Helpers for tests that drive an engine and compare what requests got, bit for bit.

`signature(out)` is everything a caller can observe about a finished request, with every float as its exact
hex string (so -0.0 vs 0.0 or one ULP differ); `drive(engine, requests)` runs the requests with
`engine.drive.drive` and returns their signatures; `mixed_requests` a seeded set of prompts, half greedy and
half sampled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from detinfer.engine.drive import Arrival as TimedRequest
from detinfer.engine.drive import drive as run_to_completion
from detinfer.engine.outputs import RequestOutput


def exact(x: float | None) -> str | None:
    return None if x is None else float(x).hex()


def _logprob(entry) -> tuple | None:
    if entry is None:
        return None
    return entry.token_id, exact(entry.logprob), entry.rank, tuple((t, exact(v)) for t, v in
                                                                 entry.top_logprobs.items())


class CompletionSignature(NamedTuple):
    index: int
    token_ids: tuple
    text: str | None
    finish_reason: str | None
    stop_reason: Any
    cumulative_logprob: str | None
    logprobs: tuple | None  # per token (id, logprob, rank, top-k), floats as hex


class Signature(NamedTuple):
    prompt_token_ids: tuple
    completions: tuple  # of CompletionSignature
    prompt_logprobs: tuple | None
    error: str | None


def signature(out: RequestOutput) -> Signature:
    """Everything a caller sees of a finished request (a tuple: equal signatures are equal bit for bit)."""
    comps = tuple(CompletionSignature(c.index, tuple(c.token_ids), c.text, c.finish_reason, c.stop_reason,
                                      exact(c.cumulative_logprob),
                                      None if c.logprobs is None else tuple(_logprob(e) for e in c.logprobs))
                  for c in out.outputs)
    prompt = None if out.prompt_logprobs is None else tuple(_logprob(e) for e in out.prompt_logprobs)
    return Signature(tuple(out.prompt_token_ids or ()), comps, prompt, out.error)


def mixed_requests(n: int = 5, *, vocab: int = 320, max_tokens: int = 5, seed: int = 11) -> list[TimedRequest]:
    """n requests arriving at step i, random prompts of 3-39 ids in [3, vocab), odd ones greedy and even ones
    sampled at temperature 0.8 with seed i; 2 top logprobs, EOS ignored (every request runs max_tokens)."""
    import torch

    from detinfer.engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(seed)
    reqs = []
    for i in range(n):
        prompt = torch.randint(3, vocab, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0 if i % 2 else 0.8, seed=i, logprobs=2,
                                ignore_eos=True)
        reqs.append((i, f"r{i}", prompt, params))
    return reqs


def drive(engine, requests: Sequence[TimedRequest], *, max_steps: int = 1000,
          signature_of: Callable[[RequestOutput], Any] = signature, **hooks: Any) -> dict[str, Any]:
    """`engine.drive.drive` (its `on_output` / `after_step` hooks) -> {request id: signature_of(final output)}."""
    finals = run_to_completion(engine, requests, max_steps=max_steps, **hooks)
    return {rid: signature_of(out) for rid, out in finals.items()}


class CoreStepGate:
    """The test side of `core_process.StepGate`: hold an engine core process between steps.

    Tests that must observe a state in the middle of a generation (requests started but unfinished) set
    `env` in the core's environment, then `hold_after(n)` / `allow_more(k)` and `wait_held(...)`, instead of
    sleeping and hoping generation is slow enough: the state is then the same on any machine.
    """

    def __init__(self, path):
        from pathlib import Path

        from detinfer.engine.core_process import STEP_GATE_ENV

        self.path = Path(path)
        self.held_path = Path(str(path) + ".held")
        self.env = {STEP_GATE_ENV: str(self.path)}

    def hold_after(self, steps: int) -> None:
        """The core runs at most `steps` steps in all (counted from its start), then waits."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(str(steps))
        tmp.replace(self.path)

    def release(self) -> None:
        self.path.unlink(missing_ok=True)
        self.held_path.unlink(missing_ok=True)

    def held(self) -> tuple[int, int] | None:
        """(steps done, unfinished requests) the core last reported while held, or None."""
        try:
            steps, unfinished = self.held_path.read_text().split()
        except (FileNotFoundError, ValueError):
            return None
        return int(steps), int(unfinished)

    def wait_held(self, *, steps: int | None = None, unfinished: int | None = None,
                  timeout: float = 120.0) -> tuple[int, int]:
        """Wait until the core reports being held (after `steps` steps, with `unfinished` requests)."""
        import time

        deadline = time.monotonic() + timeout  # only a guard against a hang, never part of the check
        while True:
            state = self.held()
            if state is not None and steps in (None, state[0]) and unfinished in (None, state[1]):
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine core was not held as expected: last report {state}")
            time.sleep(0.01)

    def allow_more(self, steps: int) -> None:
        """Let a held core run `steps` more steps."""
        state = self.held()
        if state is None:
            raise RuntimeError("allow_more: the core is not held")
        self.hold_after(state[0] + steps)
