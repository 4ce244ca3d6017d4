"""The TP step protocol that CUDA graphs and overlapped scheduling rely on, on CPU over gloo, bitwise.

CPU cannot capture graphs, but everything around the capture can be checked:
- every step run on every rank padded exactly as its graph would pad it (`TensorParallelRunner.run_padded_eager`:
  the graph's shape, attention bounds and full-width tables, on rank 0 and the workers alike) gives the
  unpadded steps' bits: token ids, logprobs, prompt logprobs, at TP=2 (with and without tp_invariant_reduction);
- overlapped scheduling on / off give the same bits at TP=2, and pending token ids reach the workers by a
  broadcast from rank 0 without rank 0 reading them on the host;
- the KV block count is agreed through the group before the pools are allocated (graphs capture their
  addresses), and a worker that would replay another graph shape than rank 0 refuses the step.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from test_tensor_parallel import REQUESTS, engine_at, greedy, model_dir, prompt, run, sampled  # noqa: F401

from detinfer.cache.layout import StepLayout
from detinfer.engine.model_runner import ModelRunner
from detinfer.engine.sequence import PENDING_TOKEN
from detinfer.engine.tp_worker import LayoutBatch, run_step

_rng = random.Random(23)
MORE = [(3, "e", prompt(_rng, 30), sampled(5, seed=4)), (4, "f", prompt(_rng, 3), greedy(6)),
        (4, "g", prompt(_rng, 17), greedy(2, prompt_logprobs=1))]


def pad_every_step(runner) -> list:
    """From now on every step with a graph shape runs padded on every rank; returns the list of
    (shape kind, pending ids given) of the steps run, filled as they run."""
    seen = []

    def execute(batch, input_ids=None, argmax_only=False):
        shape = runner.graph_shape(batch.layout)
        seen.append((None if shape is None else shape.kind, input_ids is not None))
        if shape is None:
            return runner._step(batch.layout, input_ids, False,
                                lambda ids: runner.local.execute(batch, input_ids=ids, argmax_only=argmax_only),
                                argmax_only)
        logits = runner.run_padded_eager(batch.layout, input_ids)  # (full rows on every rank)
        return torch.argmax(logits, dim=-1) if argmax_only else logits

    runner.execute = execute
    return seen


@pytest.fixture(scope="module")
def runs(model_dir):  # noqa: F811
    """Results of REQUESTS + MORE at TP=2: overlap on (eager, then padded), overlap off (eager), and with
    tp_invariant_reduction (eager, then padded)."""
    reqs = REQUESTS + MORE
    on = engine_at(model_dir, 2)
    off = engine_at(model_dir, 2, async_scheduling=False)
    inv = engine_at(model_dir, 2, tp_invariant_reduction=True)
    try:
        eager_on, eager_off, eager_inv = run(on, reqs), run(off, reqs), run(inv, reqs)
        seen = pad_every_step(on.runner)
        padded_on = run(on, reqs)
        del on.runner.execute
        pad_every_step(inv.runner)
        padded_inv = run(inv, reqs)
        yield SimpleNamespace(engine=on, eager_on=eager_on, eager_off=eager_off, padded_on=padded_on, seen=seen,
                              eager_inv=eager_inv, padded_inv=padded_inv)
    finally:
        for engine in (on, off, inv):
            engine.close()


def test_padded_steps_equal_unpadded_steps_at_tp2(runs):
    assert runs.padded_on == runs.eager_on
    assert all(sig.error is None and sig.completions[0].token_ids for sig in runs.padded_on.values())
    kinds = {kind for kind, _ in runs.seen}
    assert {"decode", "mixed"} <= kinds, runs.seen  # both graph families were padded
    assert ("decode", True) in runs.seen, "no padded step took pending ids from the previous step"


def test_padded_steps_equal_unpadded_steps_with_invariant_reduction(runs):
    assert runs.padded_inv == runs.eager_inv
    assert runs.eager_inv != runs.eager_on  # the chunk tree is a different rounding: both runs were exercised


def test_overlap_on_off_equal_at_tp2(runs):
    assert runs.eager_on == runs.eager_off


def test_pending_ids_reach_workers_without_a_host_read(runs):
    rng = random.Random(1)
    ids = [prompt(rng, 6), prompt(rng, 9)]

    def layout(token_ids):
        return StepLayout.build([[40, 41], [42, 43, 44]], [0, 0], [6, 9], 4, token_ids=token_ids, num_logits=[1, 2])

    known = layout(ids)
    pending = layout([ids[0][:-1] + [PENDING_TOKEN], ids[1][:-1] + [PENDING_TOKEN]])
    device_ids = torch.tensor(known.token_ids)

    def no_host_read(*args, **kwargs):
        raise AssertionError("rank 0 read the pending ids on the host")

    device_ids.tolist = no_host_read
    runner = runs.engine.runner
    got = runner.execute(LayoutBatch(pending), input_ids=device_ids).clone()
    assert torch.equal(got, runner.execute(LayoutBatch(known)))
    padded = runner.run_padded_eager(pending, device_ids).clone()
    assert torch.equal(padded, got)


class _MinGroup:
    def __init__(self, others: int):
        self.others, self.asked = others, []

    def agree_min(self, value: int) -> int:
        self.asked.append(value)
        return min(value, self.others)


def test_kv_blocks_agreed_before_the_pools_exist(runs):
    local = runs.engine.runner.local
    group = _MinGroup(others=40)
    runner = ModelRunner(local.model, local.model_config, local.config, 64, tp_group=group)
    assert group.asked == [64]
    assert runner.num_kv_blocks == 40 and all(k.shape[0] == v.shape[0] == 40 for k, v in runner.kv_cache)
    assert runs.engine.runner.num_kv_blocks == 64  # both ranks asked for 64


def test_worker_refuses_a_graph_shape_rank_0_did_not_pick():
    layout = StepLayout.build([[0]], [0], [1], 4, token_ids=[[5]], num_logits=[1])
    shape = SimpleNamespace(key=("decode", 1, 64))
    runner = SimpleNamespace(use_graphs=True, graph_shape=lambda lay: shape)
    with pytest.raises(RuntimeError, match=r"rank 1 picked graph shape \('decode', 1, 64\) .* rank 0 runs as "
                                           r"\('decode', 2, 64\)"):
        run_step(runner, SimpleNamespace(rank=1), layout, ("decode", 2, 64), False)
