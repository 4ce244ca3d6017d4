"""Bad input to paged/contiguous attention: clear errors at the boundary, and no out-of-bounds access when
value checks are off (NaN-poisoned pool: a stray read would show)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from detinfer.kernels.attention import attention_contiguous, paged_attention, paged_attention_fast

# Sibling helper modules: the suite runs with --import-mode=importlib, which does not put test
# folders on sys.path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_attention_scenarios import DEV, PagedRunner, make_seqs, whole_plan  # noqa: E402

SCALE = 0.125


@pytest.fixture(scope="module")
def step():
    """A valid step over two sequences (lengths 32 = two full blocks, and 3) in a NaN-poisoned pool."""
    seqs = make_seqs([32, 3], 4, 2, 64, torch.float32, seed=0)
    runner = PagedRunner(seqs, spare_blocks=4)
    runner.run(whole_plan([32, 3]), SCALE)
    st = runner.last_step
    return dict(q=st["q"], k=runner.k_cache, v=runner.v_cache, bt=st["block_tables"], kv=st["kv_lens"],
                cu=st["cu_q_lens"])


def call(s, fn=paged_attention, **over):
    a = dict(s, **{k: v for k, v in over.items() if k in s})
    kw = {k: v for k, v in over.items() if k not in s}
    return fn(a["q"], a["k"], a["v"], a["bt"], a["kv"], a["cu"], kw.pop("scale", SCALE), **kw)


@pytest.mark.parametrize("fn", [paged_attention, paged_attention_fast])
def test_shape_dtype_and_config_errors(step, fn):
    s = step
    cases = [
        (dict(q=s["q"][:, :3]), ValueError, "not a multiple"),  # 3 query heads over 2 kv heads
        (dict(q=torch.zeros(23, 4, 32, device=DEV), k=torch.zeros(8, 16, 2, 32, device=DEV),
              v=torch.zeros(8, 16, 2, 32, device=DEV)), ValueError, "head_dim 32 is not supported"),
        (dict(q=s["q"][..., :32]), ValueError, "head_dim mismatch"),
        (dict(q=s["q"].half()), TypeError, "one dtype"),
        (dict(q=s["q"].double(), k=s["k"].double(), v=s["v"].double()), TypeError, "not supported"),
        (dict(kv=s["kv"].long()), TypeError, "int32"),
        (dict(cu=s["cu"][:2]), ValueError, "cu_q_lens"),
        (dict(bt=s["bt"][:1]), ValueError, "block_tables"),
        (dict(v=s["v"][:, :8]), ValueError, "k_cache and v_cache"),
        (dict(q=s["q"][0]), ValueError, r"\[T, Hq, D\]"),
        (dict(scale=0.0), ValueError, "scale"),
        (dict(scale=float("nan")), ValueError, "scale"),
        (dict(sliding_window=0), ValueError, "sliding_window"),
        (dict(max_kv_len=1000), ValueError, "block table too short"),
        (dict(schedule="fastest"), ValueError, "schedule"),
        (dict(out=torch.zeros(3, device=DEV)), ValueError, "out must be"),
    ]
    if fn is paged_attention:
        cases.append((dict(split_size=100), ValueError, "split_size"))
    for over, exc, match in cases:
        with pytest.raises(exc, match=match):
            call(s, fn=fn, **over)


def test_value_errors_need_validation(step):
    s = step
    too_long = s["kv"].clone()
    too_long[0] = 40  # needs 3 blocks of 16, the table has 2
    with pytest.raises(ValueError, match="block table too short"):
        call(s, kv=too_long)
    short = s["kv"].clone()
    short[1] = 2  # 3 new tokens but only 2 keys
    with pytest.raises(ValueError, match="q_len 3 > kv_len 2"):
        call(s, kv=short)
    bad_table = s["bt"].clone()
    bad_table[0, 0] = 10_000
    with pytest.raises(ValueError, match="outside"):
        call(s, bt=bad_table)
    with pytest.raises(ValueError, match="max_kv_len"):
        call(s, max_kv_len=31)


def test_no_out_of_bounds_reads_without_validation(step):
    """With validation off, bad metadata gives wrong numbers for the bad sequence only, never a read
    outside the pool or past kv_len: the NaN-poisoned unused blocks must not leak into any output."""
    s = step
    good = call(s)
    bad_table = s["bt"].clone()
    bad_table[0, 1] = 10_000  # outside the pool
    bad_table[0, 0] = -7
    out = call(s, bt=bad_table, validate=False)
    assert not torch.isnan(out).any()
    assert torch.equal(out[32:], good[32:]), "the other sequence must not change"
    too_long = s["kv"].clone()
    too_long[0] = 48  # keys 32..47 lie past the table's two blocks: never read
    out = call(s, kv=too_long, validate=False)
    assert not torch.isnan(out).any() and torch.equal(out[32:], good[32:])
    # Control: a NaN key that IS read (an unwritten slot of a table block) does show up in the output.
    holes = s["kv"].clone()
    holes[1] = 5  # sequence 1's block holds 3 written keys; slots 3, 4 are NaN poison
    assert torch.isnan(call(s, kv=holes, validate=False)[32:]).any()


def test_contiguous_errors():
    q = torch.zeros(2, 4, 3, 64, device=DEV)
    k = torch.zeros(2, 2, 5, 64, device=DEV)
    starts = torch.zeros(2, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="at least Lq"):
        attention_contiguous(q, k[:, :, :2], k[:, :, :2], starts, SCALE)
    with pytest.raises(ValueError, match="key_start"):
        attention_contiguous(q, k, k, starts.long(), SCALE)
    with pytest.raises(ValueError, match="key_start values"):
        attention_contiguous(q, k, k, torch.tensor([0, 6], dtype=torch.int32, device=DEV), SCALE)
    with pytest.raises(ValueError, match="not a multiple"):
        attention_contiguous(q[:, :3], k, k, starts, SCALE)
    with pytest.raises(ValueError, match=r"\[B, Hq, Lq, D\]"):
        attention_contiguous(q[0], k, k, starts, SCALE)
