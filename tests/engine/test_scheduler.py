"""Scheduler: budgets, chunked prefill, preemption, abort, stop conditions, n > 1, prompt logprobs, and a
randomized state machine checking invariants, KV-cache contents and no block leaks (pure Python)."""

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from detinfer.engine.config import EngineConfig
from detinfer.engine.sampling_params import SamplingParams
from detinfer.engine.scheduler import Scheduler
from detinfer.engine.sequence import PENDING_TOKEN, SequenceStatus

EOS = 0


class FakeRunner:
    """Stands in for the model runner: checks each batch against the block manager and a fake KV cache
    that stores (token, position) per slot, so any wrong block table, slot or cache hit shows up."""

    def __init__(self, sched):
        self.sched = sched
        bm = sched.block_manager
        self.kv = [None] * (bm.num_blocks * bm.block_size)
        self.sampled_positions = {}  # seq_id -> output positions t sampled so far
        self.prompt_logit_positions = {}  # seq_id -> prompt positions whose logits were delivered
        self.device = {}  # (seq_id, position) -> token sampled on the "device", maybe still pending on the host

    def token(self, seq, p):
        """The token at position p as the device sees it (a pending id comes from what it sampled)."""
        t = seq.token_ids[p]
        return self.device[(seq.seq_id, p)] if t == PENDING_TOKEN else t

    def run(self, batch):
        bm, cfg = self.sched.block_manager, self.sched.config
        bs = bm.block_size
        assert batch.num_batched_tokens == sum(s.query_len for s in batch.scheduled)
        assert batch.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len(batch) <= cfg.max_num_seqs
        assert len({s.seq.seq_id for s in batch.scheduled}) == len(batch)
        for item in batch.scheduled:
            seq = item.seq
            assert seq.status is SequenceStatus.RUNNING and item.start_pos == seq.num_computed_tokens
            assert item.query_len >= 1 and list(item.token_ids) == seq.token_ids[item.start_pos:item.context_len]
            assert item.sample == (item.context_len == seq.num_tokens)
            assert 0 <= item.num_logits <= item.query_len and (item.num_logits >= 1 or not item.sample)
            for p in range(item.start_pos):  # the context's K/V must be there, computed or cache hit
                slot = item.block_table[p // bs] * bs + p % bs
                assert self.kv[slot] == (self.token(seq, p), p), f"bad KV for {seq!r} at position {p}"
            for p, slot in zip(item.positions, item.slot_mapping(), strict=True):
                block = slot // bs
                assert bm.ref_count(block) == 1 and not bm.is_cached(block), "write into a shared block"
                self.kv[slot] = (self.token(seq, p), p)
            assert item.output_position == seq.num_output_tokens
            if item.sample:
                self.sampled_positions.setdefault(seq.seq_id, []).append(item.output_position)
            for p in item.logits_positions:
                if p < seq.num_prompt_tokens - 1 and seq.wants_prompt_logprobs:
                    self.prompt_logit_positions.setdefault(seq.seq_id, []).append(p)


def make(num_blocks=64, block_size=4, budget=16, max_seqs=8, max_model_len=64, stop_checker=None, **kw):
    cfg = EngineConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, block_size=block_size,
                       num_kv_blocks=num_blocks, max_model_len=max_model_len, **kw)
    sched = Scheduler(cfg, eos_token_ids=[EOS])
    runner = FakeRunner(sched)
    runner.stop_checker = stop_checker  # (seq, token) -> stop string found with this token, as the engine's
    return sched, runner


def step(sched, runner, tokens=None, rng=None):
    """One engine step; `tokens` gives the sampled token for each sampled entry (default: rng or 7)."""
    batch = sched.schedule()
    runner.run(batch)
    it = iter(tokens or ())
    out = [(next(it, 7) if rng is None else rng.randrange(5)) if s.sample else None for s in batch.scheduled]
    finished = sched.postprocess(batch, out, runner.stop_checker)
    sched.check_invariants()
    return batch, finished


def drain(sched, runner, rng=None, max_steps=2000):
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        batch, _ = step(sched, runner, rng=rng)
        assert not batch.is_empty, "a step with unfinished requests scheduled nothing"
    assert not sched.has_unfinished(), "requests did not finish"
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    sched.check_invariants()


def test_construction_needs_max_model_len_and_pool_size():
    with pytest.raises(ValueError, match="max_model_len resolved"):
        Scheduler(EngineConfig(num_kv_blocks=8))
    with pytest.raises(ValueError, match="set config.num_kv_blocks or pass num_kv_blocks"):
        Scheduler(EngineConfig(max_model_len=64))
    assert Scheduler(EngineConfig(max_model_len=64), num_kv_blocks=8).block_manager.num_blocks == 8


