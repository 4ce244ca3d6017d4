"""Backward of causal varlen attention with GQA (the training twin of `paged_attention`'s prefill path).

Packed layout: q [T, Hq, D], k, v [T, Hkv, D], sequences cut by cu_seqlens [S+1]; query i of a sequence
sees keys 0..i of the same sequence. Per sequence and kv head, the G = Hq / Hkv query heads are stacked
into one [G * L, D] block, and the recompute backward runs as matmuls in fp32:
    P = softmax(scale * Q K^T) (causal),  dV = P^T dO,  dP = dO V^T,  delta = rowsum(dO * O),
    dS = P * (dP - delta) * scale,  dQ = dS K,  dK = dS^T Q.
`attention_backward_ref` (CPU, fp64, any head_dim): every reduction is the invariant matmul
(`matmul_det`) or `fold_sum`, walking its axis in ascending order into one accumulator: dK / dV of a key
reduce over the G * L stacked queries in a fixed order (head-major, then query), with no atomics. Memory:
one [G * L, L] fp32 score block per kv head of one sequence at a time.

`attention_backward` (Triton, flash-style, no [L, L] matrix in memory) runs two kernels, each output
element owned by exactly one program, so no atomics and no order that depends on scheduling:
  * `_dq_kernel`, one program per (query tile, kv head): the group's query heads (up to the tile's rows)
    stacked head-major, each with BLOCK_M / heads rows, so a K/V tile is loaded once for the heads that
    share it. With the forward's row log-sum-exps given (`lse=`, what `paged_attention(lse_out=)` stores:
    the training forward passes them), it reads each row's; without, pass 1 walks the visible keys in
    ascending tiles to rebuild them and stores them for the dK/dV kernel. Then it accumulates
    dQ = sum_j dS_ij K_j over the keys in ascending tiles. A row's bits depend on the key step only, not on
    the query tile's height or its heads: key tiles past a row's diagonal add exact zeros.
  * `_dkv_kernel`, one program per (key tile, kv head): for g = 0..G-1 (heads of the group, in order),
    for query tiles from the key tile up to the sequence end (ascending), accumulates dV += P^T dO and
    dK += dS^T Q.
Both skip the causal `where` on tiles every row sees whole (same expressions otherwise: same bits). delta
comes from one launch (`attention_delta`) and the gradients are stored in q's dtype by the kernels.
Each kernel has its own tile shape (`tile_configs`: query rows x key rows, warps, stages). Query tiles are
anchored at each sequence's first token (dQ) or at the key tile (dK/dV), key tiles at the sequence's first
token, and the configs depend only on head_dim and dtype (the dQ heads per program on the model's group),
so a sequence's gradient bits do not depend on the other sequences of the training batch, nor on its
offset in the packing. Cost: 8 tile matmuls per (query tile, key tile) pair against FlashAttention-2's 5 (which
needs atomics for dQ), 7 with the forward's LSE: the split into two kernels is the price of a fixed order.
The forward's LSE and the recomputed one differ in their last bits (the forward sums the probabilities
rounded to the value dtype, in its own tile order), so the two give gradients equal within rounding, not
bitwise; either is deterministic and batch-invariant (the forward's LSE is, by its contract).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl

from detinfer.kernels._fold import fold_sum
from detinfer.kernels._launch import check_kernel_inputs, dot_precision, interpreting
from detinfer.kernels.attention_delta import attention_delta
from detinfer.kernels.linear_backward import matmul_det

__all__ = ["TileConfig", "attention_backward", "attention_backward_ref", "attention_forward_ref", "kernel_supports",
           "tile_configs"]


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _stack(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """[L, Hq, D] -> [Hkv, G * L, D]: the G query heads of each kv head stacked head-major."""
    length, hq, d = x.shape
    return x.reshape(length, hkv, hq // hkv, d).permute(1, 2, 0, 3).reshape(hkv, -1, d).contiguous()


def _unstack(x: torch.Tensor, length: int) -> torch.Tensor:
    """[Hkv, G * L, D] -> [L, Hq, D]."""
    hkv, gl, d = x.shape
    return x.reshape(hkv, gl // length, length, d).permute(2, 0, 1, 3).reshape(length, -1, d)


def _probs(qs: torch.Tensor, kt: torch.Tensor, length: int, scale: float) -> torch.Tensor:
    """Causal softmax(scale * Q K^T) of stacked queries qs [Hkv, G*L, D] and kt [Hkv, D, L]."""
    s = matmul_det(qs, kt) * scale  # [Hkv, G*L, L]
    qpos = torch.arange(s.shape[1], device=s.device) % length
    visible = torch.arange(length, device=s.device)[None, :] <= qpos[:, None]
    s = s.masked_fill(~visible, float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))  # every query sees key 0: the max is finite
    return p / fold_sum(p, -1, keepdim=True)


def attention_forward_ref(q, k, v, cu_seqlens: list[int], scale: float) -> torch.Tensor:
    """The math the backward differentiates (fp32 / fp64), for gradient checks."""
    out = torch.zeros_like(q, dtype=_acc(q.dtype))
    hkv = k.shape[1]
    for s0, s1 in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        if s1 == s0:
            continue
        length = s1 - s0
        acc = _acc(q.dtype)
        qs = _stack(q[s0:s1].to(acc), hkv)
        p = _probs(qs, k[s0:s1].to(acc).permute(1, 2, 0).contiguous(), length, scale)
        out[s0:s1] = _unstack(matmul_det(p, v[s0:s1].to(acc).permute(1, 0, 2).contiguous()), length)
    return out.to(q.dtype)


def attention_backward_ref(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           out: torch.Tensor, cu_seqlens: list[int], scale: float):
    """-> (dq, dk, dv) in the dtypes of q, k, v. `out` is the forward's output (for delta = rowsum(dO*O))."""
    acc = _acc(q.dtype)
    hkv = k.shape[1]
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    for s0, s1 in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        if s1 == s0:
            continue
        length = s1 - s0
        qs = _stack(q[s0:s1].to(acc), hkv)  # [Hkv, G*L, D]
        dos = _stack(dout[s0:s1].to(acc), hkv)
        os_ = _stack(out[s0:s1].to(acc), hkv)
        kh = k[s0:s1].to(acc).permute(1, 0, 2).contiguous()  # [Hkv, L, D]
        vh = v[s0:s1].to(acc).permute(1, 0, 2).contiguous()
        p = _probs(qs, kh.transpose(1, 2).contiguous(), length, scale)  # [Hkv, G*L, L]
        pt = p.transpose(1, 2).contiguous()  # [Hkv, L, G*L]
        dv[s0:s1] = matmul_det(pt, dos).permute(1, 0, 2)
        dp = matmul_det(dos, vh.transpose(1, 2).contiguous())  # [Hkv, G*L, L]
        delta = fold_sum(dos * os_, -1, keepdim=True)  # [Hkv, G*L, 1]
        ds = p * (dp - delta) * scale
        dq[s0:s1] = _unstack(matmul_det(ds, kh), length)
        dk[s0:s1] = matmul_det(ds.transpose(1, 2).contiguous(), qs).permute(1, 0, 2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ------------------------------------------------------------------------------------------ Triton path
def kernel_supports(head_dim: int) -> bool:
    """head_dims the Triton backward takes (a power of two >= 16: tl.dot and tl.arange need it)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and head_dim <= 256


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """One kernel's launch: BLOCK_M query rows and BLOCK_N key rows per tile, warps, pipeline stages.
    Part of the reduction order (the tiles' edges, the in-tile row reductions' layout), so chosen from
    head_dim and dtype only, never from the batch."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def tile_configs(head_dim: int, dtype: torch.dtype) -> tuple[TileConfig, TileConfig]:
    """(dQ kernel's, dK/dV kernel's) configs. 16-bit with head_dim <= 128 (measured on an H100 at Qwen3-8B
    shapes, 8 x 1024 tokens, 32/8 heads, D 128, docs/performance.md): dQ on 128 query rows x 32-key steps
    with 8 warps and 3 stages (1.06 ms against 1.42 for 64 x 64 with 8 warps), dK/dV on 64 keys x 64-query
    steps with 4 warps (0.57 ms against 0.97 with 8). A dK/dV kernel with 32-row query steps gave
    different bits on two identical runs there (triton 3.6), so query steps stay at 64. dQ's 128 rows
    were one head's then; they now stack the heads of a kv head (4 x 32 rows at Qwen3-8B). Larger head_dim:
    32-row tiles (register budget); fp32: 32-row tiles (exact fp32 dots)."""
    if dtype != torch.float32 and head_dim <= 128:
        return TileConfig(128, 32, 8, 3), TileConfig(64, 64, 4, 2)
    block = 32
    warps = 4
    return TileConfig(block, block, warps, 2), TileConfig(block, block, warps, 2)


@triton.jit
def _dq_step(dq, q, do, delta, lse, offs_m, row_ok, n0, seq1, k_ptr, v_ptr, kvh, stride_kt, stride_kh, stride_vt,
             stride_vh, scale_log2, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr,
             MASKED: tl.constexpr):
    """dq += dS K over one key tile. Unmasked tiles (every key <= every row's position) skip the masks:
    the same expressions up to exp2, so the same bits as with an all-true `where`."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k_off = offs_n[:, None].to(tl.int64) * stride_kt + kvh * stride_kh + offs_d[None, :]
    v_off = offs_n[:, None].to(tl.int64) * stride_vt + kvh * stride_vh + offs_d[None, :]
    if MASKED:
        n_ok = offs_n < seq1
        k = tl.load(k_ptr + k_off, mask=n_ok[:, None], other=0.0)
        v = tl.load(v_ptr + v_off, mask=n_ok[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + k_off)
        v = tl.load(v_ptr + v_off)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    p = tl.exp2(s - lse[:, None])
    if MASKED:
        p = tl.where((offs_n[None, :] <= offs_m[:, None]) & n_ok[None, :] & row_ok[:, None], p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)


@triton.jit
def _dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, delta_ptr, dq_ptr, lse_ptr, tile_start_ptr, tile_seq_end_ptr,
               tile_seq_start_ptr, num_q_heads, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
               stride_dot, stride_doh, stride_dqt, stride_dqh, scale_log2, scale,
               GROUP: tl.constexpr, HEADS: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr, HAS_LSE: tl.constexpr):
    """One program: HEADS query heads of one kv head x ROWS query rows, stacked head-major into one
    [BLOCK_M, D] block, so each K/V tile is loaded once for the heads that share it. HAS_LSE: lse_ptr
    holds the forward's row LSEs (read, pass 1 skipped); else pass 1 rebuilds and stores them."""
    tile = tl.program_id(0)
    h0 = tl.program_id(1) * HEADS
    kvh = h0 // GROUP
    q0 = tl.load(tile_start_ptr + tile)
    seq0 = tl.load(tile_seq_start_ptr + tile)
    seq1 = tl.load(tile_seq_end_ptr + tile)
    stacked = tl.arange(0, BLOCK_M)
    offs_m = q0 + stacked % ROWS  # the stacked row's token
    head = h0 + stacked // ROWS  # and its query head
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = (offs_m < seq1) & (stacked < HEADS * ROWS)
    q = tl.load(q_ptr + offs_m[:, None].to(tl.int64) * stride_qt + (head * stride_qh)[:, None] + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load(do_ptr + offs_m[:, None].to(tl.int64) * stride_dot + (head * stride_doh)[:, None]
                 + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    row_off = offs_m.to(tl.int64) * num_q_heads + head
    delta = tl.load(delta_ptr + row_off, mask=row_ok, other=0.0)
    end = tl.minimum(q0 + ROWS, seq1)
    # Key tiles [seq0, diag) are visible to every row of the tile; [diag, end) are partly masked.
    diag = seq0 + (q0 - seq0 + 1) // BLOCK_N * BLOCK_N
    if HAS_LSE:
        lse = tl.load(lse_ptr + row_off, mask=row_ok, other=0.0)
    else:
        m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for n0 in range(seq0, end, BLOCK_N):  # pass 1: log-sum-exp of each row, keys ascending
            offs_n = n0 + tl.arange(0, BLOCK_N)
            k = tl.load(k_ptr + offs_n[:, None].to(tl.int64) * stride_kt + kvh * stride_kh + offs_d[None, :],
                        mask=(offs_n < seq1)[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
            # Masked on every tile: without the `where`, fp fusion may turn `s - m` into an fma (new bits).
            vis = (offs_n[None, :] <= offs_m[:, None]) & (offs_n < seq1)[None, :]
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l = l * tl.exp2(m - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
            m = m_new
        lse = tl.where(row_ok, m + tl.log2(tl.where(l > 0, l, 1.0)), 0.0)
        tl.store(lse_ptr + row_off, lse, mask=row_ok)
    dq = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    for n0 in range(seq0, diag, BLOCK_N):  # pass 2: dQ, keys ascending
        dq = _dq_step(dq, q, do, delta, lse, offs_m, row_ok, n0, seq1, k_ptr, v_ptr, kvh, stride_kt, stride_kh,
                      stride_vt, stride_vh, scale_log2, BLOCK_N, HEAD_DIM, PRECISION, MASKED=False)
    for n0 in range(diag, end, BLOCK_N):
        dq = _dq_step(dq, q, do, delta, lse, offs_m, row_ok, n0, seq1, k_ptr, v_ptr, kvh, stride_kt, stride_kh,
                      stride_vt, stride_vh, scale_log2, BLOCK_N, HEAD_DIM, PRECISION, MASKED=True)
    dq = (dq * scale).to(dq_ptr.dtype.element_ty)  # the one rounding to the gradient dtype
    tl.store(dq_ptr + offs_m[:, None].to(tl.int64) * stride_dqt + (head * stride_dqh)[:, None] + offs_d[None, :],
             dq, mask=row_ok[:, None])


@triton.jit
def _dkv_step(dk, dv, k, v, offs_n, n_ok, m0, seq1, h, q_ptr, do_ptr, delta_ptr, lse_ptr, num_q_heads, stride_qt,
              stride_qh, stride_dot, stride_doh, scale_log2, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
              PRECISION: tl.constexpr, MASKED: tl.constexpr):
    """dV += P^T dO, dK += dS^T Q over one query tile. Unmasked tiles (every row past every key of the
    tile) skip the `where`: the same expressions up to exp2, so the same bits. Rows past the sequence end
    load zeros there (q = dO = lse = delta = 0: P = 1, dS = 0), so they add exact zeros to dK and dV."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_ok = offs_m < seq1
    row_off = offs_m.to(tl.int64) * num_q_heads + h
    q = tl.load(q_ptr + offs_m[:, None].to(tl.int64) * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_ok[:, None], other=0.0)
    do = tl.load(do_ptr + offs_m[:, None].to(tl.int64) * stride_dot + h * stride_doh + offs_d[None, :],
                 mask=m_ok[:, None], other=0.0)
    lse = tl.load(lse_ptr + row_off, mask=m_ok, other=0.0)
    delta = tl.load(delta_ptr + row_off, mask=m_ok, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BM, BN]
    p = tl.exp2(s - lse[:, None])
    if MASKED:
        p = tl.where((offs_n[None, :] <= offs_m[:, None]) & n_ok[None, :] & m_ok[:, None], p, 0.0)
    dv = tl.dot(tl.trans(p).to(do.dtype), do, dv, input_precision=PRECISION)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])
    dk = tl.dot(tl.trans(ds).to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _dkv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, delta_ptr, lse_ptr, dk_ptr, dv_ptr, tile_start_ptr,
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
    # Query tiles from k0, ascending: those before `seen` hold rows before the tile's last key (masked).
    seen = k0 + tl.cdiv(BLOCK_N - 1, BLOCK_M) * BLOCK_M
    for g in range(GROUP):  # the group's query heads in order
        h = kvh * GROUP + g
        for m0 in range(k0, tl.minimum(seen, seq1), BLOCK_M):
            dk, dv = _dkv_step(dk, dv, k, v, offs_n, n_ok, m0, seq1, h, q_ptr, do_ptr, delta_ptr, lse_ptr,
                               num_q_heads, stride_qt, stride_qh, stride_dot, stride_doh, scale_log2, BLOCK_M,
                               HEAD_DIM, PRECISION, MASKED=True)
        for m0 in range(seen, seq1, BLOCK_M):
            dk, dv = _dkv_step(dk, dv, k, v, offs_n, n_ok, m0, seq1, h, q_ptr, do_ptr, delta_ptr, lse_ptr,
                               num_q_heads, stride_qt, stride_qh, stride_dot, stride_doh, scale_log2, BLOCK_M,
                               HEAD_DIM, PRECISION, MASKED=False)
    dk = (dk * scale).to(dk_ptr.dtype.element_ty)  # the one rounding to the gradient dtype
    tl.store(dk_ptr + offs_n[:, None].to(tl.int64) * stride_dkt + kvh * stride_dkh + offs_d[None, :], dk,
             mask=n_ok[:, None])
    tl.store(dv_ptr + offs_n[:, None].to(tl.int64) * stride_dvt + kvh * stride_dvh + offs_d[None, :],
             dv.to(dv_ptr.dtype.element_ty), mask=n_ok[:, None])


def _heads_per_dq_program(group: int, block_m: int) -> int:
    """Query heads stacked in one dQ program: the largest divisor of the group that fits the tile, so a
    program's heads share one kv head and each has block_m // heads rows (a model-shape constant)."""
    return max(h for h in range(1, min(group, block_m) + 1) if group % h == 0)


def _tiles(cu_seqlens: list[int], block: int, device, heavy_first: str | None = None):
    """Per tile: its first token, its sequence's first token and end (tiles anchored at sequence starts).
    Every layer of a training step packs the same sequences: the tables are built and uploaded once per
    (packing, tile height, device), not once per layer and kernel (read-only on the device).
    `heavy_first`: "queries" (dQ: a tile walks the keys before it) or "keys" (dK/dV: the queries after it)
    lists the tiles by that walk's length, longest first, so the longest programs start in the first waves
    and the last wave holds short ones (a shorter tail on the GPU). Each program computes the same tile
    whatever its index, so the order changes no bit; None keeps the packing order."""
    return _tile_tables(tuple(cu_seqlens), block, torch.device(device), heavy_first)


@functools.lru_cache(maxsize=16)
def _tile_tables(cu_seqlens: tuple[int, ...], block: int, device: torch.device, heavy_first: str | None):
    tiles = [(t, a, b) for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]) for t in range(a, b, block)]
    if heavy_first is not None:  # a stable sort: ties keep the packing order
        tiles.sort(key={"queries": lambda x: x[1] - x[0], "keys": lambda x: x[0] - x[2]}[heavy_first])
    start, seq0, seq1 = ([x[i] for x in tiles] for i in range(3))
    as_t = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    return as_t(start), as_t(seq0), as_t(seq1)


def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, cu_seqlens: list[int], scale: float,
                       configs: tuple[TileConfig, TileConfig] | None = None, lse: torch.Tensor | None = None):
    """Triton flash-style backward (see the module doc) -> (dq, dk, dv) in the dtypes of q, k, v.
    `configs` overrides `tile_configs` (tests: other tile shapes keep every property). `lse`: the forward's
    row log-sum-exps, fp32 [T, Hq] in log2 units of the scaled scores (`paged_attention(lse_out=)`), read
    instead of recomputed; None recomputes them (pass 1)."""
    return _backward(dout, q, k, v, out, cu_seqlens, scale, configs, lse, grad_dtype=None)


def _backward(dout, q, k, v, out, cu_seqlens, scale, configs, lse, grad_dtype: torch.dtype | None):
    """`attention_backward` with the gradients stored in `grad_dtype` (None: q's dtype). The kernels round
    each fp32 accumulator once, at the store, so fp32 gradients cast afterwards have the same bits (tests)."""
    op = "attention_backward"
    check_kernel_inputs(op, dout, q, k, v, out)
    t, hq, d = q.shape
    hkv = k.shape[1]
    if not kernel_supports(d) or hq % hkv or k.shape != v.shape or dout.shape != q.shape \
            or out.shape != q.shape or k.shape[0] != t:
        raise ValueError(f"{op}: need q, dout, out [T, Hq, D], k, v [T, Hkv, D], Hq % Hkv == 0, D a power "
                         f"of two in [16, 256]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if len({q.dtype, k.dtype, v.dtype, dout.dtype}) != 1:
        raise TypeError(f"{op}: q, k, v, dout must share one dtype")
    if any(x.stride(-1) != 1 for x in (q, k, v, dout)):
        q, k, v, dout = (x.contiguous() for x in (q, k, v, dout))
    group = hq // hkv
    has_lse = lse is not None
    if has_lse and (not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32
                    or tuple(lse.shape) != (t, hq) or lse.device != q.device):
        raise ValueError(f"{op}: lse must be a torch.float32 tensor of shape {(t, hq)} on {q.device} (the "
                         f"forward's lse_out), got {getattr(lse, 'dtype', type(lse).__name__)} "
                         f"{tuple(getattr(lse, 'shape', ()))}")
    delta = attention_delta(dout, out)  # [T, Hq] fp32: rowsum(dO * O), fold_sum's order, one launch
    grad_dtype = grad_dtype or q.dtype  # stored by the kernels: no fp32 buffers, no cast passes
    dq = torch.empty((t, hq, d), dtype=grad_dtype, device=q.device)
    dk = torch.empty((t, hkv, d), dtype=grad_dtype, device=q.device)
    dv = torch.empty((t, hkv, d), dtype=grad_dtype, device=q.device)
    lse = lse.contiguous() if has_lse else torch.empty((t, hq), dtype=torch.float32, device=q.device)
    dq_cfg, dkv_cfg = configs or tile_configs(d, q.dtype)
    if interpreting():  # Triton's CPU interpreter runs one warp layout: a cheaper launch, same numerics
        dq_cfg, dkv_cfg = (dataclasses.replace(c, num_warps=4) for c in (dq_cfg, dkv_cfg))
    precision = dot_precision(q.dtype)
    scale_log2 = scale * math.log2(math.e)
    heads = _heads_per_dq_program(group, dq_cfg.block_m)
    rows = dq_cfg.block_m // heads
    q_tiles = _tiles(cu_seqlens, rows, q.device, heavy_first="queries")
    if q_tiles[0].shape[0] == 0:
        return dq, dk, dv
    tile_start, tile_seq0, tile_seq1 = q_tiles
    _dq_kernel[(tile_start.shape[0], hq // heads)](
        q, k, v, dout, delta, dq, lse, tile_start, tile_seq1, tile_seq0, hq,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1), scale_log2, scale,
        GROUP=group, HEADS=heads, ROWS=rows, BLOCK_M=dq_cfg.block_m, BLOCK_N=dq_cfg.block_n, HEAD_DIM=d,
        PRECISION=precision, HAS_LSE=has_lse, num_warps=dq_cfg.num_warps, num_stages=dq_cfg.num_stages)
    tile_start, _, tile_seq1 = _tiles(cu_seqlens, dkv_cfg.block_n, q.device, heavy_first="keys")
    _dkv_kernel[(tile_start.shape[0], hkv)](
        q, k, v, dout, delta, lse, dk, dv, tile_start, tile_seq1, hq,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dout.stride(0), dout.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), scale_log2, scale,
        GROUP=group, BLOCK_M=dkv_cfg.block_m, BLOCK_N=dkv_cfg.block_n, HEAD_DIM=d, PRECISION=precision,
        num_warps=dkv_cfg.num_warps, num_stages=dkv_cfg.num_stages)
    return dq, dk, dv
