"""Verifiable tasks: prompts generated from a seed, rewards computed by checking the completion.

A `Task` is two functions: `make_example(rng) -> Example` draws one problem from a `random.Random`,
and `reward(example, text, token_ids) -> float` scores one completion. Bring your own:

    from detinfer.rl import Task, Example
    def make(rng):
        a = rng.randint(0, 9)
        return Example(prompt=f"Say the number {a}.", answer=str(a))
    task = Task("say-number", make, lambda ex, text, ids: float(ex.answer in text))

A task may instead hold a fixed list of examples (`Task(..., make_example=None, examples=...)`, what
`detinfer.rl.data.dataset_task` builds from a JSONL / Parquet / Hugging Face dataset).

`Example.prompt` is a string (sent through the model's chat template when it has one and the task asks
for it, else encoded as is), a tuple of chat messages (through the chat template), or a tuple of token
ids (sent as is). Every built-in task needs no download.

Built-in tasks (`TASKS`):
  addition          "What is 47 + 18?"; reward 1 when the last integer in the reply is the sum
                    ("65", "47 + 18 = 65", "The answer is 65." all count)
  addition-partial  same prompts; 1 for the right sum, 0.2 for a wrong reply that is only an integer
                    (format credit: a denser signal for small models)
  reverse           reverse a list of 3-5 letters; reward = fraction of positions right
  sort              sort 3-5 numbers ascending; reward = fraction of positions right
  math              generated GSM8K-style word problems (rl/math_task.py); reward 1 when the answer
                    extracted from the completion (\\boxed{}, ####, else the last number) is right
  emit-token        for tiny test models: raw-text prompt, reward = fraction of completion tokens
                    equal to one target token (learnable in a few steps, e.g. by stories260k)
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from detinfer.rl.math_task import answers_match, word_problem

RewardFn = Callable[["Example", str, Sequence[int]], float]


@dataclass(frozen=True)
class Example:
    """One problem: the prompt (text or token ids), what a checker needs (answer, anything in meta)."""

    prompt: str | tuple[int, ...] | tuple[dict, ...]
    answer: Any = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Task:
    """name; make_example(rng) -> Example; reward(example, completion text, completion token ids) ->
    float. chat: wrap text prompts in the model's chat template (as a user message) when it has one."""

    name: str
    make_example: Callable[[random.Random], Example] | None
    reward: RewardFn
    chat: bool = True
    description: str = ""
    # A fixed set of examples (a dataset) instead of a generator: each epoch visits all of them once, in
    # a seeded order when `shuffle` (see examples_for_step).
    examples: tuple[Example, ...] | None = None
    shuffle: bool = True

    def __post_init__(self):
        if (self.make_example is None) == (self.examples is None):
            raise ValueError(f"task {self.name!r} needs exactly one of make_example (a generator) or examples")
        if self.examples is not None and not self.examples:
            raise ValueError(f"task {self.name!r}: the dataset has no examples")


_INT = re.compile(r"-?\d+")


def last_int(text: str) -> int | None:
    found = _INT.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


def _make_addition(rng: random.Random) -> Example:
    # One two-digit and one one-or-two-digit operand: hard enough that a 135M model is often wrong, easy
    # enough that it is sometimes right (GRPO needs groups with mixed rewards to learn anything).
    a, b = rng.randint(10, 99), rng.randint(1, 99)  # sums up to 198
    return Example(f"What is {a} + {b}? Reply with only the number.", a + b)


def _addition_reward(ex: Example, text: str, ids: Sequence[int]) -> float:
    return float(last_int(text) == ex.answer)


def _addition_partial_reward(ex: Example, text: str, ids: Sequence[int]) -> float:
    if last_int(text) == ex.answer:
        return 1.0
    return 0.2 if re.fullmatch(r"\s*-?\d+\.?\s*", text) else 0.0


def _list_items(text: str, n: int) -> list[str]:
    return re.findall(r"[A-Za-z0-9]+", text)[:n]


def _positional_reward(ex: Example, text: str, ids: Sequence[int]) -> float:
    want = ex.answer
    got = _list_items(text, len(want))
    return sum(g.lower() == w.lower() for g, w in zip(got, want)) / len(want)


def _make_reverse(rng: random.Random) -> Example:
    items = rng.sample("ABCDEFGHJKLMNPQRSTUVWXYZ", rng.randint(3, 5))
    return Example(f"Reverse this list: {' '.join(items)}. Reply with only the reversed list, separated by "
                   "spaces.", tuple(reversed(items)))