def test_add_request_rejects_requests_that_can_never_run():
    sched, _ = make(num_blocks=4, block_size=4, max_model_len=32)
    with pytest.raises(ValueError, match="prompt has 33 tokens; max_model_len=32 .* at most 31"):
        sched.add_request("a", range(1, 34))
    with pytest.raises(ValueError, match="prompt has 32 tokens; max_model_len=32 .* at most 31"):
        sched.add_request("a", range(1, 33))  # the server's rule too (server/prompts.py): room for one output
    with pytest.raises(ValueError, match=r"up to 20 tokens need 5 KV blocks of 4, but the pool has only 4"):
        sched.add_request("b", range(1, 11), SamplingParams(max_tokens=11))
    with pytest.raises(ValueError, match="the prompt is empty"):
        sched.add_request("c", [])
    with pytest.raises(ValueError, match=r"prompt_token_ids: token id -5 at position 1 is outside the vocabulary"):
        sched.add_request("d", [1, -5])
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        sched.add_request("e", [1], {"temperature": 0})
    sched.add_request("f", range(1, 17), SamplingParams(max_tokens=1))  # exactly the whole pool: fine
    with pytest.raises(ValueError, match="'f' is already in use"):
        sched.add_request("f", [1])
    assert sched.num_unfinished == 1


def test_seeds_are_drawn_once_at_add_and_replayable():
    seqs = [make(seed=5)[0].add_request("a", [1, 2], SamplingParams(temperature=0.8, n=2)) for _ in range(2)]
    assert seqs[0][0].seed == seqs[1][0].seed == seqs[0][1].seed is not None
    sched, _ = make()
    assert sched.add_request("g", [1], SamplingParams(temperature=0)).pop().seed is None
    assert sched.add_request("s", [1], SamplingParams(temperature=1.0, seed=42)).pop().seed == 42


def test_single_request_lifecycle():
    sched, runner = make()
    (seq,) = sched.add_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=3, temperature=0))
    batch, _ = step(sched, runner, [11])
    (item,) = batch.scheduled
    assert (item.start_pos, item.query_len, item.sample, item.num_logits) == (0, 5, True, 1)
    batch, _ = step(sched, runner, [12])
    assert batch.scheduled[0].is_decode and batch.scheduled[0].token_ids == (11,)
    _, finished = step(sched, runner, [13])
    assert finished == [seq] and seq.finish_reason == "length" and seq.output_token_ids == [11, 12, 13]
    assert runner.sampled_positions[seq.seq_id] == [0, 1, 2]
    assert not sched.has_unfinished() and sched.block_manager.num_free_blocks == 64


def test_chunked_prefill_is_mixed_with_decodes_first():
    sched, runner = make(budget=8)
    (a,) = sched.add_request("a", [1, 2, 3], SamplingParams(max_tokens=10, ignore_eos=True))
    step(sched, runner)
    (b,) = sched.add_request("b", range(1, 21))
    chunks = []
    while b.num_output_tokens == 0:
        batch, _ = step(sched, runner)
        assert batch.scheduled[0].seq is a and batch.scheduled[0].query_len == 1
        chunks.append(batch.scheduled[1])
    assert [c.query_len for c in chunks] == [7, 7, 6]
    assert [(c.sample, c.num_logits) for c in chunks] == [(False, 0), (False, 0), (True, 1)]


def test_budget_and_max_num_seqs_limit_admission():
    sched, runner = make(budget=6, max_seqs=2)
    for i in range(4):
        sched.add_request(f"r{i}", [1, 2, 3, 4], SamplingParams(max_tokens=2))
    batch, _ = step(sched, runner)
    assert [s.query_len for s in batch.scheduled] == [4, 2] and len(sched.running) == 2
    batch, _ = step(sched, runner)  # budget left, but max_num_seqs is reached: no admission
    assert [s.query_len for s in batch.scheduled] == [1, 2] and len(sched.waiting) == 2
    drain(sched, runner)


def test_without_chunking_a_prefill_runs_whole_or_waits():
    sched, runner = make(budget=16, max_model_len=16, enable_chunked_prefill=False)
    sched.add_request("a", range(1, 11))
    (b,) = sched.add_request("b", range(11, 21))
    batch, _ = step(sched, runner)
    assert [s.query_len for s in batch.scheduled] == [10] and b.status is SequenceStatus.WAITING
    batch, _ = step(sched, runner)
    assert [s.query_len for s in batch.scheduled] == [1, 10]


