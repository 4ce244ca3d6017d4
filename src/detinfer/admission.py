"""What a request's token ids and prompt length must satisfy: the one admission check (pure Python).

The server (400 naming the field), the engine's scheduler (ValueError naming the request) and the trainer
(ValueError) all call these functions and only add their own prefix, so they accept and refuse exactly the
same cases with the same text. It lives below every package because engine and train may not import each
other.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

INT64_TOKEN_BOUND = 1 << 63  # ids must fit int64 when no vocabulary is known


class PromptLengthError(ValueError):
    """A prompt-length refusal; `field` is what to blame: "prompt" (its own length) or "max_tokens"."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def check_token_ids(field: str, ids: Iterable[int], vocab_size: int | None = None) -> list[int]:
    """`ids` as a list of ints in [0, vocab_size); a TypeError/ValueError naming `field` and the first bad
    position otherwise. The common case (all ints in range) is checked at C speed (the trainer passes
    whole batches)."""
    ids = list(ids)
    bound = INT64_TOKEN_BOUND if vocab_size is None else vocab_size
    if all(type(t) is int for t in ids) and (not ids or (min(ids) >= 0 and max(ids) < bound)):
        return ids
    for i, t in enumerate(ids):
        try:
            if isinstance(t, bool):  # True is an int to Python, never a token id
                raise TypeError
            ids[i] = t = operator.index(t)
        except TypeError:
            raise TypeError(f"{field}: the token id at position {i} must be an int, got {t!r}") from None
        if not 0 <= t < bound:
            raise ValueError(f"{field}: token id {t} at position {i} is outside the vocabulary [0, {bound})")
    return ids


def longest_prompt(max_model_len: int) -> int:
    """max_model_len counts prompt and output tokens together, and a request needs room for at least one
    output token."""
    return max_model_len - 1


def check_prompt_length(num_tokens: int, max_model_len: int, max_tokens: int | None = None) -> None:
    """The one prompt-length rule. max_tokens: also refuse a prompt that leaves less room than it (the
    server's OpenAI contract; the engine instead finishes such a request at max_model_len, reason "length")."""
    if num_tokens == 0:
        raise PromptLengthError("the prompt is empty; at least one token is needed", "prompt")
    if num_tokens > longest_prompt(max_model_len):
        raise PromptLengthError(f"the prompt has {num_tokens} tokens; max_model_len={max_model_len} counts prompt "
                                f"and output tokens, so a prompt may have at most {longest_prompt(max_model_len)}",
                                "prompt")
    if max_tokens is not None and num_tokens + max_tokens > max_model_len:
        raise PromptLengthError(f"the prompt has {num_tokens} tokens and max_tokens is {max_tokens}, more than "
                                f"max_model_len={max_model_len} together", "max_tokens")


def check_prompt(field: str, ids: Iterable[int], vocab_size: int | None, max_model_len: int,
                 max_tokens: int | None = None) -> list[int]:
    """A prompt's ids checked (ids first, then length): the whole admission check of one prompt."""
    ids = check_token_ids(field, ids, vocab_size)
    check_prompt_length(len(ids), max_model_len, max_tokens)
    return ids
