"""The Triton attention backward's kernels, against their earlier forms (bitwise):

* the gradients are stored by the kernels in the gradient dtype, one rounding of the fp32 accumulators:
  the same bits as storing fp32 and casting afterwards (interpreter: fp32 inputs, fp16 stores, which numpy
  rounds like torch; GPU: bf16 at Qwen3-8B's shape).
* the dK/dV kernel, which skips the causal mask on query tiles past the key tile's diagonal, gives
  the bits of the previous all-masked kernel (`_masked_dkv_kernel` below);
* the dQ kernel, whose program stacks the query heads of one kv head, gives each row the bits of the
  previous per-head kernel (copied below as `_per_head_dq_kernel`): same key tiles, ascending from the
  sequence start, same key step; key tiles past a row's diagonal added exact zeros there; the masks
  are skipped only on tiles that every row sees whole (fp32 in the interpreter, GROUP 1, 2, 4, ragged);
* both kernels launch their tiles longest walk first (a permutation of the packing order).
GPU (marker gpu): bf16 at Qwen3-8B's shape with the shipped configs: the same bits as fp32 gradients
cast afterwards, repeatable, each sequence independent of its packing.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.kernels._fold import fold_sum
from detinfer.kernels._launch import dot_precision
from detinfer.kernels.attention_backward import (
    TileConfig,
    _backward,
    _tiles,
    attention_backward,
    attention_forward_ref,
    tile_configs,
)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FEW = max(3, settings.default.max_examples // 3)  # each example is several interpreter launches


def _cu(lens: list[int]) -> list[int]:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def _inputs(lens, hq, hkv, d, dtype, seed):
    cu = _cu(lens)
    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(cu[-1], hq, d, generator=g).to(dtype).to(DEV) for _ in range(2))
    k, v = (torch.randn(cu[-1], hkv, d, generator=g).to(dtype).to(DEV) for _ in range(2))
    out = attention_forward_ref(q, k, v, cu, d ** -0.5)
    return (do, q, k, v, out), cu


def _lse(q, k, cu, scale):
    """Row log-sum-exps [T, Hq] in log2 units of the scaled scores (what `lse=` takes), in float64."""
    lse = torch.empty(q.shape[:2], dtype=torch.float64, device=q.device)
    group = q.shape[1] // k.shape[1]
    for s0, s1 in zip(cu[:-1], cu[1:]):
        kk = k[s0:s1].double().repeat_interleave(group, 1)  # [L, Hq, D]
        s = torch.einsum("qhd,khd->hqk", q[s0:s1].double(), kk) * scale
        s = s.masked_fill(torch.ones(s1 - s0, s1 - s0, device=q.device).triu(1).bool(), float("-inf"))
        lse[s0:s1] = (torch.logsumexp(s, -1) / torch.log(torch.tensor(2.0))).T
    return lse.float().to(q.device)


@settings(max_examples=FEW)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=3), st.sampled_from([(2, 1), (4, 2), (4, 4)]),
       st.booleans(), st.integers(0, 1000))
def test_grads_stored_in_grad_dtype_equal_fp32_then_cast(lens, heads, with_lse, seed):
    (do, q, k, v, out), cu = _inputs(lens, *heads, 16, torch.float32, seed)
    lse = _lse(q, k, cu, 0.25) if with_lse else None  # the read path, or the recompute path
    wide = _backward(do, q, k, v, out, cu, 0.25, None, lse, grad_dtype=torch.float32)
    narrow = _backward(do, q, k, v, out, cu, 0.25, None, lse, grad_dtype=torch.float16)
    assert all(n.dtype == torch.float16 and torch.equal(n, w.half()) for n, w in zip(narrow, wide))
    assert all(torch.equal(a, w) for a, w in zip(attention_backward(do, q, k, v, out, cu, 0.25, lse=lse), wide))


@pytest.mark.gpu
def test_bf16_grads_equal_fp32_then_cast():
    (do, q, k, v, out), cu = _inputs([1024, 1024, 517], 32, 8, 128, torch.bfloat16, 3)
    wide = _backward(do, q, k, v, out, cu, 128 ** -0.5, None, None, grad_dtype=torch.float32)
    got = attention_backward(do, q, k, v, out, cu, 128 ** -0.5)
    assert all(a.dtype == torch.bfloat16 and torch.equal(a, w.bfloat16()) for a, w in zip(got, wide))


# The dQ kernel before the heads of a group were stacked into one program: one program per
# (query tile, query head), fp32 output.
@triton.jit
def _per_head_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, delta_ptr, dq_ptr, lse_ptr, tile_start_ptr, tile_seq_end_ptr,
               tile_seq_start_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
               stride_dot, stride_doh, stride_dqt, stride_dqh, scale_log2, scale,
               GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
               PRECISION: tl.constexpr, HAS_LSE: tl.constexpr):
    """HAS_LSE: lse_ptr holds the forward's row LSEs (read, pass 1 skipped); else pass 1 rebuilds and
    stores them for `_dkv_kernel`."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    q0 = tl.load(tile_start_ptr + tile)
    seq0 = tl.load(tile_seq_start_ptr + tile)
    seq1 = tl.load(tile_seq_end_ptr + tile)
    offs_m = q0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seq1
    q = tl.load(q_ptr + offs_m[:, None].to(tl.int64) * stride_qt + h * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load(do_ptr + offs_m[:, None].to(tl.int64) * stride_dot + h * stride_doh + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0)
    delta = tl.load(delta_ptr + offs_m.to(tl.int64) * tl.num_programs(1) + h, mask=row_ok, other=0.0)
    end = tl.minimum(q0 + BLOCK_M, seq1)
    lse_off = offs_m.to(tl.int64) * tl.num_programs(1) + h
    if HAS_LSE:
        lse = tl.load(lse_ptr + lse_off, mask=row_ok, other=0.0)
    else:
        m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for n0 in range(seq0, end, BLOCK_N):  # pass 1: log-sum-exp of each row, keys ascending
            offs_n = n0 + tl.arange(0, BLOCK_N)
            k = tl.load(k_ptr + offs_n[:, None].to(tl.int64) * stride_kt + kvh * stride_kh + offs_d[None, :],
                        mask=(offs_n < seq1)[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
            vis = (offs_n[None, :] <= offs_m[:, None]) & (offs_n < seq1)[None, :]
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l = l * tl.exp2(m - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
            m = m_new
        lse = tl.where(row_ok, m + tl.log2(tl.where(l > 0, l, 1.0)), 0.0)
    dq = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    for n0 in range(seq0, end, BLOCK_N):  # pass 2: dQ, keys ascending
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < seq1
        k = tl.load(k_ptr + offs_n[:, None].to(tl.int64) * stride_kt + kvh * stride_kh + offs_d[None, :],
                    mask=n_ok[:, None], other=0.0)
        v = tl.load(v_ptr + offs_n[:, None].to(tl.int64) * stride_vt + kvh * stride_vh + offs_d[None, :],
                    mask=n_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        vis = (offs_n[None, :] <= offs_m[:, None]) & n_ok[None, :] & row_ok[:, None]
        p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    dq = dq * scale
    tl.store(dq_ptr + offs_m[:, None].to(tl.int64) * stride_dqt + h * stride_dqh + offs_d[None, :], dq,
             mask=row_ok[:, None])
    if not HAS_LSE:
        tl.store(lse_ptr + lse_off, lse, mask=row_ok)


# The dK/dV kernel before the masks were skipped on tiles every row sees whole (fp32 output).
@triton.jit
def _masked_dkv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, delta_ptr, lse_ptr, dk_ptr, dv_ptr, tile_start_ptr,
                tile_seq_end_ptr, num_q_heads, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, scale_log2, scale,
                GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    k0 = tl.load(tile_start_ptr + tile)
    seq1 = tl.load(tile_seq_end_ptr + tile)
    offs_n = k0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    n_ok = offs_n < seq1
    k = tl.load(k_ptr + offs_n[:, None].to(tl.int64) * stride_kt + kvh * stride_kh + offs_d[None, :],
                mask=n_ok[:, None], other=0.0)
    v = tl.load(v_ptr + offs_n[:, None].to(tl.int64) * stride_vt + kvh * stride_vh + offs_d[None, :],
                mask=n_ok[:, None], other=0.0)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    for g in range(GROUP):  # the group's query heads in order
        h = kvh * GROUP + g
        for m0 in range(k0, seq1, BLOCK_M):  # query tiles that can see this key tile, ascending
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_ok = offs_m < seq1
            q = tl.load(q_ptr + offs_m[:, None].to(tl.int64) * stride_qt + h * stride_qh + offs_d[None, :],
                        mask=m_ok[:, None], other=0.0)
            do = tl.load(do_ptr + offs_m[:, None].to(tl.int64) * stride_dot + h * stride_doh + offs_d[None, :],
                         mask=m_ok[:, None], other=0.0)
            lse = tl.load(lse_ptr + offs_m.to(tl.int64) * num_q_heads + h, mask=m_ok, other=0.0)
            delta = tl.load(delta_ptr + offs_m.to(tl.int64) * num_q_heads + h, mask=m_ok, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BM, BN]
            vis = (offs_n[None, :] <= offs_m[:, None]) & n_ok[None, :] & m_ok[:, None]
            p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)
            dv = tl.dot(tl.trans(p).to(do.dtype), do, dv, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dk = tl.dot(tl.trans(ds).to(q.dtype), q, dk, input_precision=PRECISION)
    dk = dk * scale
    tl.store(dk_ptr + offs_n[:, None].to(tl.int64) * stride_dkt + kvh * stride_dkh + offs_d[None, :], dk,
             mask=n_ok[:, None])
    tl.store(dv_ptr + offs_n[:, None].to(tl.int64) * stride_dvt + kvh * stride_dvh + offs_d[None, :], dv,
             mask=n_ok[:, None])


def _per_head_dq(do, q, k, v, out, cu, scale, cfg: TileConfig, lse):
    """-> (dq fp32, lse) of the per-head kernel; `lse` None recomputes the LSEs (returned)."""
    t, hq, d = q.shape
    delta = fold_sum(do.float() * out.float(), -1).contiguous()
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    has_lse = lse is not None
    lse = lse if has_lse else torch.empty((t, hq), dtype=torch.float32, device=q.device)
    tile_start, tile_seq0, tile_seq1 = _tiles(cu, cfg.block_m, q.device)
    _per_head_dq_kernel[(tile_start.shape[0], hq)](
        q, k, v, do, delta, dq, lse, tile_start, tile_seq1, tile_seq0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        do.stride(0), do.stride(1), dq.stride(0), dq.stride(1), scale * math.log2(math.e), scale,
        GROUP=hq // k.shape[1], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=d,
        PRECISION=dot_precision(q.dtype), HAS_LSE=has_lse, num_warps=4, num_stages=cfg.num_stages)
    return dq, lse


@settings(max_examples=FEW)
@given(st.lists(st.integers(1, 70), min_size=1, max_size=4), st.sampled_from([1, 2, 4]), st.integers(1, 2),
       st.sampled_from([(32, 32), (32, 16), (16, 32), (64, 16)]), st.booleans(), st.integers(0, 1000))
def test_stacked_dq_equals_per_head_dq_bitwise(lens, group, hkv, blocks, with_lse, seed):
    (do, q, k, v, out), cu = _inputs(lens, group * hkv, hkv, 16, torch.float32, seed)
    cfg = TileConfig(*blocks, 4, 2)
    lse = _lse(q, k, cu, 0.25) if with_lse else None
    want, want_lse = _per_head_dq(do, q, k, v, out, cu, 0.25, cfg, lse)
    got = _backward(do, q, k, v, out, cu, 0.25, (cfg, tile_configs(16, q.dtype)[1]), lse, grad_dtype=None)[0]
    assert torch.equal(got, want)
    if not with_lse:  # the recomputed LSEs the dK/dV kernel reads: check them through a second call
        assert torch.equal(_backward(do, q, k, v, out, cu, 0.25, (cfg, cfg), want_lse, grad_dtype=None)[0], got)


@settings(max_examples=FEW)
@given(st.lists(st.integers(1, 70), min_size=1, max_size=4), st.sampled_from([1, 2, 4]), st.integers(1, 2),
       st.sampled_from([(32, 32), (32, 16), (16, 32), (16, 64)]), st.integers(0, 1000))
def test_dkv_without_interior_masks_equals_masked_kernel_bitwise(lens, group, hkv, blocks, seed):
    (do, q, k, v, out), cu = _inputs(lens, group * hkv, hkv, 16, torch.float32, seed)
    cfg = TileConfig(*blocks, 4, 2)
    lse = _lse(q, k, cu, 0.25)
    _, dk, dv = _backward(do, q, k, v, out, cu, 0.25, (cfg, cfg), lse, grad_dtype=None)
    delta = fold_sum(do.float() * out.float(), -1).contiguous()
    want_dk, want_dv = torch.empty_like(dk), torch.empty_like(dv)
    tile_start, _, tile_seq1 = _tiles(cu, cfg.block_n, DEV)
    _masked_dkv_kernel[(tile_start.shape[0], hkv)](
        q, k, v, do, delta, lse, want_dk, want_dv, tile_start, tile_seq1, q.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0),
        do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), 0.25 * math.log2(math.e), 0.25,
        GROUP=group, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=16, PRECISION=dot_precision(q.dtype),
        num_warps=4, num_stages=2)
    assert torch.equal(dk, want_dk) and torch.equal(dv, want_dv)


@pytest.mark.gpu
@pytest.mark.parametrize("with_lse", [False, True])
def test_bf16_shipped_configs_repeat_and_are_packing_independent(with_lse):
    lens, scale = [1024, 1024, 517, 300], 128 ** -0.5
    (do, q, k, v, out), cu = _inputs(lens, 32, 8, 128, torch.bfloat16, 7)
    lse = _lse(q, k, cu, scale) if with_lse else None
    got = attention_backward(do, q, k, v, out, cu, scale, lse=lse)
    for _ in range(5):
        assert all(torch.equal(a, b) for a, b in zip(got, attention_backward(do, q, k, v, out, cu, scale, lse=lse)))
    for s0, s1 in zip(cu[:-1], cu[1:]):
        one = (x[s0:s1] for x in (do, q, k, v, out))
        alone = attention_backward(*one, [0, s1 - s0], scale, lse=None if lse is None else lse[s0:s1].contiguous())
        assert all(torch.equal(a[s0:s1], b) for a, b in zip(got, alone))


@given(st.lists(st.integers(0, 200), min_size=1, max_size=6), st.sampled_from([16, 32, 64]))
def test_tile_tables_longest_walk_first_same_tiles(lens, block):
    """The launch order lists every tile of the packing order once, the longest walk first (dQ: the keys
    before the tile; dK/dV: the queries from it to the sequence end)."""
    cu = _cu(lens)
    plain = set(zip(*(x.tolist() for x in _tiles(cu, block, "cpu"))))
    for heavy_first, walk in (("queries", lambda t, a, b: t - a), ("keys", lambda t, a, b: b - t)):
        tiles = list(zip(*(x.tolist() for x in _tiles(cu, block, "cpu", heavy_first))))
        assert len(tiles) == len(plain) and set(tiles) == plain
        walks = [walk(*x) for x in tiles]
        assert walks == sorted(walks, reverse=True)
