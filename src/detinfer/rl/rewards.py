"""Reward functions: several per run, weighted, called on batches; a function that fails scores only the
samples it failed on.

A reward function takes one batch of completions as keyword arguments and returns one number per
completion:

    def my_reward(prompts, completions, answers, completion_ids, **columns) -> list[float]

`prompts`: each sample's prompt as given (text, chat messages or token ids); `completions`: the sampled
texts; `answers`: the reference answers (the dataset's answer column, or the generator's); `completion_ids`:
the sampled token ids; `columns`: every other dataset column, one list entry per sample (accept
`**kwargs` so new columns never break a function). From the CLI: `--reward-funcs math,format,pkg.mod:fn
--reward-weights 1,0.2,0.5`.

Built-ins (`BUILTIN_REWARDS`):
  task    the task's own reward (the default; a dataset's own reward is `math`)
  math    1 when the completion's numeric answer (\\boxed{}, ####, else the last number) equals the
          reference answer's, else 0 (non-numeric references: exact text match)
  exact   1 when the stripped completion equals the stripped reference, else 0
  format  1 when the completion marks its answer with \\boxed{} or ####, else 0

Failures. A call that raises, returns the wrong number of values, or returns a non-number is retried one
sample at a time, so only the samples it fails on are affected; a failed sample gets reward 0 from that
function (its other functions still count), is counted per step (`reward_failures`, and per function)
and the first error message is logged. Zero rather than NaN-masking keeps every group's advantages
defined (GRPO normalises within the group) and treats a completion the verifier cannot score as a wrong
one, which is what a verifier that crashes on garbage usually means.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from detinfer.rl.math_task import answers_match, has_answer_format

RewardFunc = Callable[..., Sequence[float]]
BUILTIN_REWARDS = ("task", "math", "exact", "format")
_IMPORT_NAME = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def parse_reward_config(funcs: str | None, weights: str | None) -> list[tuple[str, float]]:
    """--reward-funcs / --reward-weights -> [(name, weight)]; raises naming the bad entry. No imports here
    (the config validates without loading user modules)."""
    names = ["task"] if funcs is None else [n.strip() for n in funcs.split(",")]
    for n in names:
        if n not in BUILTIN_REWARDS and not _IMPORT_NAME.match(n):
            raise ValueError(f"reward_funcs: {n!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) nor "
                             "an importable module:function name")
    if len(set(names)) != len(names):
        raise ValueError(f"reward_funcs lists a function twice: {funcs!r}")
    if weights is None:
        return [(n, 1.0) for n in names]
    parts = [w.strip() for w in weights.split(",")]
    if len(parts) != len(names):
        raise ValueError(f"reward_weights must give one weight per reward function ({len(names)}: "
                         f"{', '.join(names)}), got {len(parts)}: {weights!r}")
    values = []
    for p in parts:
        try:
            w = float(p)
        except ValueError:
            w = float("nan")
        if not math.isfinite(w):
            raise ValueError(f"reward_weights must be finite numbers, got {p!r} in {weights!r}")
        values.append(w)
    return list(zip(names, values))


def _math_reward(completions, answers, **_: Any) -> list[float]:
    return [float(answers_match(c, a)) for c, a in zip(completions, answers)]


def _exact_reward(completions, answers, **_: Any) -> list[float]:
    return [float(a is not None and c.strip() == str(a).strip()) for c, a in zip(completions, answers)]


def _format_reward(completions, **_: Any) -> list[float]:
    return [float(has_answer_format(c)) for c in completions]


def task_reward(task) -> RewardFunc:
    """A Task's per-sample reward(example, text, ids) as a batch reward function."""
    def reward(completions, completion_ids, examples, **_: Any) -> list[float]:
        return [task.reward(ex, text, tuple(ids)) for ex, text, ids in zip(examples, completions, completion_ids)]
    reward.__name__ = f"task:{task.name}"
    return reward


_BUILTIN_FUNCS = {"math": _math_reward, "exact": _exact_reward, "format": _format_reward}


def resolve_reward(name: str, task) -> RewardFunc:
    """A reward function by name: a built-in, or `module:function` imported (errors name the problem)."""
    if name == "task":
        return task_reward(task)
    if name in _BUILTIN_FUNCS:
        return _BUILTIN_FUNCS[name]
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"reward function {name!r}: cannot import module {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward function {name!r}: module {module_name!r} has no callable {attr!r}")
    return fn


@dataclass
class RewardScores:
    """Weighted totals per sample, each function's raw scores (NaN where it failed), failures per function."""

    total: list[float]
    per_func: dict[str, list[float]]
    failures: dict[str, int] = field(default_factory=dict)
    first_error: str | None = None

    @property
    def failed_samples(self) -> int:
        """Samples at least one function failed on."""
        n = len(self.total)
        return sum(any(math.isnan(v[i]) for v in self.per_func.values()) for i in range(n))


class RewardModel:
    """The run's reward functions with their weights; `score(batch)` -> RewardScores."""

    def __init__(self, specs: Sequence[tuple[str, float]], task):
        self.specs = [(name, weight, resolve_reward(name, task)) for name, weight in specs]

    def score(self, batch: dict[str, list]) -> RewardScores:
        n = len(batch["completions"])
        total = [0.0] * n
        per_func, failures, first_error = {}, {}, None
        for name, weight, fn in self.specs:
            values, errors = _call_isolating_failures(fn, batch, n)
            per_func[name] = values
            failures[name] = sum(e is not None for e in errors)
            first_error = first_error or next((f"{name}: {e}" for e in errors if e is not None), None)
            for i, v in enumerate(values):
                if not math.isnan(v):
                    total[i] += weight * v
        return RewardScores(total, per_func, failures, first_error)


def _checked(values: Any, n: int) -> list[float]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) != n:
        got = len(values) if isinstance(values, Sequence) else type(values).__name__
        raise ValueError(f"returned {got} values for {n} completions (want a list of {n} numbers)")
    out = []
    for v in values:
        if isinstance(v, bool):
            v = float(v)
        if not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"returned {v!r}; rewards must be finite numbers")
        out.append(float(v))
    return out


def _call_isolating_failures(fn: RewardFunc, batch: dict[str, list], n: int):
    """fn on the whole batch; if that fails, on one sample at a time. -> (values, NaN where failed; error
    message per sample or None)."""
    try:
        return _checked(fn(**batch), n), [None] * n
    except Exception:  # noqa: BLE001 - a user's reward function may raise anything; isolate per sample
        pass
    values, errors = [], []
    for i in range(n):
        try:
            (v,) = _checked(fn(**{k: col[i:i + 1] for k, col in batch.items()}), 1)
            values.append(v)
            errors.append(None)
        except Exception as e:  # noqa: BLE001
            values.append(float("nan"))
            errors.append(f"{type(e).__name__}: {e}"[:300])
    return values, errors


def overlong_punishment(length: int, max_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment added to a sample's reward: 0 up to max_tokens - buffer tokens,
    then falling linearly to -penalty at max_tokens (buffer 0: off)."""
    over = length - (max_tokens - buffer)
    if buffer <= 0 or over <= 0:
        return 0.0
    return -penalty * min(over, buffer) / buffer
