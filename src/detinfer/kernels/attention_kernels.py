"""Triton kernels behind `attention.py`: one attention core for prefill, chunked prefill and decode.

The invariance argument (what makes a query's bits independent of everything but its own keys):

* Keys are cut into splits of `split_size` keys anchored at key 0 of the sequence, and each split into
  tiles of BLOCK_N keys anchored at the split start. A split's partial (running max m, sum l, unnormalized
  output o) is an online softmax over its tiles in key order. Partials are chained left to right with
  `_merge`, one definition used everywhere.
* "Sequential" programs walk all tiles of all splits of a query tile in one flat loop, merging at each
  split boundary; "split-parallel" programs compute one split (or several consecutive ones, each
  started fresh and stored on its own) into a workspace and `_merge_splits_kernel` chains them. All run
  the same `_tile_step`, so the per-split arithmetic and the chain are the same; which one runs is a
  speed choice.
* Every sum over keys goes through a dot: QK^T reduces over head_dim, PV over the BLOCK_N keys of a tile,
  and the softmax denominator is also a dot (p @ ones) rather than `tl.sum`, because `tl.sum`'s tree
  follows the register layout, which changes with BLOCK_M and num_warps; a dot row's bits do not (checked
  on the GPU by the tests). The row max is exact in any order.
* A key that a query must not see gets score -inf, weight exactly 0 and (when it is past the sequence)
  value 0, so tiles or splits that are fully masked for a row are exact identities: alpha is forced to 1
  when the max does not move and a merge with an empty partial (-inf, 0, 0) returns the other side.
  Hence a query gets the same bits whether extra masked tiles/splits run (prefill tiles hold several
  queries) or not (decode), and whichever other rows share its tile.
* The row log-sum-exp (STORE_LSE, paged launches: the training forward's, for the attention backward) is
  M + log2(L) of the chain's final (M, L), stored where the output is normalized (sequential programs or
  `_merge_splits_kernel`), so it inherits every invariance above; STORE_LSE=False compiles it out.
* No fma contraction is left to the compiler: mul-adds that matter are explicit `tl.fma`, and launches
  pass enable_fp_fusion=False, so every kernel variant evaluates the same expressions the same way.

Under Triton's CPU interpreter tl.dot is numpy/BLAS, whose row results depend on the row's position and
the block height; FIXED_ORDER_DOT swaps in a broadcast multiply + sum with an order fixed by the shape
alone, so the CPU tests check the same invariance the GPU gets from its matrix units.
"""

from __future__ import annotations

import triton
import triton.language as tl

from detinfer.kernels._pdl import pdl_start
from detinfer.kernels.fp8_tiles import quantize_tile

# Columns of the ones-matrix that turns the softmax denominator into a dot. 32, not the minimal 16: with
# N = 16 the compiler picks another warp layout for this dot than for P @ V and converts P twice
# (measured +65 registers per thread on the 16-row decode tile, sm_90).
L_COLS = tl.constexpr(32)
# What a program does where its key range crosses a split boundary (see _tile_step).
NO_BOUNDARY = tl.constexpr(0)
CHAIN = tl.constexpr(1)
STORE = tl.constexpr(2)
SEQ_CHUNK = tl.constexpr(256)
MERGE_STAGES = tl.constexpr(6)  # partials in flight per merge program (8 KB each at 16 rows x 128 dims)


