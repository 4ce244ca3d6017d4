"""Continuous-batching scheduler (pure Python, no torch).

One engine step is: `batch = scheduler.schedule()`; the model runner computes `batch`; the sampler draws
a token for every entry with `sample=True`; `scheduler.postprocess(batch, tokens)`.

`schedule()` fills a token budget (`max_num_batched_tokens`) with, in this order:
1. decodes: every running sequence with one uncomputed token, oldest first (1 token each). If its next
   position needs a new KV block and none is free, the NEWEST running sequence is preempted (its blocks
   freed, it goes to the front of the waiting queue keeping its generated tokens; on resume its prompt +
   generated tokens are prefilled again, mostly from the prefix cache) until the block can be had;
2. running prefills continue (chunks of what is left, oldest first);
3. waiting sequences are admitted first-come-first-served (never after a preemption in the same step):
   blocks for all their tokens are allocated at admission, reusing cached prefix blocks, and their first
   chunk is scheduled. Admission stops at the first sequence that does not fit.
With chunked prefill a prefill takes whatever budget is left; without it a prefill runs whole or waits.

Requests that could never run are refused at `add_request` (a prompt with no room for an output token
within max_model_len, `admission.longest_prompt`, or more KV blocks needed than the whole pool), so the queue
can never hang on them. `add_request` is the one place
a prompt's token ids are validated and a sampled request's seed is drawn (when it gives none).

After a step is launched, `advance(batch)` records its chunks as computed and gives every sampled
sequence a pending token (its id is still on the device); `resolve(batch, tokens, text_stop)` fills
those ids in once they are read back and decides every finish. `postprocess` is both at once. With
overlapped scheduling the engine calls `schedule()` for the next step between the two: a sequence with a
pending token is then scheduled as a decode of that token (the device feeds it), unless the token ends it
by length whatever its id (max_tokens, max_model_len), which the host knows without the id. A sequence
that `resolve` finishes (stop token, EOS, stop string) may so have one more step in flight: that step
writes K/V only into the sequence's own blocks (the correct K/V of its real last token) and its token is
discarded.

`resolve` decides every finish, in one place (`_finish_reason`): stop token / EOS, stop string, length.
Stop strings are text, which the scheduler does not have: it asks the caller's `text_stop(seq, token)`
(the engine detokenizes the token there) for each token that does not end its sequence by itself.
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property

from detinfer.cache.layout import StepLayout, slot_mapping
from detinfer.engine.block_manager import BlockManager
from detinfer.engine.config import EngineConfig, check_int
from detinfer.engine.sampling_params import SamplingParams
from detinfer.engine.sequence import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    Sequence,
    SequenceStatus,
    check_prompt_ids,
)

# (sequence, its sampled token) -> a stop string the token completes in the sequence's text, True for a stop
# without a string, or None: the engine's detokenizer (and grammar) check, asked by `Scheduler.resolve`.
TextStop = Callable[[Sequence, int], "str | bool | None"]


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's share of a step: feed `token_ids` at positions start_pos, start_pos + 1, ...

    num_logits: how many trailing positions of the chunk need logits (0: none; 1: the last; more: prompt
    logprobs, where the logits at position p score prompt token p + 1).
    sample: the chunk ends at the sequence's last token, so the logits of its last position are sampled
    to produce the next token, output token number `output_position` (the sampler's t).
    block_table: the sequence's physical KV blocks, covering at least positions [0, start_pos + query_len).
    """

    seq: Sequence
    token_ids: tuple[int, ...]
    start_pos: int
    num_logits: int
    sample: bool
    output_position: int
    block_table: tuple[int, ...]
    block_size: int

    @property
    def query_len(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Positions attended to by the chunk's last token (cached + this chunk)."""
        return self.start_pos + len(self.token_ids)

    @property
    def positions(self) -> range:
        return range(self.start_pos, self.context_len)

    @property
    def logits_positions(self) -> range:
        return range(self.context_len - self.num_logits, self.context_len)

    @property
    def is_decode(self) -> bool:
        """One new token after sampled output: the shape of a decode (also the last step of a resume)."""
        return self.query_len == 1 and self.output_position > 0

    def slot_mapping(self) -> list[int]:
        """Flat KV slot (block_id * block_size + offset) each fed token's K/V is written to."""
        return slot_mapping(self.block_table, self.start_pos, self.query_len, self.block_size)


@dataclass(frozen=True)
class ScheduledBatch:
    """What one step computes: decodes first, then prefill chunks (see module docstring)."""

    scheduled: tuple[ScheduledSequence, ...]
    num_batched_tokens: int
    preempted: tuple[Sequence, ...] = ()  # sequences preempted while building this batch

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def __len__(self) -> int:
        return len(self.scheduled)

    @cached_property
    def layout(self) -> StepLayout:
        """The step's packed layout: token rows, KV slots, and where each sequence's logits rows are (the
        model runner and the engine's sampling both read it; computed once per batch)."""
        items = self.scheduled
        return StepLayout.build([s.block_table for s in items], [s.start_pos for s in items],
                                [s.query_len for s in items], items[0].block_size if items else 1,
                                token_ids=[s.token_ids for s in items], num_logits=[s.num_logits for s in items],
                                names=[s.seq.seq_id for s in items])


class Scheduler:
    """Owns the waiting queue, the running set and the block manager."""

    def __init__(self, config: EngineConfig, *, num_kv_blocks: int | None = None,
                 eos_token_ids: Iterable[int] = (), vocab_size: int | None = None):
        if config.max_model_len is None:
            raise ValueError("Scheduler needs config.max_model_len resolved (e.g. from the model's "
                             "config) — got None")
        num_kv_blocks = config.num_kv_blocks if num_kv_blocks is None else num_kv_blocks
        if num_kv_blocks is None:
            raise ValueError("Scheduler needs the KV pool size: set config.num_kv_blocks "
                             "or pass num_kv_blocks")
        check_int("num_kv_blocks", num_kv_blocks, minimum=1)
        self.config = config
        self.block_manager = BlockManager(num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size  # prompt token ids must be below it (when given)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last one is preempted first
        self._requests: dict[str, list[Sequence]] = {}  # unfinished requests -> their sequences
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        # Draws seeds for sampled requests that give none; seeded from the config, so replayable.
        self._seed_rng = random.Random(config.seed) if config.seed is not None else random.SystemRandom()

    # -- requests ------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Iterable[int],
                    params: SamplingParams | None = None) -> list[Sequence]:
        """Queue a request; returns its n sequences (sample 0..n-1). Raises ValueError if it can never run."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        max_len = self.config.max_model_len
        prompt = check_prompt_ids(request_id, prompt_token_ids, self.vocab_size, max_len)
        # Most tokens an unfinished sequence can hold (it finishes on reaching max_tokens outputs or
        # max_model_len tokens), i.e. the most its blocks must cover when it is (re)admitted.
        longest = max_len - 1 if params.max_tokens is None else len(prompt) + params.max_tokens - 1
        longest = max(len(prompt), min(longest, max_len - 1))
        bm = self.block_manager
        if bm.blocks_for_tokens(longest) > bm.num_blocks:
            raise ValueError(f"request {request_id!r}: up to {longest} tokens need "
                             f"{bm.blocks_for_tokens(longest)} KV blocks of {bm.block_size}, but the pool "
                             f"has only {bm.num_blocks}; lower max_tokens or enlarge the KV cache")
        seed = params.seed
        if seed is None and not params.is_greedy:
            seed = self._seed_rng.getrandbits(63)
        arrival = next(self._arrivals)
        seqs = [Sequence(next(self._seq_ids), request_id, prompt, params, seed, sample_index=i,
                         arrival_index=arrival) for i in range(params.n)]
        self._requests[request_id] = seqs
        self.waiting.extend(seqs)
        return seqs

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every unfinished sequence of the request (reason "abort"), freeing its blocks.

        Returns the sequences aborted; an unknown or already finished request is a no-op.
        """
        aborted = [s for s in self._requests.get(request_id, ()) if not s.is_finished]
        for seq in aborted:
            self._finish(seq, FINISH_ABORT)
        return aborted

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- scheduling ----------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        decodes: list[ScheduledSequence] = []
        prefills: list[ScheduledSequence] = []
        preempted: list[Sequence] = []

        # 1. Decodes (and any running sequence with one token left), oldest first.
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed_tokens != 1:
                continue  # preempted earlier in this loop, or still prefilling
            if seq.num_pending_tokens and self._ends_by_length(seq, seq.num_output_tokens):
                continue  # its pending token finishes it whatever the id: nothing more to compute
            while not self.block_manager.can_append(seq):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.block_manager.append_slots(seq)
            decodes.append(self._chunk(seq, 1))
            budget -= 1

        # 2. Running prefills continue, oldest first.
        for seq in self.running:
            if budget <= 0:
                break
            remaining = seq.num_uncomputed_tokens
            if remaining > 1:
                if remaining > budget and not self.config.enable_chunked_prefill:
                    break
                n = min(remaining, budget)
                prefills.append(self._chunk(seq, n))
                budget -= n

        # 3. Admit waiting sequences, first come first served.
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            if self._waits_for_sibling_prefix(seq) or not self.block_manager.can_allocate(seq):
                break
            remaining = seq.num_tokens - self.block_manager.cached_prefix_tokens(seq)
            if remaining > budget and not self.config.enable_chunked_prefill:
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            prefills.append(self._chunk(seq, n))
            budget -= n

        scheduled = tuple(decodes + prefills)
        return ScheduledBatch(scheduled, sum(s.query_len for s in scheduled), tuple(preempted))

    def _waits_for_sibling_prefix(self, seq: Sequence) -> bool:
        """Samples 1..n-1 wait until sample 0 has computed the prompt, so they reuse its cached blocks
        instead of computing the same prompt n times."""
        if seq.sample_index == 0 or not self.config.enable_prefix_caching:
            return False
        if seq.num_prompt_tokens <= self.block_manager.block_size:
            return False  # no full block to share
        leader = self._requests[seq.request_id][0]
        return not leader.is_finished and (leader.status is SequenceStatus.WAITING
                                           or leader.num_computed_tokens < leader.num_prompt_tokens)

    def _chunk(self, seq: Sequence, n: int) -> ScheduledSequence:
        start = seq.num_computed_tokens
        end = start + n
        sample = end == seq.num_tokens
        num_logits = 1 if sample else 0
        if seq.prompt_logprobs_pending:
            # Logits for every prompt position not delivered yet (a resumed sequence skips the rest).
            num_logits = max(num_logits, end - max(start, seq.num_prompt_logits_done))
        return ScheduledSequence(seq, tuple(seq.token_ids[start:end]), start, num_logits, sample,
                                 seq.num_output_tokens, tuple(seq.block_table), self.block_manager.block_size)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    # -- after the step ------------------------------------------------------------------------------
    def postprocess(self, batch: ScheduledBatch, sampled_token_ids: Iterable[int | None],
                    text_stop: TextStop | None = None) -> list[Sequence]:
        """Record a computed step whose sampled ids are known: `advance` then `resolve`."""
        tokens = list(sampled_token_ids)
        self._check_tokens(batch, tokens)
        self.advance(batch)
        return self.resolve(batch, tokens, text_stop)

    def advance(self, batch: ScheduledBatch) -> None:
        """Record that `batch` was launched: its chunks count as computed (the device computes them before
        any later step, in stream order) and each sampled sequence gains a pending token."""
        for item in batch.scheduled:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted between schedule() and now
            if seq.num_computed_tokens != item.start_pos:
                raise RuntimeError(f"advance: sequence {seq.seq_id} is at {seq.num_computed_tokens} "
                                   f"computed tokens, the batch was built at {item.start_pos}")
            seq.num_computed_tokens += item.query_len
            if seq.wants_prompt_logprobs:
                seq.num_prompt_logits_done = max(seq.num_prompt_logits_done,
                                                 min(seq.num_computed_tokens, seq.num_prompt_tokens))
            if item.sample:
                seq.append_pending()
            self.block_manager.commit_computed(seq)

    def resolve(self, batch: ScheduledBatch, sampled_token_ids: Iterable[int | None],
                text_stop: TextStop | None = None) -> list[Sequence]:
        """Fill in the ids `advance(batch)` left pending and decide finishes (`_finish_reason`).
        `sampled_token_ids[i]` is the token sampled for `batch.scheduled[i]` (an int where `sample` is True,
        None elsewhere). Sequences finished since (aborted, or finished by an earlier step's token) are
        skipped: their token is discarded. A sequence preempted since still gets its token, and may finish
        while waiting. Returns the sequences that finished."""
        tokens = list(sampled_token_ids)
        self._check_tokens(batch, tokens)
        finished: list[Sequence] = []
        for item, token in zip(batch.scheduled, tokens, strict=True):
            seq = item.seq
            if not item.sample or seq.is_finished:
                continue
            seq.resolve_token(item.output_position, token)
            reason = self._finish_reason(seq, token, item.output_position + 1, text_stop)
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        for item in batch.scheduled:
            if item.seq.status is SequenceStatus.RUNNING:
                self.block_manager.commit_computed(item.seq)  # blocks completed by the ids just filled in
        return finished

    @staticmethod
    def _check_tokens(batch: ScheduledBatch, tokens: list) -> None:
        if len(tokens) != len(batch.scheduled):
            raise ValueError(f"postprocess: got {len(tokens)} sampled tokens for a batch of "
                             f"{len(batch.scheduled)} sequences")
        for item, token in zip(batch.scheduled, tokens):
            if item.sample:
                check_int(f"postprocess: sampled token of sequence {item.seq.seq_id}", token, minimum=0)
            elif token is not None:
                raise ValueError(f"postprocess: sequence {item.seq.seq_id} was not sampled this step, "
                                 f"so its token must be None, got {token!r}")

    def _ends_by_length(self, seq: Sequence, num_outputs: int) -> bool:
        """Whether a sequence with `num_outputs` output tokens is done by length (max_tokens, max_model_len)."""
        max_tokens = seq.params.max_tokens
        return ((max_tokens is not None and num_outputs >= max_tokens)
                or seq.num_prompt_tokens + num_outputs >= self.config.max_model_len)

    def _finish_reason(self, seq: Sequence, token: int, num_outputs: int, text_stop: TextStop | None
                       ) -> str | None:
        """The one stop decision: why `seq` ends with `token`, its output number `num_outputs` (later
        pending ones not counted), or None. A stop token id, or EOS unless ignored, ends it by itself: its
        text is never shown, so `text_stop` is not asked. Otherwise `text_stop(seq, token)` (the engine
        detokenizes the token there) reports a stop string (recorded as the stop_reason) or True (a stop
        without one: a complete grammar). Then length."""
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            seq.stop_reason = token
            return FINISH_STOP
        stop = None if text_stop is None else text_stop(seq, token)
        if stop:
            seq.stop_reason = stop if isinstance(stop, str) else None
            return FINISH_STOP
        return FINISH_LENGTH if self._ends_by_length(seq, num_outputs) else None

    def _finish(self, seq: Sequence, reason: str) -> None:
        (self.running if seq.status is SequenceStatus.RUNNING else self.waiting).remove(seq)
        self.block_manager.free(seq)
        seq.drop_pending()
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seqs = self._requests.get(seq.request_id)
        if seqs is not None and all(s.is_finished for s in seqs):
            del self._requests[seq.request_id]

    # -- checks --------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the queues or the block pool are inconsistent (used by tests)."""
        def fail(msg: str):
            raise AssertionError(f"scheduler invariant violated: {msg}")

        for seq in self.waiting:
            if seq.status is not SequenceStatus.WAITING or seq.block_table or seq.num_computed_tokens:
                fail(f"waiting {seq!r} is not a clean waiting sequence")
        for seq in self.running:
            if seq.status is not SequenceStatus.RUNNING:
                fail(f"running {seq!r} has status {seq.status}")
            # Blocks cover every token except possibly the last sampled one (its slot comes at decode).
            if len(seq.block_table) * self.block_manager.block_size < seq.num_tokens - 1:
                fail(f"running {seq!r} lacks blocks for its tokens")
        ids = [s.seq_id for s in self.waiting] + [s.seq_id for s in self.running]
        if len(ids) != len(set(ids)):
            fail("a sequence is queued twice")
        if len(self.running) > self.config.max_num_seqs:
            fail(f"{len(self.running)} running sequences > max_num_seqs={self.config.max_num_seqs}")
        unfinished = {s.seq_id for seqs in self._requests.values() for s in seqs if not s.is_finished}
        if unfinished != set(ids):
            fail("the request table and the queues disagree on which sequences are unfinished")
        self.block_manager.check_invariants(self.running)
