"""Batch-invariant paged attention (detinfer.kernels.attention): invariance and accuracy on CPU.

Invariance is bitwise (torch.equal): for every (sequence, token) the output is the same whether the
prompt runs in one prefill, in random chunks mixed with other sequences in random orders, or as a
prefill followed by one-token decode steps; whatever the schedule (split-parallel or sequential), the
block size, the physical blocks or the block table's width. Accuracy is against a float64 reference on
a NaN-poisoned pool and output. CPU runs use the Triton interpreter with small shapes and a small
split size (so several splits are merged); bf16, the default split size and long sequences run on the
GPU (test_attention_gpu.py).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.kernels.attention import (
    DEFAULT_SPLIT_SIZE,
    attention_contiguous,
    attention_contiguous_ref,
    paged_attention,
    paged_attention_fast,
    paged_attention_ref,
)

# Sibling helper modules: the suite runs with --import-mode=importlib, which does not put test
# folders on sys.path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_attention_scenarios import (  # noqa: E402
    DEV,
    PagedRunner,
    assert_accurate,
    make_seqs,
    prefill_then_decode,
    random_plans,
    reference,
    whole_plan,
)

CPU_DTYPES = [torch.float32, torch.float16]
SCALE = 0.125
# A small split (2 tiles of 64 keys) so sequences of ~300 keys cross several split boundaries on CPU.
SPLIT = 128
FEW = max(3, settings.default.max_examples // 3)  # the multi-step plans are the slow tests


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert not torch.isnan(x).any(), f"{what}: sequence {i} has unwritten/poisoned outputs"
        if not torch.equal(x, y):
            rows = (x != y).flatten(1).any(1).nonzero().flatten().tolist()
            raise AssertionError(f"{what}: sequence {i} differs at tokens {rows[:10]}")


@settings(max_examples=FEW)
@given(data=st.data(), dtype=st.sampled_from(CPU_DTYPES), group=st.sampled_from([1, 2, 3]))
def test_chunked_mixed_batches_match_whole_prefill(data, dtype, group):
    lengths = data.draw(st.lists(st.one_of(st.integers(1, 40), st.integers(200, 300)), min_size=1,
                                 max_size=3), label="lengths")
    seqs = make_seqs(lengths, 2 * group, 2, 64, dtype, seed=data.draw(st.integers(0, 99)))
    whole = PagedRunner(seqs, seed=1).run(whole_plan(lengths, schedule="sequential"), SCALE, split_size=SPLIT)
    plan = data.draw(random_plans(lengths), label="plan")
    bs = data.draw(st.sampled_from([8, 16, 32]), label="block_size")
    chunked = PagedRunner(seqs, block_size=bs, seed=2).run(plan, SCALE, split_size=SPLIT)
    assert_same(whole, chunked, "random chunking")
    for seq, out in zip(seqs, whole, strict=True):
        assert_accurate(out, reference(seq, SCALE), dtype)


@settings(max_examples=FEW)
@given(data=st.data(), dtype=st.sampled_from(CPU_DTYPES))
def test_prefill_then_decode_matches_whole_prefill(data, dtype):
    lengths = data.draw(st.lists(st.integers(1, 300), min_size=1, max_size=3), label="lengths")
    # Decode the last 1..4 tokens one at a time (each decode step is a full interpreter launch).
    prefix = [max(0, n - data.draw(st.integers(1, 4))) for n in lengths]
    seqs = make_seqs(lengths, 4, 2, 64, dtype, seed=data.draw(st.integers(0, 99)))
    whole = PagedRunner(seqs, seed=3).run(whole_plan(lengths), SCALE, split_size=SPLIT)
    sched = data.draw(st.sampled_from(["parallel", "sequential"]), label="decode schedule")
    decoded = PagedRunner(seqs, seed=4).run(prefill_then_decode(lengths, prefix, schedule=sched), SCALE,
                                            split_size=SPLIT)
    assert_same(whole, decoded, "prefill + decode")


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_schedules_and_hints_agree_at_default_split(dtype):
    lengths = [290, 5]  # crosses one split boundary of the default 256
    seqs = make_seqs(lengths, 4, 1, 64, dtype, seed=5)
    runs = [PagedRunner(seqs, seed=s).run(whole_plan(lengths, schedule=sched, max_q_len=hint), SCALE)
            for s, (sched, hint) in enumerate([("sequential", None), ("parallel", 16), ("sequential", 1)])]
    for r in runs[1:]:
        assert_same(runs[0], r, f"default split {DEFAULT_SPLIT_SIZE}")


@pytest.mark.parametrize("programs", [1, 3])
def test_split_parallel_programs_walking_several_splits(monkeypatch, programs):
    """Split-parallel programs that walk several splits (storing each split's partial on its own) give
    the sequential bits; how many splits a program walks is a speed choice."""
    from detinfer.kernels import attention

    lengths = [300, 140, 1]
    seqs = make_seqs(lengths, 4, 2, 64, torch.float16, seed=10)
    ref = PagedRunner(seqs).run(whole_plan(lengths, schedule="sequential"), SCALE, split_size=64)
    # ~programs in total: every program walks many splits
    monkeypatch.setitem(attention._TUNE, "programs_per_sm", programs / 132)
    for window in (None, 100):
        par = PagedRunner(seqs, seed=1).run(whole_plan(lengths, schedule="parallel"), SCALE, split_size=64,
                                            sliding_window=window)
        if window is None:
            assert_same(ref, par, f"{programs} programs")
        dec = PagedRunner(seqs, seed=2).run(prefill_then_decode(lengths, [n - 1 for n in lengths],
                                                                schedule="parallel"), SCALE, split_size=64,
                                            sliding_window=window)
        assert_same(par, dec, f"{programs} programs, window {window}")


@settings(max_examples=FEW)
@given(data=st.data(), window=st.integers(1, 150))
def test_sliding_window_invariant_and_accurate(data, window):
    lengths = data.draw(st.lists(st.integers(1, 300), min_size=1, max_size=2), label="lengths")
    seqs = make_seqs(lengths, 2, 1, 64, torch.float32, seed=data.draw(st.integers(0, 99)))
    whole = PagedRunner(seqs, seed=1).run(whole_plan(lengths), SCALE, split_size=64, sliding_window=window)
    plan = data.draw(random_plans(lengths, max_steps=4), label="plan")
    chunked = PagedRunner(seqs, seed=2).run(plan, SCALE, split_size=64, sliding_window=window)
    assert_same(whole, chunked, f"sliding window {window}")
    for seq, out in zip(seqs, whole, strict=True):
        assert_accurate(out, reference(seq, SCALE, window), torch.float32)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("head_dim,group", [(128, 4), (256, 1), (64, 7)])
def test_head_dims_and_groups_accurate(dtype, head_dim, group):
    lengths = [70, 1]
    seqs = make_seqs(lengths, group, 1, head_dim, dtype, seed=6)
    outs = PagedRunner(seqs).run(whole_plan(lengths), 1 / head_dim**0.5, split_size=128)
    for seq, out in zip(seqs, outs, strict=True):
        assert_accurate(out, reference(seq, 1 / head_dim**0.5), dtype)


def test_output_buffer_rows_written_and_padding_rows_untouched():
    """Rows of q past cu_q_lens[-1] (padding of a captured batch) are left as they were."""
    seqs = make_seqs([30, 5], 4, 2, 64, torch.float32, seed=7)
    runner = PagedRunner(seqs)
    ref = runner.run(whole_plan([30, 5]), SCALE)
    st_ = runner.last_step
    q_pad = torch.cat([st_["q"], torch.zeros(3, 4, 64, device=DEV)])
    out = torch.full((38, 4, 64), float("nan"), device=DEV)
    res = paged_attention(q_pad, runner.k_cache, runner.v_cache, st_["block_tables"], st_["kv_lens"],
                          st_["cu_q_lens"], SCALE, out=out)
    assert res is out
    assert torch.equal(out[:35], torch.cat(ref)) and torch.isnan(out[35:]).all()


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_fast_path_accurate(dtype):
    lengths = [200, 3, 90]
    seqs = make_seqs(lengths, 4, 2, 64, dtype, seed=8)
    outs = PagedRunner(seqs).run(whole_plan(lengths), SCALE, attn=paged_attention_fast)
    decode = PagedRunner(seqs).run(prefill_then_decode(lengths, [n - 2 for n in lengths]), SCALE,
                                   attn=paged_attention_fast)
    for seq, a, b in zip(seqs, outs, decode, strict=True):
        assert_accurate(a, reference(seq, SCALE), dtype)
        assert_accurate(b, reference(seq, SCALE), dtype)


def test_reference_is_chunking_invariant():
    """The pure-torch path (the engine's CPU path) is itself bitwise invariant."""
    lengths = [50, 9]
    seqs = make_seqs(lengths, 4, 2, 64, torch.float32, seed=9)
    whole = PagedRunner(seqs).run(whole_plan(lengths), SCALE, attn=paged_attention_ref)
    steps = PagedRunner(seqs, seed=3).run(prefill_then_decode(lengths, [20, 0]), SCALE, attn=paged_attention_ref)
    assert_same(whole, steps, "reference")


# ----------------------------------------------------------------------------------------- contiguous
def _padded(seqs, lq, pads, device=DEV):
    """Left-padded HF-layout batch: row b has pads[b] NaN slots then its keys; queries are the last lq."""
    lk = max(s.length + p for s, p in zip(seqs, pads, strict=True))
    hq, d = seqs[0].q.shape[1:]
    hkv = seqs[0].k.shape[1]
    q = torch.full((len(seqs), hq, lq, d), float("nan"), dtype=seqs[0].q.dtype, device=device)
    k = torch.full((len(seqs), hkv, lk, d), float("nan"), dtype=seqs[0].q.dtype, device=device)
    v = k.clone()
    starts = []
    for b, s in enumerate(seqs):
        start = lk - s.length
        starts.append(start)
        k[b, :, start:] = s.k.transpose(0, 1)
        v[b, :, start:] = s.v.transpose(0, 1)
        n = min(lq, s.length)
        q[b, :, lq - n:] = s.q[s.length - n:].transpose(0, 1)
        q[b, :, : lq - n] = 0.0  # query slots that are padding
    return q, k, v, torch.tensor(starts, dtype=torch.int32, device=device)


@settings(max_examples=FEW)
@given(data=st.data(), dtype=st.sampled_from(CPU_DTYPES))
def test_contiguous_matches_paged_bitwise_under_left_padding(data, dtype):
    lengths = data.draw(st.lists(st.integers(1, 200), min_size=1, max_size=3), label="lengths")
    seqs = make_seqs(lengths, 4, 2, 64, dtype, seed=data.draw(st.integers(0, 99)))
    paged = PagedRunner(seqs).run(whole_plan(lengths), SCALE, split_size=SPLIT)
    pads = data.draw(st.lists(st.integers(0, 40), min_size=len(lengths), max_size=len(lengths)), label="pads")
    lq = data.draw(st.sampled_from([1, max(lengths)]), label="lq")
    q, k, v, starts = _padded(seqs, lq, pads)
    out = attention_contiguous(q, k, v, starts, SCALE, split_size=SPLIT,
                               schedule=data.draw(st.sampled_from(["parallel", "sequential"])))
    for b, s in enumerate(seqs):
        n = min(lq, s.length)
        assert torch.equal(out[b, :, lq - n:].transpose(0, 1), paged[b][s.length - n:]), f"row {b}"
        assert (out[b, :, : lq - n] == 0).all(), "padding query slots must return 0"
    assert_accurate(out, attention_contiguous_ref(q.double(), k.double(), v.double(), starts, SCALE), dtype)
