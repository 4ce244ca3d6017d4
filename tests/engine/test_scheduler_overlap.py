"""The scheduler driven as the engine drives it with overlapped scheduling: step n+1 is scheduled (its
decodes feed the pending tokens of step n) and launched before step n's ids are resolved. Any mix of add
/ step / abort on tiny pools keeps the invariants, writes K/V only into blocks a sequence alone owns, reads
back the right (token, position) for every cached key (the fake runner checks every slot), delivers every
output position and prompt logit once, and leaks no block."""

import random

from hypothesis import settings
from hypothesis.stateful import rule
from test_scheduler import SchedulerMachine, make

from detinfer.engine.sampling_params import SamplingParams


def overlapped_step(sched, runner, inflight, rng):
    """Schedule, run and advance the next batch, then resolve the one in flight (its ids come back only
    now). Returns the new in-flight (batch, tokens), or None when nothing was scheduled."""
    batch = sched.schedule()
    assert not batch.is_empty or inflight is not None or not sched.has_unfinished(), \
        "a step with unfinished requests and nothing in flight scheduled nothing"
    runner.run(batch)
    tokens = [rng.randrange(5) if s.sample else None for s in batch.scheduled]
    for item, t in zip(batch.scheduled, tokens):
        if t is not None:
            runner.device[(item.seq.seq_id, item.context_len)] = t  # the id the device drew
    sched.advance(batch)
    if inflight is not None:
        previous, previous_tokens = inflight
        sched.resolve(previous, previous_tokens)
    sched.check_invariants()
    return None if batch.is_empty else (batch, tokens)


def drain_overlapped(sched, runner, rng, inflight=None, max_steps=2000):
    for _ in range(max_steps):
        if not sched.has_unfinished() and inflight is None:
            break
        inflight = overlapped_step(sched, runner, inflight, rng)
    assert not sched.has_unfinished() and inflight is None, "requests did not finish"
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    sched.check_invariants()


class OverlappedSchedulerMachine(SchedulerMachine):
    inflight = None

    @rule()  # replaces the base class's step rule (same name)
    def step(self):
        self.inflight = overlapped_step(self.sched, self.runner, self.inflight, self.rng)

    def teardown(self):
        drain_overlapped(self.sched, self.runner, self.rng, self.inflight)
        self.check_deliveries()


OverlappedSchedulerMachine.TestCase.settings = settings(max_examples=4 * settings.default.max_examples,
                                                        stateful_step_count=40)
test_random_overlapped_scheduler_mixes = OverlappedSchedulerMachine.TestCase


def launch(sched, runner, tokens):
    """Schedule, run and advance one batch whose sampled entries draw `tokens` (by request id)."""
    batch = sched.schedule()
    runner.run(batch)
    drawn = [tokens[item.seq.request_id] if item.sample else None for item in batch.scheduled]
    for item, t in zip(batch.scheduled, drawn):
        if t is not None:
            runner.device[(item.seq.seq_id, item.context_len)] = t
    sched.advance(batch)
    return batch, drawn


def test_pending_token_of_a_preempted_sequence_can_finish_it_while_waiting():
    """b is preempted while its first token is pending, and that token is EOS: b finishes from the
    waiting queue holding no blocks; a goes on."""
    sched, runner = make(num_blocks=5, block_size=2, budget=8, max_seqs=2)
    (a,) = sched.add_request("a", [1, 2, 3, 4], SamplingParams(max_tokens=6))
    (b,) = sched.add_request("b", [5, 6, 7, 8], SamplingParams(max_tokens=6))
    first = launch(sched, runner, {"a": 3, "b": 0})  # both prompts (4 blocks of 5); EOS is 0
    assert a.num_pending_tokens == b.num_pending_tokens == 1
    second = launch(sched, runner, {"a": 4})  # a's decode takes the last block: b is preempted
    assert [item.seq for item in second[0].scheduled] == [a] and b in sched.waiting
    assert b.num_pending_tokens == 1 and not b.block_table
    finished = sched.resolve(*first)
    assert finished == [b] and b.finish_reason == "stop" and b.output_token_ids == [0]
    assert b not in sched.waiting and a.output_token_ids == [3, -1]
    sched.check_invariants()
    drain_overlapped(sched, runner, random.Random(1), inflight=second)
    assert a.output_token_ids[:2] == [3, 4]


def test_a_finish_by_length_is_not_scheduled_again():
    sched, runner = make()
    (a,) = sched.add_request("a", [1, 2, 3], SamplingParams(max_tokens=1))
    first = launch(sched, runner, {"a": 3})
    assert sched.schedule().is_empty  # its pending token is its last whatever its id
    assert sched.resolve(*first) == [a] and a.finish_reason == "length"
