"""Paged attention handing an FP8 o_proj its rows quantized (kernels/attention_quant.py): the quantized rows
are `QuantizedRows.of` the 16-bit `paged_attention` output, bitwise on the GPU (decode and prefill, the
sequential kernel and the split merge, GQA groups, a request alone and in a batch); under Triton's CPU
interpreter, whose fp8 cast is not the GPU's, the scales bitwise and the values close. Padding rows are left
untouched, bad buffers and head sizes are refused by name, and the backend hands the 16-bit rows out where the
kernel does not quantize them."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.kernels.attention_quant import paged_attention_quantized
from detinfer.kernels.fp8_quant import FP8_DTYPE, QuantizedRows
from detinfer.ops import Ops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_attention_scenarios import DEV, PagedRunner, make_seqs  # noqa: E402

SCALE = 128 ** -0.5
SPLIT = 128  # two 64-key tiles per split: sequences of a few hundred keys cross several splits
FEW = max(3, settings.default.max_examples // 4)
cuda = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
                          reason="needs a CUDA GPU with fp8 (sm89+)")


def _same(a: QuantizedRows, b: QuantizedRows) -> bool:
    return (a.dtype == b.dtype and torch.equal(a.q.view(torch.uint8), b.q.view(torch.uint8))
            and torch.equal(a.scale, b.scale))


def _close_values(got: QuantizedRows, rows: torch.Tensor) -> bool:
    """got's values are torch's quantization of rows but where torch's value is a power of two or subnormal
    (the interpreter's e4m3 cast mis-rounds those: kernels/fp8_linear.py quantize_activations_gpu)."""
    want = QuantizedRows.of(rows).q.float()
    off = want[got.q.float() != want]
    return bool(((torch.frexp(off).mantissa.abs() == 0.5) | (off.abs() < 2.0 ** -6)).all())


def _step(lengths, cached, group, dtype, seed, **kw):
    """A cache holding each sequence's first cached[i] tokens, then one step of the rest: (runner, the step's
    attention inputs, its 16-bit rows [T, Hq * 128] from paged_attention)."""
    seqs = make_seqs(lengths, 2 * group, 2, 128, dtype, seed)
    runner = PagedRunner(seqs, seed=seed)
    first = [(i, c) for i, c in enumerate(cached) if c]
    if first:
        runner.run_more(first, SCALE, split_size=SPLIT)
    rest = [(i, n - c) for i, (n, c) in enumerate(zip(lengths, cached)) if n > c]
    rows = torch.cat(runner.run_more(rest, SCALE, split_size=SPLIT, **kw))
    step = runner.last_step
    args = (step["q"], runner.k_cache, runner.v_cache, step["block_tables"], step["kv_lens"], step["cu_q_lens"],
            SCALE)
    return runner, args, rows.reshape(rows.shape[0], -1)


@st.composite
def _cases(draw):
    lengths = draw(st.lists(st.integers(1, 260), min_size=1, max_size=3), label="lengths")
    decode = draw(st.booleans(), label="decode")
    cached = [n - 1 for n in lengths] if decode else [draw(st.integers(0, n - 1)) for n in lengths]
    return lengths, cached, draw(st.sampled_from([1, 2, 4]), label="group"), \
        draw(st.sampled_from(["sequential", "parallel"]), label="schedule"), draw(st.integers(0, 99), label="seed")


# -- Triton's CPU interpreter (the GPU run of the same tests is bitwise) ---------------------------------------
@settings(max_examples=FEW, deadline=None)
@given(case=_cases())
def test_quantized_rows_are_quantize_activations_of_the_attention_rows(case):
    """Decode steps (one query per sequence over a cached prefix) and prefill chunks, sequential programs and
    split-parallel ones + the merge kernel (each stores through the same quantizing store)."""
    lengths, cached, group, schedule, seed = case
    dtype = torch.bfloat16 if DEV.type == "cuda" else torch.float32
    _, args, rows = _step(lengths, cached, group, dtype, seed, schedule=schedule)
    got = paged_attention_quantized(*args, split_size=SPLIT, schedule=schedule)
    assert got.q.dtype == FP8_DTYPE and got.dtype == dtype and got.scale.shape == (rows.shape[0], 2 * group)
    assert torch.equal(got.scale, QuantizedRows.of(rows).scale)
    assert (_same(got, QuantizedRows.of(rows)) if DEV.type == "cuda" else _close_values(got, rows))


@pytest.mark.parametrize("schedule", ["sequential", "parallel"])
def test_fixed_buffers_get_the_real_rows_and_padding_rows_stay_as_they_were(schedule):
    """A CUDA graph's fixed buffers: the real rows as a fresh call gives them; rows past cu_q_lens[-1] (padding
    tokens) keep their quantized values (sequential steps) or become the quantization of what the 16-bit buffer
    held there (split-parallel steps merge into it, then quantize every row)."""
    _, args, rows = _step([150, 7], [0, 6], 2, torch.float32, 5)
    t = rows.shape[0]
    q_pad = torch.cat([args[0], torch.zeros(3, *args[0].shape[1:], device=DEV)])
    out = QuantizedRows(torch.full((t + 3, rows.shape[1]), 0x55, dtype=torch.uint8, device=DEV).view(FP8_DTYPE),
                        torch.full((t + 3, 4), -1.0, device=DEV), torch.float32)
    rows_out = torch.zeros((t + 3, 4, 128), device=DEV)
    res = paged_attention_quantized(q_pad, *args[1:], out=out, rows_out=rows_out, split_size=SPLIT,
                                    schedule=schedule)
    assert res is out
    fresh = paged_attention_quantized(*args, split_size=SPLIT, schedule=schedule)
    assert _same(QuantizedRows(out.q[:t], out.scale[:t], torch.float32), fresh)
    if schedule == "sequential":
        assert (out.q[t:].view(torch.uint8) == 0x55).all() and (out.scale[t:] == -1).all()
        assert not rows_out.any()  # the 16-bit buffer is not written
    else:
        assert _same(QuantizedRows(out.q[t:], out.scale[t:], torch.float32), QuantizedRows.of(torch.zeros(3, 512)))
        assert torch.equal(rows_out[:t].reshape(t, -1), rows)  # the merged 16-bit rows


def test_bad_head_size_and_buffers_are_refused_by_name():
    _, args, rows = _step([5], [0], 1, torch.float32, 1)
    q64 = torch.zeros(5, 2, 64, device=DEV)
    with pytest.raises(ValueError, match=r"q must be \[T, Hq, 128\] \(one head = one 128-wide"):
        paged_attention_quantized(q64, *args[1:])
    bad = QuantizedRows(torch.zeros(5, 128, dtype=FP8_DTYPE, device=DEV), torch.zeros(5, 1, device=DEV),
                        torch.float32)
    with pytest.raises(ValueError, match=r"out must be contiguous QuantizedRows of \[5, 256\]"):
        paged_attention_quantized(*args, out=bad)
    wrong_dtype = QuantizedRows.of(rows.to(torch.float16))
    with pytest.raises(ValueError, match="standing for torch.float32 rows"):
        paged_attention_quantized(*args, out=wrong_dtype)
    with pytest.raises(ValueError, match=r"rows_out must be a contiguous torch.float32 tensor of shape \(5, 2, 128\)"):
        paged_attention_quantized(*args, rows_out=torch.zeros(5, 256, device=DEV))


def test_backend_hands_out_the_16_bit_rows_where_the_kernel_does_not_quantize():
    """Off CUDA (and in mixed steps, and in fast mode) the backend returns paged_attention's rows, which the
    FP8 o_proj quantizes itself: the same bits as the kernel's quantized rows (GPU test below)."""
    _, args, rows = _step([30, 2], [0, 1], 2, torch.float32, 3)
    for mode in ("deterministic", "fast"):
        ops = Ops(mode, "cpu", torch.float32)
        for max_q_len in (1, None):
            kw = dict(max_q_len=max_q_len, max_kv_len=None)
            got = ops.paged_attention_fp8(*args, **kw)
            assert isinstance(got, torch.Tensor) and torch.equal(got, ops.paged_attention(*args, **kw))


# -- GPU: every bit, and a request's rows alone == inside a batch ------------------------------------------
@pytest.mark.gpu
@cuda
@settings(max_examples=40, deadline=None)
@given(case=_cases(), dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_gpu_quantized_rows_are_bitwise_and_batch_invariant(case, dtype):
    lengths, cached, group, schedule, seed = case
    runner, args, rows = _step(lengths, cached, group, dtype, seed, schedule=schedule)
    got = paged_attention_quantized(*args, split_size=SPLIT, schedule=schedule)
    assert _same(got, QuantizedRows.of(rows))
    # the first sequence's query rows alone (its own cache state, a one-sequence step)
    q, kc, vc, tables, kv_lens, cu, _ = args
    n0 = int(cu[1])
    alone = paged_attention_quantized(q[:n0], kc, vc, tables[:1], kv_lens[:1], cu[:2], SCALE, split_size=SPLIT,
                                      schedule="sequential" if schedule == "parallel" else "parallel")
    assert _same(alone, QuantizedRows(got.q[:n0], got.scale[:n0], dtype))