@pytest.mark.parametrize("params, tokens, reason, stop_reason, n_out", [
    (SamplingParams(), [3, EOS, 4], "stop", EOS, 2),
    (SamplingParams(max_tokens=3, ignore_eos=True), [EOS, EOS, EOS], "length", None, 3),
    (SamplingParams(stop_token_ids=[9]), [3, 9], "stop", 9, 2),
    (SamplingParams(max_tokens=2), [3, 4], "length", None, 2),
    (SamplingParams(max_tokens=1), [EOS], "stop", EOS, 1),  # a stop beats the length limit
])
def test_stop_conditions(params, tokens, reason, stop_reason, n_out):
    sched, runner = make()
    (seq,) = sched.add_request("a", [1, 2], params)
    while not seq.is_finished:
        step(sched, runner, [tokens[seq.num_output_tokens]])
    assert (seq.finish_reason, seq.stop_reason, seq.num_output_tokens) == (reason, stop_reason, n_out)


def test_stop_checker_and_max_model_len():
    calls = []

    def checker(seq, token):  # asked once the token is recorded, unless it ends the sequence by itself
        calls.append(seq.output_token_ids)
        return "END" if token == 6 else None

    sched, runner = make(stop_checker=checker)
    (seq,) = sched.add_request("a", [1, 2], SamplingParams(max_tokens=None))
    for t in (5, 6):
        step(sched, runner, [t])
    assert (seq.finish_reason, seq.stop_reason, calls) == ("stop", "END", [[5], [5, 6]])
    (seq,) = sched.add_request("c", [1, 2], SamplingParams(max_tokens=None))
    calls.clear()
    step(sched, runner, [EOS])  # a stop token ends the sequence by itself: its text is never asked for
    assert (seq.finish_reason, seq.stop_reason, calls) == ("stop", EOS, [])
    sched, runner = make(max_model_len=8)
    (seq,) = sched.add_request("b", range(1, 7), SamplingParams(max_tokens=None))
    drain(sched, runner)
    assert seq.finish_reason == "length" and seq.num_tokens == 8


def test_preemption_recomputes_the_newest_and_keeps_its_outputs():
    sched, runner = make(num_blocks=4, block_size=2, budget=8, enable_prefix_caching=False)
    (a,) = sched.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    (b,) = sched.add_request("b", [4, 5, 6], SamplingParams(max_tokens=4, ignore_eos=True))
    step(sched, runner, [10, 20])
    batch, _ = step(sched, runner, [11, 21])  # positions 3: inside the second blocks
    assert not batch.preempted
    batch, _ = step(sched, runner, [12])  # a needs a third block: b (newest) is preempted
    assert batch.preempted == (b,) and [s.seq for s in batch.scheduled] == [a]
    assert b.status is SequenceStatus.WAITING and sched.waiting[0] is b and b.block_table == []
    assert b.output_token_ids == [20, 21] and b.num_preemptions == 1
    drain(sched, runner)
    assert a.finish_reason == b.finish_reason == "length"
    assert runner.sampled_positions[b.seq_id] == [0, 1, 2, 3]  # resumed at t = 2, no draw repeated


def test_preemption_order_newest_first_and_waiting_front_keeps_arrival_order():
    sched, runner = make(num_blocks=6, block_size=2, budget=8, enable_prefix_caching=False)
    seqs = [sched.add_request(f"r{i}", [1, 2], SamplingParams(max_tokens=6, ignore_eos=True))[0]
            for i in range(3)]
    step(sched, runner)
    batch, _ = step(sched, runner)  # every sequence needs a second block: the pool has 3 left
    assert batch.preempted == ()
    batch, _ = step(sched, runner)  # positions 3 fit; nothing preempted
    batch, _ = step(sched, runner)  # third blocks, none free: r0 preempts r2 (2 blocks back), r1 then fits
    assert batch.preempted == (seqs[2],)
    assert [s.seq for s in batch.scheduled] == seqs[:2]
    batch, _ = step(sched, runner)
    batch, _ = step(sched, runner)  # fourth blocks for r0: r1 (now newest running) is preempted
    assert batch.preempted == (seqs[1],) and list(sched.waiting) == [seqs[1], seqs[2]]
    drain(sched, runner)


