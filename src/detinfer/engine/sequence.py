"""Per-sequence state shared by the scheduler, the block manager and the engine (pure Python).

A request with `SamplingParams.n = n` becomes n `Sequence`s with the same `request_id` and
`sample_index` 0..n-1. Each is scheduled on its own; they share the prompt's KV through the prefix cache:
the scheduler admits samples 1..n-1 only once sample 0 has computed (and so cached) the prompt's full
blocks. Sample i draws from its own random stream (seed, t, i), so the n outputs are distinct and each is
reproducible on its own. Prompt logprobs are computed once per request, by sample 0.

Token bookkeeping: `token_ids` is prompt + output so far. `num_computed_tokens` counts the leading tokens
whose K/V are in the cache (computed by this sequence or reused from the prefix cache). The last sampled
token is never computed until it is fed in the next step, so a decoding sequence has exactly one
uncomputed token.

Pending tokens (overlapped scheduling): the engine may schedule a sequence's next step before the token
its current step samples has come back from the device. That token is appended as `PENDING_TOKEN` (the
device knows its value; the host does not yet) and filled in by `resolve_token`. Pending tokens are always
the last ones, at most two at a time, never hashed into the prefix cache and never shown in outputs.
"""

from __future__ import annotations

import enum
from typing import Any

from detinfer import admission
from detinfer.engine.sampling_params import SamplingParams

FINISH_STOP = "stop"      # EOS, a stop token id or a stop string
FINISH_LENGTH = "length"  # max_tokens or max_model_len reached
FINISH_ABORT = "abort"    # aborted by the caller


PENDING_TOKEN = -1  # a sampled token still on the device (never a valid id: ids are >= 0)


def check_prompt_ids(request_id: str, prompt, vocab_size: int | None, max_model_len: int) -> list[int]:
    """The prompt's token ids as a list of ints, or a TypeError/ValueError naming the request and the problem:
    the one admission check (`detinfer.admission.check_prompt`) with the engine's own prefix."""
    if isinstance(prompt, (str, bytes, dict)) or not hasattr(prompt, "__iter__"):
        raise TypeError(f"request {request_id!r}: prompt must be a str or a list of token ids, "
                        f"got {type(prompt).__name__}")
    try:
        return admission.check_prompt("prompt_token_ids", prompt, vocab_size, max_model_len)
    except (TypeError, ValueError) as e:
        raise (TypeError if isinstance(e, TypeError) else ValueError)(f"request {request_id!r}: {e}") from None


class SequenceStatus(enum.Enum):
    WAITING = "waiting"    # queued: holds no KV blocks (new, or preempted and to be recomputed)
    RUNNING = "running"    # holds KV blocks; prefilling or decoding
    FINISHED = "finished"  # done (see finish_reason); holds no KV blocks


class Sequence:
    """One sample of one request: its tokens, KV-cache state, and the outputs the engine collects."""

    def __init__(self, seq_id: int, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 seed: int | None, sample_index: int = 0, arrival_index: int = 0):
        self.seq_id = seq_id
        self.request_id = request_id
        self.sample_index = sample_index
        self.arrival_index = arrival_index  # order of add_request calls: FCFS key
        self.params = params
        # Seed of the random stream (params.seed, or one drawn at add time); None for greedy requests.
        self.seed = seed
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        # What stopped it: the stop token id, or whatever the engine's stop checker returned (its string).
        self.stop_reason: int | str | None = None

        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.num_pending_tokens = 0  # trailing PENDING_TOKEN entries of token_ids
        # Physical KV block ids, one per block_size positions; empty unless RUNNING.
        self.block_table: list[int] = []
        # Prefix-cache hash of each full block of token_ids (content only, so it survives preemption).
        self.block_hashes: list[bytes] = []
        # Leading blocks of block_table already offered to the prefix cache.
        self.num_hashed_blocks = 0
        self.num_cached_tokens = 0  # prompt tokens reused from the prefix cache at the last admission
        self.num_preemptions = 0
        # Prompt positions whose logits were already delivered for prompt logprobs (survives preemption,
        # so a recomputed prompt does not deliver them twice).
        self.num_prompt_logits_done = 0

        # Filled by the engine (the scheduler never reads them).
        self.output_logprobs: list[Any] = []
        self.prompt_logprobs: list[Any] = []

    # -- token views ---------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_known_tokens(self) -> int:
        """Leading tokens whose ids the host knows (all but the pending ones)."""
        return len(self.token_ids) - self.num_pending_tokens

    @property
    def known_output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:self.num_known_tokens]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    # -- state ---------------------------------------------------------------------------------------
    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs are a per-request output, computed by sample 0 only."""
        return self.sample_index == 0 and self.params.prompt_logprobs is not None

    @property
    def prompt_logprobs_pending(self) -> bool:
        """True while some prompt position's logits are still owed to the engine. Such a sequence must
        compute every prompt token itself, so it takes nothing from the prefix cache."""
        return self.wants_prompt_logprobs and self.num_prompt_logits_done < self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def append_pending(self) -> None:
        """A token was sampled on the device; its id comes later (`resolve_token`)."""
        self.token_ids.append(PENDING_TOKEN)
        self.num_pending_tokens += 1

    def resolve_token(self, output_position: int, token_id: int) -> None:
        """Fill in the pending token at `output_position` (always the first pending one)."""
        i = self.num_prompt_tokens + output_position
        if i != self.num_known_tokens or self.token_ids[i] != PENDING_TOKEN:
            raise RuntimeError(f"resolve_token: output position {output_position} of sequence {self.seq_id} "
                               f"is not its first pending token ({self.num_known_tokens - self.num_prompt_tokens}"
                               f" outputs known, {self.num_pending_tokens} pending)")
        self.token_ids[i] = token_id
        self.num_pending_tokens -= 1

    def drop_pending(self) -> None:
        """Forget pending tokens (the sequence finished: whatever its in-flight steps sample is discarded)."""
        if self.num_pending_tokens:
            del self.token_ids[-self.num_pending_tokens:]
            self.num_pending_tokens = 0

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, request={self.request_id!r}, sample={self.sample_index}, "
                f"status={self.status.value}, tokens={self.num_tokens} (prompt {self.num_prompt_tokens}), "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")