def _make_sort(rng: random.Random) -> Example:
    items = rng.sample(range(1, 100), rng.randint(3, 5))
    return Example(f"Sort these numbers from smallest to largest: {' '.join(map(str, items))}. Reply with "
                   "only the sorted numbers, separated by spaces.", tuple(str(x) for x in sorted(items)))


# emit-token: raw-text story openings; the reward counts one target word's tokens in the completion.
_OPENINGS = ("Once upon a time", "One day", "The little dog", "Lily and Tom", "There was a big tree",
             "The sun was", "A small bird", "Tim had a red ball")
EMIT_TARGET_WORD = " the"


def _make_emit(rng: random.Random) -> Example:
    return Example(rng.choice(_OPENINGS), EMIT_TARGET_WORD)


def _emit_reward(ex: Example, text: str, ids: Sequence[int]) -> float:
    # Counted on the text (whole-word occurrences per completion token) so the reward needs no tokenizer
    # handle: a completion made only of " the" scores 1.
    if not ids:
        return 0.0
    hits = len(re.findall(r"(?<![A-Za-z])the(?![A-Za-z])", text, flags=re.IGNORECASE))
    return min(1.0, hits / len(ids))


def _make_math(rng: random.Random) -> Example:
    prompt, answer = word_problem(rng)
    return Example(prompt, answer)


def _math_task_reward(ex: Example, text: str, ids: Sequence[int]) -> float:
    return float(answers_match(text, ex.answer))


TASKS: dict[str, Task] = {
    "addition": Task("addition", _make_addition, _addition_reward,
                     description="a + b (two-digit + one/two-digit); reward 1 for the exact sum"),
    "addition-partial": Task("addition-partial", _make_addition, _addition_partial_reward,
                             description="addition with 0.2 partial credit for replying with a number"),
    "reverse": Task("reverse", _make_reverse, _positional_reward,
                    description="reverse 3-5 letters; reward = fraction of positions right"),
    "sort": Task("sort", _make_sort, _positional_reward,
                 description="sort 3-5 numbers; reward = fraction of positions right"),
    "math": Task("math", _make_math, _math_task_reward,
                 description="generated GSM8K-style word problems; reward 1 when the extracted number is right"),
    "emit-token": Task("emit-token", _make_emit, _emit_reward, chat=False,
                       description="tiny models: reward = share of completion tokens that are the word 'the'"),
}


def get_task(task: str | Task) -> Task:
    if isinstance(task, Task):
        return task
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; built-in tasks: {', '.join(TASKS)} (or pass a Task)")
    return TASKS[task]


def examples_for_step(task: Task, seed: int, step: int, count: int) -> list[Example]:
    """The prompts of one step: a pure function of (seed, step), so a resumed run draws the same ones.

    A dataset task reads its examples in epochs: step t takes items t * count .. t * count + count - 1
    of the endless sequence epoch 0, epoch 1, ..., each epoch a permutation of the dataset seeded by
    (seed, epoch) (the file order without shuffle)."""
    if task.examples is None:
        rng = random.Random(f"detinfer-rl/prompts/{seed}/{step}")
        return [task.make_example(rng) for _ in range(count)]
    return [task.examples[i] for i in dataset_indices(len(task.examples), seed, step, count, task.shuffle)]


def epoch_order(size: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    order = list(range(size))
    if shuffle:
        random.Random(f"detinfer-rl/epoch/{seed}/{epoch}").shuffle(order)
    return order


def dataset_indices(size: int, seed: int, step: int, count: int, shuffle: bool = True) -> list[int]:
    """Dataset indices of one step's prompts (see examples_for_step)."""
    out, orders = [], {}
    for k in range(step * count, step * count + count):
        epoch = k // size
        if epoch not in orders:
            orders[epoch] = epoch_order(size, seed, epoch, shuffle)
        out.append(orders[epoch][k % size])
    return out


def epoch_of_step(task: Task, step: int, count: int) -> float | None:
    """Epochs of the dataset done after `step` steps (None for a generator task)."""
    return None if task.examples is None else step * count / len(task.examples)


def generated_eval_examples(task: Task, seed: int, size: int) -> list[Example]:
    """`size` eval problems of a generator task, from their own seeded stream (they may repeat a training
    problem by chance; a dataset holds its eval examples out instead)."""
    rng = random.Random(f"detinfer-rl/eval/{seed}")
    return [task.make_example(rng) for _ in range(size)]