def test_a_sequence_that_is_the_newest_preempts_itself():
    sched, runner = make(num_blocks=3, block_size=2, budget=8, enable_prefix_caching=False)
    (a,) = sched.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    (b,) = sched.add_request("b", [4, 5], SamplingParams(max_tokens=4, ignore_eos=True))
    step(sched, runner)  # the pool is full: a holds 2 blocks, b 1
    batch, _ = step(sched, runner)  # a decodes in its 2nd block; b needs a 2nd block, and is the newest
    assert batch.preempted == (b,) and [s.seq for s in batch.scheduled] == [a]
    drain(sched, runner)


def test_abort_frees_blocks_wherever_the_request_is():
    sched, runner = make(max_seqs=1, budget=4)
    (run,) = sched.add_request("run", range(1, 9))
    (wait,) = sched.add_request("wait", [1, 2])
    batch, _ = step(sched, runner)
    assert sched.abort("wait") == [wait] and wait.finish_reason == "abort"
    assert sched.abort("run") == [run] and run.block_table == [] and run.status is SequenceStatus.FINISHED
    sched.postprocess(batch, [None])  # aborted between schedule() and postprocess(): ignored
    assert sched.abort("run") == [] and sched.abort("nope") == []
    sched.check_invariants()
    assert sched.block_manager.num_free_blocks == 64 and not sched.has_unfinished()
    seqs = sched.add_request("multi", range(1, 10), SamplingParams(n=3))
    step(sched, runner)
    assert sched.abort("multi") == seqs and all(s.finish_reason == "abort" for s in seqs)
    sched.check_invariants()


def test_postprocess_validates_the_sampled_tokens():
    sched, runner = make()
    sched.add_request("a", [1, 2])
    batch = sched.schedule()
    with pytest.raises(ValueError, match="got 2 sampled tokens for a batch of 1"):
        sched.postprocess(batch, [1, 2])
    with pytest.raises(TypeError, match="sampled token of sequence 0 must be an int"):
        sched.postprocess(batch, [None])


def test_n_samples_share_the_prompt_through_the_prefix_cache():
    sched, runner = make(budget=32)
    seqs = sched.add_request("a", range(1, 11), SamplingParams(n=3, seed=9, max_tokens=3, ignore_eos=True))
    assert [s.sample_index for s in seqs] == [0, 1, 2] and {s.seed for s in seqs} == {9}
    batch, _ = step(sched, runner)
    assert [s.seq for s in batch.scheduled] == [seqs[0]]  # samples 1, 2 wait for sample 0's prompt
    batch, _ = step(sched, runner)
    assert [s.seq for s in batch.scheduled] == seqs
    assert [s.num_cached_tokens for s in seqs[1:]] == [8, 8]
    assert seqs[1].block_table[:2] == seqs[0].block_table[:2] == seqs[2].block_table[:2]
    drain(sched, runner)
    sched, runner = make(enable_prefix_caching=False)
    seqs = sched.add_request("a", range(1, 11), SamplingParams(n=2))
    assert len(step(sched, runner)[0]) == 2  # nothing to share: admitted together


def test_prompt_logprobs_need_logits_for_every_prompt_position():
    sched, runner = make(budget=4, max_seqs=2)
    leader, other = sched.add_request("a", range(1, 11), SamplingParams(prompt_logprobs=1, n=2))
    chunks = []
    while leader.num_output_tokens == 0:
        batch, _ = step(sched, runner)
        chunks += [s for s in batch.scheduled if s.seq is leader]
    assert [(c.query_len, c.num_logits) for c in chunks] == [(4, 4), (4, 4), (2, 2)]
    assert runner.prompt_logit_positions[leader.seq_id] == list(range(9))
    assert not other.wants_prompt_logprobs
    (again,) = sched.add_request("b", range(1, 11), SamplingParams(prompt_logprobs=0))
    (plain,) = sched.add_request("c", range(1, 11))
    drain(sched, runner)
    assert again.num_cached_tokens == 0 and plain.num_cached_tokens == 8


def test_prompt_logprobs_are_not_delivered_twice_after_preemption():
    sched, runner = make(num_blocks=6, block_size=2, budget=3, max_seqs=2)
    (a,) = sched.add_request("a", [1, 2], SamplingParams(max_tokens=9, ignore_eos=True))
    (b,) = sched.add_request("b", range(1, 9), SamplingParams(prompt_logprobs=0, max_tokens=1))
    drain(sched, runner)
    assert b.num_preemptions >= 1
    assert runner.prompt_logit_positions[b.seq_id] == list(range(7))


