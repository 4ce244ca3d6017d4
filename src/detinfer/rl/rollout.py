"""One GRPO step's samples and the pieces around them: the per-request sampling seed, the `Rollout` record, the
reward functions' keyword arguments, and the Ctrl-C deferral that keeps a step's update whole (grpo.py)."""

from __future__ import annotations

import contextlib
import hashlib
import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from detinfer.engine.config import MAX_SEED
from detinfer.rl.rewards import RewardScores
from detinfer.rl.tasks import Example


def request_seed(seed: int, step: int, prompt_index: int) -> int:
    """The sampling seed of one prompt's request at one step; sample i of it draws from (this seed,
    position, i) in the engine's sampler, so every draw is a pure function of (seed, step, prompt, sample)."""
    digest = hashlib.sha256(f"detinfer-rl/sample/{seed}/{step}/{prompt_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & MAX_SEED


@dataclass
class Rollout:
    """One step's samples, flattened prompt-major (prompt i's samples at i * n .. i * n + n - 1)."""

    examples: list[Example]
    prompt_ids: list[list[int]]       # per sample (repeated within a group)
    completion_ids: list[list[int]]
    texts: list[str]
    sampler_logprobs: list[list[float]]
    rewards: list[float]
    truncated: list[bool] = field(default_factory=list)   # stopped by max_tokens
    scores: RewardScores | None = None


@contextlib.contextmanager
def ctrl_c_deferred():
    """Ctrl-C (SIGINT) arriving inside the block takes effect when it ends, so that state which must change
    together (a step's weights, optimizer state and step count) is never left half-changed, and a checkpoint
    saved after the interrupt holds whole steps. Only in the main thread (signals go only there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pending.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if pending:
            if callable(previous):
                previous(signal.SIGINT, pending[0])  # Python's default handler raises KeyboardInterrupt
            elif previous != signal.SIG_IGN:
                raise KeyboardInterrupt


def reward_batch(examples: Sequence[Example], texts: Sequence[str], ids: Sequence[Sequence[int]]) -> dict:
    """The keyword arguments a reward function gets (see rl/rewards.py), one entry per sample."""
    columns = sorted({k for ex in examples for k in ex.meta})
    base = {"prompts": [ex.prompt for ex in examples], "completions": list(texts),
            "answers": [ex.answer for ex in examples], "completion_ids": [list(x) for x in ids],
            "examples": list(examples)}
    return {**{c: [ex.meta.get(c) for ex in examples] for c in columns if c not in base}, **base}