@triton.jit
def _merge(m_a, l_a, o_a, m_b, l_b, o_b):
    """Chain partial b after partial a: (max, denominator, unnormalized output), log2 units.

    Exact identity when either side is empty (m = -inf, l = 0, o = 0): its coefficient is
    exp2(-inf) = 0 and the other side's is forced to exactly 1.
    """
    m = tl.maximum(m_a, m_b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # keeps -inf - -inf (NaN) out of the unused branch
    c_a = tl.where(m_a == m, 1.0, tl.exp2(m_a - m_safe))
    c_b = tl.where(m_b == m, 1.0, tl.exp2(m_b - m_safe))
    l = tl.fma(l_a, c_a, l_b * c_b)
    o = tl.fma(o_a, c_a[:, None], o_b * c_b[:, None])
    return m, l, o


@triton.jit
def _store_partial(ws_o_ptr, ws_ml_ptr, w_row, row_ok, m, l, o, HEAD_DIM: tl.constexpr):
    """Workspace rows [token, q head, split]: o is [.., HEAD_DIM] fp32, ml is [.., 2] = (m, l)."""
    d = tl.arange(0, HEAD_DIM)
    tl.store(ws_o_ptr + w_row[:, None] * HEAD_DIM + d[None, :], o, mask=row_ok[:, None])
    tl.store(ws_ml_ptr + w_row * 2, m, mask=row_ok)
    tl.store(ws_ml_ptr + w_row * 2 + 1, l, mask=row_ok)


@triton.jit
def _finalize(l, o):
    """Normalize; rows that saw no key (only possible for padding rows) give 0, not 0/0. A NaN (a NaN
    key or value was read) still propagates."""
    safe_l = tl.where(l == 0.0, 1.0, l)
    return tl.where(l[:, None] == 0.0, 0.0, o / safe_l[:, None])


@triton.jit
def _store_out(out_ptr, q8_ptr, s8_ptr, o_off, s_off, d, row_ok, L, O, QUANT: tl.constexpr):
    """The sequential programs' normalized rows rounded to the output dtype, stored; or (QUANT, head_dim 128: an
    FP8 o_proj reads them) quantized as `quantize_activations` quantizes those stored rows, one (token, head)
    row being one 128-wide activation group: fp8 values at the output's offsets in q8, the row's fp32 scale
    at s8[s_off]. The same rounding, then the same `quantize_tile`: the bits of quantizing the 16-bit output.
    (`_merge_splits_kernel` does not quantize: kernels/attention_quant.py says why.)"""
    out = _finalize(L, O).to(out_ptr.dtype.element_ty)
    if QUANT:
        q, scale = quantize_tile(out.to(tl.float32))
        tl.store(q8_ptr + o_off[:, None] + d[None, :], q, mask=row_ok[:, None])
        tl.store(s8_ptr + s_off, scale, mask=row_ok)
    else:
        tl.store(out_ptr + o_off[:, None] + d[None, :], out, mask=row_ok[:, None])


@triton.jit
def _store_lse(lse_ptr, token, head, num_q_heads, row_ok, m, l):
    """Row log-sum-exp in log2 units of the scaled scores, lse = m + log2(l), at lse[token, head] ([T, Hq]
    fp32): what the attention backward needs for p = exp2(s * qk_scale - lse). A row that saw no key
    (l == 0) stores -inf."""
    lse = tl.where(l > 0.0, m + tl.log2(tl.where(l > 0.0, l, 1.0)), float("-inf"))
    tl.store(lse_ptr + token.to(tl.int64) * num_q_heads + head, lse, mask=row_ok)


@triton.jit
def _tile_step(start, t_start, q, pos, M, L, O, m_i, l_acc, acc, blk_next, ones, split_size, window, qk_scale,
               k_ptr, v_ptr, seq, kvh, kv_len, key_start, bt_row, max_blocks, num_blocks, block_size,
               stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, ws_o_ptr, ws_ml_ptr, w_row,
               row_ok, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
               PAGED: tl.constexpr, HAS_WINDOW: tl.constexpr, MASKED: tl.constexpr, BOUNDARY: tl.constexpr,
               FIXED_ORDER_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """One key tile [start, start + BLOCK_N) of the online softmax (see the module doc).

    MASKED=False is only used for tiles every row of the program sees entirely: there the mask would
    keep every score, so skipping it changes no bit. At a split boundary inside the range, BOUNDARY
    CHAIN merges the finished split into (M, L, O), BOUNDARY STORE writes it to the workspace (a
    split-parallel program walking several splits); either way the next split starts fresh.
    """
    if BOUNDARY != NO_BOUNDARY:
        if (start % split_size == 0) & (start > t_start):
            if BOUNDARY == CHAIN:
                M, L, O = _merge(M, L, O, m_i, tl.max(l_acc, 1), acc)
            else:
                _store_partial(ws_o_ptr, ws_ml_ptr, w_row + (start // split_size - 1), row_ok, m_i,
                               tl.max(l_acc, 1), acc, HEAD_DIM)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_acc = tl.zeros([BLOCK_M, L_COLS], tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    d = tl.arange(0, HEAD_DIM)
    n = start + tl.arange(0, BLOCK_N)
    # Key n's offsets in the K and V stores, and whether it is real. Paged: through the block table,
    # whose entries for this tile were loaded one tile ahead (a K/V address that depends on a load of
    # the same iteration defeats Triton's software pipelining: measured, loads went fully serial). A
    # key past kv_len or the table, or in a block id outside the pool, is never loaded, whatever the
    # metadata says. Contiguous: row `seq` from key_start on (left padding skipped).
    kv_ok = n < kv_len
    if PAGED:
        blk = blk_next.to(tl.int64)
        n_nx = n + BLOCK_N
        blk_next = tl.load(bt_row + n_nx // block_size,
                           mask=(n_nx < kv_len) & (n_nx // block_size < max_blocks), other=-1)
        kv_ok = kv_ok & (blk >= 0) & (blk < num_blocks)
        in_blk = n % block_size
        k_off = blk * stride_kb + in_blk * stride_kt + kvh * stride_kh
        v_off = blk * stride_vb + in_blk * stride_vt + kvh * stride_vh
    else:
        tok = (key_start + n).to(tl.int64)
        k_off = seq.to(tl.int64) * stride_kb + tok * stride_kt + kvh * stride_kh
        v_off = seq.to(tl.int64) * stride_vb + tok * stride_vt + kvh * stride_vh
    k = tl.load(k_ptr + k_off[:, None] + d[None, :], mask=kv_ok[:, None], other=0.0)
    # The dots are written out here (not a helper): each helper call costs the interpreter ~1 ms.
    if FIXED_ORDER_DOT:
        s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
    else:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if MASKED:
        visible = kv_ok[None, :] & (n[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (n[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    # Max in log2 units: scaling by qk_scale > 0 commutes with max exactly.
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - m_use))
    p = tl.exp2(tl.fma(s, qk_scale, -m_use[:, None])).to(v_ptr.dtype.element_ty)
    v = tl.load(v_ptr + v_off[:, None] + d[None, :], mask=kv_ok[:, None], other=0.0)
    acc = acc * alpha[:, None]
    l_acc = l_acc * alpha[:, None]
    if FIXED_ORDER_DOT:
        p32 = p.to(tl.float32)
        acc = acc + tl.sum(p32[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        l_acc = l_acc + tl.sum(p32[:, :, None] * ones.to(tl.float32)[None, :, :], axis=1)
    else:
        acc = tl.dot(p, v, acc, input_precision=PRECISION)
        l_acc = tl.dot(p, ones, l_acc, input_precision=PRECISION)
    return M, L, O, m_new, l_acc, acc, blk_next


@triton.jit
def _attend_tiles(q, pos, p_first, p_last, t_start, t_end, split_size, window, qk_scale,
                  k_ptr, v_ptr, seq, kvh, kv_len, key_start, bt_ptr, stride_bt, max_blocks, num_blocks,
                  block_size, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                  ws_o_ptr, ws_ml_ptr, w_row, row_ok,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                  PAGED: tl.constexpr, HAS_WINDOW: tl.constexpr, BOUNDARY: tl.constexpr,
                  MASK_ALL: tl.constexpr, FIXED_ORDER_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """Online softmax over key tiles [t_start, t_end) (t_start a multiple of BLOCK_N); the rows' positions
    span [p_first, p_last]. Returns the chain of the completed splits (M, L, O) and the open split's
    partial (m, l, o). Three loops: masked head (sliding window), unmasked middle (keys every row sees),
    masked tail (the causal diagonal, the sequence end); MASK_ALL masks every tile (same bits)."""
    ones = tl.full([BLOCK_N, L_COLS], 1.0, dtype=v_ptr.dtype.element_ty)
    M = tl.full([BLOCK_M], float("-inf"), tl.float32)
    L = tl.zeros([BLOCK_M], tl.float32)
    O = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_acc = tl.zeros([BLOCK_M, L_COLS], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    n0 = t_start + tl.arange(0, BLOCK_N)
    if PAGED:
        blk_next = tl.load(bt_row + n0 // block_size,
                           mask=(n0 < kv_len) & (n0 // block_size < max_blocks), other=-1)
    else:
        blk_next = n0 * 0
    # Tiles wholly visible to every row: after p_last - window (window) and ending at or before p_first.
    u_lo = t_start
    if HAS_WINDOW:
        u_lo = tl.maximum(t_start, tl.cdiv(p_last - window + 1, BLOCK_N) * BLOCK_N)
    u_hi = tl.maximum(((p_first + 1) // BLOCK_N) * BLOCK_N, t_start)
    if MASK_ALL:
        u_lo = t_end
    u_lo = tl.minimum(u_lo, t_end)
    u_hi = tl.minimum(tl.maximum(u_hi, u_lo), t_end)
    for start in range(t_start, u_lo, BLOCK_N):
        M, L, O, m_i, l_acc, acc, blk_next = _tile_step(
            start, t_start, q, pos, M, L, O, m_i, l_acc, acc, blk_next, ones, split_size, window, qk_scale,
            k_ptr, v_ptr, seq, kvh, kv_len, key_start, bt_row, max_blocks, num_blocks, block_size,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, ws_o_ptr, ws_ml_ptr, w_row,
            row_ok, BLOCK_M, BLOCK_N, HEAD_DIM, PAGED, HAS_WINDOW, True, BOUNDARY, FIXED_ORDER_DOT, PRECISION)
    for start in range(u_lo, u_hi, BLOCK_N):
        M, L, O, m_i, l_acc, acc, blk_next = _tile_step(
            start, t_start, q, pos, M, L, O, m_i, l_acc, acc, blk_next, ones, split_size, window, qk_scale,
            k_ptr, v_ptr, seq, kvh, kv_len, key_start, bt_row, max_blocks, num_blocks, block_size,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, ws_o_ptr, ws_ml_ptr, w_row,
            row_ok, BLOCK_M, BLOCK_N, HEAD_DIM, PAGED, HAS_WINDOW, False, BOUNDARY, FIXED_ORDER_DOT, PRECISION)
    for start in range(u_hi, t_end, BLOCK_N):
        M, L, O, m_i, l_acc, acc, blk_next = _tile_step(
            start, t_start, q, pos, M, L, O, m_i, l_acc, acc, blk_next, ones, split_size, window, qk_scale,
            k_ptr, v_ptr, seq, kvh, kv_len, key_start, bt_row, max_blocks, num_blocks, block_size,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, ws_o_ptr, ws_ml_ptr, w_row,
            row_ok, BLOCK_M, BLOCK_N, HEAD_DIM, PAGED, HAS_WINDOW, True, BOUNDARY, FIXED_ORDER_DOT, PRECISION)
    # All L_COLS columns of l_acc hold the same bits; max picks one exactly.
    return M, L, O, m_i, tl.max(l_acc, 1), acc


@triton.jit(do_not_specialize=["num_seqs", "fixed_q_len", "fixed_kv_len", "max_blocks", "num_blocks",
                               "splits_per_program", "window"])
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, ws_o_ptr, ws_ml_ptr, lse_ptr, q8_ptr, s8_ptr,
    cu_q_ptr, kv_lens_ptr, bt_ptr, key_start_ptr,
    stride_qs, stride_qt, stride_qh, stride_os, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    num_seqs, fixed_q_len, fixed_kv_len, max_blocks, num_blocks, block_size, split_size, window,
    num_q_heads, num_splits_ws, splits_per_program, qk_scale,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGED: tl.constexpr, SPLIT_PARALLEL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, MASK_ALL: tl.constexpr, FIXED_ORDER_DOT: tl.constexpr,
    PRECISION: tl.constexpr, MULTI_SPLIT: tl.constexpr, USE_PDL: tl.constexpr, STORE_LSE: tl.constexpr,
    QUANT: tl.constexpr,
):
    """One program: BLOCK_T query tokens x GROUP query heads sharing kv head `pid(1)`.

    Sequential: all splits of the tile's key range, result written to out (and with STORE_LSE, paged
    launches only, each row's log-sum-exp to lse[token, head]). Split-parallel: split `pid(2)` only,
    partial written to the workspace for `_merge_splits_kernel`.
    """
    pdl_start(USE_PDL)  # PDL (kernels/_pdl.py): wait for the previous kernel before reading anything
    # Last query tiles first: causal prefill tiles get heavier towards a sequence's end, and starting
    # the heavy ones early shortens the tail of the grid.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kvh = tl.program_id(1)
    if PAGED:
        seq = _seq_of_tile(cu_q_ptr, num_seqs, tile, BLOCK_T)
        q_first = tl.load(cu_q_ptr + seq)
        q_len = tl.load(cu_q_ptr + seq + 1) - q_first
        tile_local = tile - (q_first // BLOCK_T + seq)
        kv_len = tl.load(kv_lens_ptr + seq)
        key_start = 0
        q_base = q_first.to(tl.int64) * stride_qt
        o_base = q_first.to(tl.int64) * stride_ot
    else:
        tiles_per_seq = tl.cdiv(fixed_q_len, BLOCK_T)
        seq = tile // tiles_per_seq
        tile_local = tile % tiles_per_seq
        q_len = fixed_q_len
        q_first = seq * fixed_q_len
        key_start = tl.load(key_start_ptr + seq)
        kv_len = fixed_kv_len - key_start
        q_base = seq.to(tl.int64) * stride_qs
        o_base = seq.to(tl.int64) * stride_os
    if tile_local * BLOCK_T >= q_len:
        return

    r = tl.arange(0, BLOCK_M)
    t = tile_local * BLOCK_T + r // GROUP_PAD
    g = r % GROUP_PAD
    row_ok = (t < q_len) & (g < GROUP)
    head = kvh * GROUP + g
    pos = kv_len - q_len + t  # absolute position of the query = index of the last key it sees
    d = tl.arange(0, HEAD_DIM)
    q_off = q_base + t.to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)

    # Key range of the whole tile: [lo, hi). Tiles start on the BLOCK_N grid anchored at key 0.
    t_last = tl.minimum(tile_local * BLOCK_T + BLOCK_T, q_len) - 1
    hi = tl.maximum(kv_len - q_len + t_last + 1, 0)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(kv_len - q_len + tile_local * BLOCK_T - window + 1, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    # Workspace rows of this program's queries (split-parallel): [token, q head, split].
    w_row = ((q_first + t).to(tl.int64) * num_q_heads + head) * num_splits_ws
    if SPLIT_PARALLEL:
        # Splits [sp0, sp0 + splits_per_program): each one's partial starts fresh and is stored on its
        # own, so how many a program walks is a speed choice only. MULTI_SPLIT (more than one) compiles
        # the boundary stores in; one split per program leaves them out (~60 fewer registers).
        sp0 = tl.program_id(2) * splits_per_program
        t_start = tl.maximum(lo, sp0 * split_size)
        t_end = tl.minimum(hi, (sp0 + splits_per_program) * split_size)
        if t_start >= t_end:
            return
    else:
        t_start = lo
        t_end = hi
    p_first = kv_len - q_len + tile_local * BLOCK_T
    M, L, O, m_i, l_i, acc = _attend_tiles(
        q, pos, p_first, hi - 1, t_start, t_end, split_size, window, qk_scale, k_ptr, v_ptr, seq, kvh,
        kv_len, key_start, bt_ptr, stride_bt, max_blocks, num_blocks, block_size, stride_kb, stride_kt,
        stride_kh, stride_vb, stride_vt, stride_vh, ws_o_ptr, ws_ml_ptr, w_row, row_ok, BLOCK_M, BLOCK_N,
        HEAD_DIM, PAGED, HAS_WINDOW, (STORE if MULTI_SPLIT else NO_BOUNDARY) if SPLIT_PARALLEL else CHAIN,
        MASK_ALL, FIXED_ORDER_DOT, PRECISION)
    if SPLIT_PARALLEL:
        _store_partial(ws_o_ptr, ws_ml_ptr, w_row + (t_end - 1) // split_size, row_ok, m_i, l_i, acc, HEAD_DIM)
    else:
        M, L, O = _merge(M, L, O, m_i, l_i, acc)
        o_off = o_base + t.to(tl.int64) * stride_ot + head * stride_oh
        _store_out(out_ptr, q8_ptr, s8_ptr, o_off, (q_first + t).to(tl.int64) * num_q_heads + head, d, row_ok,
                   L, O, QUANT)
        if STORE_LSE:
            _store_lse(lse_ptr, q_first + t, head, num_q_heads, row_ok, M, L)


@triton.jit
def _seq_of_tile(cu_q_ptr, num_seqs, tile, BLOCK_T: tl.constexpr):
    """Sequence s of a global query-tile index: the last s with cu_q[s] // BLOCK_T + s <= tile, i.e.
    the count of such s minus one (they are nondecreasing in s).

    Sequence s owns tile indices [cu_q[s] // BLOCK_T + s, cu_q[s+1] // BLOCK_T + s + 1), at least
    ceil(q_len / BLOCK_T) of them, so T // BLOCK_T + S programs cover any packing without a host sync.
    Counted 256 sequences per vector load: one memory round trip for a batch of up to 256, where a
    binary search would chain log2(S) dependent loads.
    """
    count = 0
    for c in range(0, num_seqs, SEQ_CHUNK):
        s = c + tl.arange(0, SEQ_CHUNK)
        first = tl.load(cu_q_ptr + s, mask=s < num_seqs, other=0) // BLOCK_T + s
        count += tl.sum(((first <= tile) & (s < num_seqs)).to(tl.int32), 0)
    return count - 1


@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "fixed_q_len", "fixed_kv_len", "window"])
def _merge_splits_kernel(
    ws_o_ptr, ws_ml_ptr, out_ptr, lse_ptr, cu_q_ptr, kv_lens_ptr, key_start_ptr,
    stride_os, stride_ot, stride_oh,
    num_seqs, num_tokens, fixed_q_len, fixed_kv_len, split_size, window, num_q_heads,
    num_splits_ws,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGED: tl.constexpr, HAS_WINDOW: tl.constexpr, USE_PDL: tl.constexpr, STORE_LSE: tl.constexpr,
):
    """Chain each token's split partials left to right (the sequential path's chain) and normalize (and
    with STORE_LSE, paged launches only, store each row's log-sum-exp as the sequential path does).

    Rows are TOKENS tokens x GROUP_PAD heads of one kv head. Rows whose token needs fewer splits than
    the program's longest merge masked partials (-inf, 0, 0), which `_merge` passes through exactly.
    """
    pdl_start(USE_PDL)
    r = tl.arange(0, TOKENS * GROUP_PAD)
    tok = tl.program_id(0) * TOKENS + r // GROUP_PAD
    g = r % GROUP_PAD
    head = tl.program_id(1) * GROUP + g
    if PAGED:
        # Sequence of each token: the last s with cu_q[s] <= tok (counted, as in _seq_of_tile).
        lo = tl.zeros([TOKENS * GROUP_PAD], tl.int32) - 1
        for c in range(0, num_seqs, SEQ_CHUNK):
            sq = c + tl.arange(0, SEQ_CHUNK)
            first = tl.load(cu_q_ptr + sq, mask=sq < num_seqs, other=0)
            hit = (first[None, :] <= tok[:, None]) & (sq < num_seqs)[None, :]
            lo += tl.sum(hit.to(tl.int32), 1)
        q_first = tl.load(cu_q_ptr + lo)
        q_len = tl.load(cu_q_ptr + lo + 1) - q_first
        kv_len = tl.load(kv_lens_ptr + lo)
        t = tok - q_first
        o_off = tok.to(tl.int64) * stride_ot + head * stride_oh
    else:
        seq = tok // fixed_q_len
        q_len = fixed_q_len
        t = tok - seq * fixed_q_len
        kv_len = fixed_kv_len - tl.load(key_start_ptr + seq, mask=tok < num_tokens, other=0)
        o_off = seq.to(tl.int64) * stride_os + t.to(tl.int64) * stride_ot + head * stride_oh
    # Rows past the last sequence's queries (packing padding) belong to no sequence: not written.
    row_ok = (tok < num_tokens) & (t < q_len) & (g < GROUP)
    pos = kv_len - q_len + t
    first_sp = tl.zeros([TOKENS * GROUP_PAD], tl.int32)
    if HAS_WINDOW:
        first_sp = tl.maximum(pos - window + 1, 0) // split_size
    end_sp = tl.where(row_ok & (pos >= 0), tl.maximum(pos, 0) // split_size + 1, 0)
    d = tl.arange(0, HEAD_DIM)
    M = tl.full([TOKENS * GROUP_PAD], float("-inf"), tl.float32)
    L = tl.zeros([TOKENS * GROUP_PAD], tl.float32)
    O = tl.zeros([TOKENS * GROUP_PAD, HEAD_DIM], tl.float32)
    row0 = (tok.to(tl.int64) * num_q_heads + head) * num_splits_ws
    # num_stages: Triton pipelines these plain loads only when asked; without it every step of the
    # chain waited a full memory round trip (measured: ~0.5 us per split on the H100).
    for sp in tl.range(tl.min(tl.where(end_sp > first_sp, first_sp, 2**30), 0), tl.max(end_sp, 0),
                       num_stages=MERGE_STAGES):
        live = (sp >= first_sp) & (sp < end_sp)
        w_row = row0 + sp
        m = tl.load(ws_ml_ptr + w_row * 2, mask=live, other=float("-inf"))
        l = tl.load(ws_ml_ptr + w_row * 2 + 1, mask=live, other=0.0)
        o = tl.load(ws_o_ptr + w_row[:, None] * HEAD_DIM + d[None, :], mask=live[:, None], other=0.0)
        M, L, O = _merge(M, L, O, m, l, o)
    out = _finalize(L, O).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + o_off[:, None] + d[None, :], out, mask=row_ok[:, None])
    if STORE_LSE:
        _store_lse(lse_ptr, tok, head, num_q_heads, row_ok, M, L)