# --------------------------------------------------------------------------------------------------
# Randomized: any mix of add / step / abort on tiny pools keeps the invariants and leaks nothing.

PREFIXES = ([1, 2, 3, 4, 1, 2, 3, 4], [1, 2, 3, 4, 4, 3, 2, 1], [2, 2, 2, 2, 2, 2])


def _fits(sched, prompt, params):
    cfg, bm = sched.config, sched.block_manager
    grows_to = cfg.max_model_len - 1 if params.max_tokens is None else len(prompt) + params.max_tokens - 1
    longest = max(len(prompt), min(grows_to, cfg.max_model_len - 1))
    return len(prompt) <= cfg.max_model_len - 1 and bm.blocks_for_tokens(longest) <= bm.num_blocks


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(3, 12),
                budget=st.integers(3, 12), max_seqs=st.integers(1, 3), chunked=st.booleans(),
                caching=st.booleans(), max_model_len=st.integers(6, 20), seed=st.integers(0, 2**16))
    def setup(self, block_size, num_blocks, budget, max_seqs, chunked, caching, max_model_len, seed):
        budget = budget if chunked else max(budget, max_model_len)
        self.sched, self.runner = make(num_blocks, block_size, budget, max_seqs, max_model_len,
                                       enable_chunked_prefill=chunked, enable_prefix_caching=caching)
        self.rng = random.Random(seed)
        self.request_ids = []

    @rule(prefix=st.sampled_from(PREFIXES), extra=st.lists(st.integers(1, 4), max_size=10),
          max_tokens=st.none() | st.integers(1, 8), n=st.integers(1, 3), prompt_logprobs=st.booleans(),
          ignore_eos=st.booleans())
    def add(self, prefix, extra, max_tokens, n, prompt_logprobs, ignore_eos):
        prompt = (list(prefix) + extra)[: max(1, len(prefix) + len(extra))]
        params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=ignore_eos,
                                prompt_logprobs=0 if prompt_logprobs else None)
        rid = f"r{len(self.request_ids)}"
        if _fits(self.sched, prompt, params):
            self.sched.add_request(rid, prompt, params)
            self.request_ids.append(rid)
        else:
            with pytest.raises(ValueError):
                self.sched.add_request(rid, prompt, params)

    @rule()
    def step(self):
        had_work = self.sched.has_unfinished()
        batch, _ = step(self.sched, self.runner, rng=self.rng)
        assert not had_work or not batch.is_empty, "a step with unfinished requests scheduled nothing"

    @precondition(lambda self: self.request_ids)
    @rule(data=st.data())
    def abort(self, data):
        self.sched.abort(data.draw(st.sampled_from(self.request_ids)))

    @invariant()
    def consistent(self):
        self.sched.check_invariants()

    def teardown(self):
        drain(self.sched, self.runner, rng=self.rng)
        self.check_deliveries()

    def check_deliveries(self):
        """Every sequence drew positions 0, 1, 2, ... once each; no prompt logits came twice."""
        for seq_id, positions in self.runner.sampled_positions.items():
            assert positions == list(range(len(positions))), f"sequence {seq_id} drew {positions}"
        for positions in self.runner.prompt_logit_positions.values():
            assert len(positions) == len(set(positions)), "prompt logits delivered twice"


SchedulerMachine.TestCase.settings = settings(max_examples=4 * settings.default.max_examples,
                                              stateful_step_count=40)
test_random_scheduler_mixes = SchedulerMachine.TestCase


def test_prompt_ids_are_checked_once_here():
    from detinfer.engine.sequence import check_prompt_ids

    assert check_prompt_ids("r", (3, 4), None, 8) == [3, 4]
    with pytest.raises(ValueError, match=r"request 'r': prompt_token_ids: token id 9 at position 1 is outside the "
                                         r"vocabulary \[0, 9\)"):
        check_prompt_ids("r", [1, 9], 9, 8)
    with pytest.raises(TypeError, match="prompt_token_ids: the token id at position 0 must be an int, got 1.0"):
        check_prompt_ids("r", [1.0], None, 8)
    with pytest.raises(TypeError, match="prompt must be a str or a list of token ids"):
        check_prompt_ids("r", 5, None, 8)
    cfg = EngineConfig(max_num_batched_tokens=16, max_num_seqs=8, block_size=4, num_kv_blocks=8, max_model_len=32)
    with pytest.raises(ValueError, match=r"token id 10 at position 1 is outside the vocabulary \[0, 10\)"):
        Scheduler(cfg, vocab_size=10).add_request("a", [1, 10])
