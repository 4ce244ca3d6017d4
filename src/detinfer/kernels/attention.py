"""Batch-invariant causal attention over a paged KV cache (prefill, chunked prefill, decode), its fast
non-invariant twin, the contiguous-KV entry point for the drop-in mode, and pure-torch references.

Conventions (paged): a step packs the new query tokens of S sequences into q [T, Hq, D];
cu_q_lens [S+1] int32 are the cumulative query counts; kv_lens [S] int32 count every key of a sequence
including this step's (already written to the cache by `write_kv`); query j of sequence s sits at
absolute position kv_lens[s] - q_len_s + j and sees keys 0..pos (and, with sliding_window=W, only keys
> pos - W). Caches are [num_blocks, block_size, Hkv, D]; block_tables [S, max_blocks] int32 list each
sequence's physical blocks in order.

Invariance contract: a query's output bits depend only on its own sequence's keys/values up to its
position, never on the batch, the chunking, the other queries of its step, the block table's physical
layout or the schedule. The key axis is cut into splits of `split_size` keys anchored at key 0 (a kernel
constant, never derived from the batch), whose partials are merged left to right; see
`attention_kernels.py` for why every path produces the same bits. `paged_attention_fast` instead picks
its split size from the batch to fill the GPU, so its bits move with the batch.

Capture-safe: with validate=False the launch path makes no host sync (no .item(), no value-dependent
Python branching); `max_q_len` / `max_kv_len` are optional host-side hints (speed) and bounds (grid).
"""

from __future__ import annotations

import math
import numbers

import torch
import triton

from detinfer.constants import ATTENTION_SPLIT_SIZE
from detinfer.kernels import attention_kernels as K
from detinfer.kernels._launch import (
    SUPPORTED_HEAD_DIMS,
    check_kernel_inputs,
    dot_precision,
    interpreting,
    next_pow2,
    sm_count,
)
from detinfer.kernels._pdl import launch_options, use_pdl
from detinfer.kernels.attention_ref import attention_contiguous_ref, check_lse_out, paged_attention_ref

__all__ = ["DEFAULT_SPLIT_SIZE", "SUPPORTED_HEAD_DIMS", "attention_contiguous", "attention_contiguous_ref",
           "block_n_for", "paged_attention", "paged_attention_fast", "paged_attention_ref"]

# Keys per split: fixes where partial softmaxes are merged, so it is a constant of the kernel, never a
# function of the batch. 256 = 4 tiles of 64 keys: against 512 it gives small decode batches twice the
# parallel programs (bs=1 kv=512: 14.8 vs 19.4 us on the H100), loses at bs<=8 with 32k contexts (a
# merge chain twice as long) and ties at bs>=64 and in prefill (docs/performance.md, "Attention").
DEFAULT_SPLIT_SIZE = ATTENTION_SPLIT_SIZE  # (constants.py)
MAX_GROUP = 128  # query heads per kv head the tile can hold (MQA models go up to ~71 -> 128 padded)
SCHEDULES = ("auto", "parallel", "sequential")
_NOMINAL_SMS = 132  # used off-GPU (interpreter), where the schedule only matters for test coverage
# Speed-only launch choices (none of them changes a bit; bench/bench_attention.py sweeps them):
_TUNE = {
    "bm_max": 128,  # query rows per program for 16-bit head_dim <= 128 (prefill tiles)
    "bm_max_other": 16,  # fp32 (exact dots are FMA loops in registers) and head_dim 256: spills beyond
    "warps_bm16": 4,  # decode tiles (16 rows)
    "warps_bm128": 8,
    "stages": 3,  # K+V tiles in flight per program (32 KB each at head_dim 128) on long key walks
    "short_walk_tiles": 4,  # walks of at most this many tiles use 1 stage (see _num_stages)
    "parallel_below": 2,  # split-parallel when sequential programs < this x SM count (GPU otherwise idles)
    "programs_per_sm": 8,  # split-parallel: group consecutive splits per program down to ~this many
    "mask_all": False,  # mask every tile, not only the ones some row cannot fully see (same bits; A/B)
}


def block_n_for(head_dim: int) -> int:
    """Keys per tile. Fixes the PV dot's reduction block and the tile grid inside a split, so it is a
    function of the model's head_dim only. 64 keys x 128 dims of K and V = 32 KB per pipeline stage;
    head_dim 256 halves the keys to keep that budget."""
    return 64 if head_dim <= 128 else 32


def _tile_shape(head_dim: int, dtype: torch.dtype, group: int, max_q_len: int) -> tuple[int, int, int, int]:
    """(GROUP_PAD, BLOCK_T, BLOCK_M, num_warps). BLOCK_M (query rows per program) is NOT part of the
    reduction order: each dot row depends only on its own query row (proven bitwise on the GPU by
    tests/kernels/test_attention_gpu.py), so it may follow the step's query length for speed."""
    gp = next_pow2(group)
    if interpreting():
        bm_max = 128  # tall tiles: the interpreter's cost is per op, not per FLOP
    else:
        bm_max = _TUNE["bm_max"] if (head_dim <= 128 and dtype != torch.float32) else _TUNE["bm_max_other"]
    bt = max(1, min(next_pow2(max_q_len), bm_max // gp if gp < bm_max else 1))
    bm = max(16, gp * bt)
    warps = _TUNE["warps_bm128"] if bm >= 128 else (_TUNE["warps_bm16"] if bm <= 16 else 4)
    return gp, bm // gp, bm, warps


def _num_stages(head_dim: int, parallel: bool, splits_per_program: int, split_size: int, max_kv_len: int,
                block_n: int) -> int:
    """Software-pipeline depth of the key loop (speed only: the loads are the same, so no bit moves).
    Deep pipelines hide the paged gather's latency on long walks, but a walk of a few tiles mostly pays
    their prologue: measured on the H100 (graph replays, bs=1, kv 110), 9.2 us with 3 stages and 6.0 us
    with 1 for the sequential walk, 11.3 vs 8.7 us split-parallel; bs=64 kv 110 24.6 vs 20.0 us; kv 600
    split-parallel (4-tile splits) 15.2 vs 15.6 us. A program's walk is bounded by its splits when
    split-parallel, else by max_kv_len (an upper bound: the true walk may be shorter)."""
    walk = splits_per_program * split_size if parallel else max_kv_len
    if triton.cdiv(walk, block_n) <= _TUNE["short_walk_tiles"]:
        return 1
    return _TUNE["stages"] if head_dim <= 128 else 2


def _sm_count(device: torch.device) -> int:
    return sm_count(device, off_gpu=_NOMINAL_SMS)


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _check_int(op: str, name: str, value, lo: int, allow_none: bool = True):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo:
        raise ValueError(f"{op}: {name} must be an int >= {lo}{' or None' if allow_none else ''}, "
                         f"got {value!r}")


def _check_scale(op: str, scale) -> float:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) \
            or scale <= 0:
        # > 0: the kernel takes the running max of unscaled scores, which commutes with a positive scale.
        raise ValueError(f"{op}: scale must be a finite real number > 0, got {scale!r}")
    return float(scale)


def _check_heads(op: str, hq: int, hkv: int, d: int, d_kv: int) -> int:
    if d != d_kv:
        raise ValueError(f"{op}: head_dim mismatch: q has {d}, k/v have {d_kv}")
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"{op}: head_dim {d} is not supported (allowed: {SUPPORTED_HEAD_DIMS}); "
                         "use the *_ref function")
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"{op}: {hq} query heads is not a multiple of {hkv} kv heads")
    if hq // hkv > MAX_GROUP:
        raise ValueError(f"{op}: {hq // hkv} query heads per kv head exceeds the kernel's {MAX_GROUP}")
    return hq // hkv


def _check_split(op: str, split_size, head_dim: int) -> int:
    bn = block_n_for(head_dim)
    if isinstance(split_size, bool) or not isinstance(split_size, numbers.Integral) or split_size < bn \
            or split_size % bn:
        raise ValueError(f"{op}: split_size must be a positive multiple of the tile's {bn} keys "
                         f"(head_dim {head_dim}), got {split_size!r}")
    return int(split_size)


def _check_paged(op, q, k_cache, v_cache, block_tables, kv_lens, cu_q_lens, scale, sliding_window,
                 max_q_len, max_kv_len) -> tuple[int, float]:
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("kv_lens", kv_lens), ("cu_q_lens", cu_q_lens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3:
        raise ValueError(f"{op}: q must be [T, Hq, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"{op}: k_cache and v_cache must both be [num_blocks, block_size, Hkv, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if q.dtype != k_cache.dtype or q.dtype != v_cache.dtype:
        raise TypeError(f"{op}: q, k_cache, v_cache must share one dtype, got {q.dtype}, "
                        f"{k_cache.dtype}, {v_cache.dtype}")
    group = _check_heads(op, q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[3])
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(f"{op}: q, k_cache and v_cache need a contiguous last (head_dim) dimension")
    s = kv_lens.shape[0] if kv_lens.dim() == 1 else -1
    if kv_lens.dim() != 1 or cu_q_lens.shape != (s + 1,) or block_tables.dim() != 2 \
            or block_tables.shape[0] != s:
        raise ValueError(f"{op}: need kv_lens [S], cu_q_lens [S+1], block_tables [S, max_blocks]; got "
                         f"{tuple(kv_lens.shape)}, {tuple(cu_q_lens.shape)}, {tuple(block_tables.shape)}")
    for name, t in (("kv_lens", kv_lens), ("cu_q_lens", cu_q_lens), ("block_tables", block_tables)):
        if t.dtype != torch.int32:
            raise TypeError(f"{op}: {name} must be int32, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{op}: {name} is on {t.device} but q is on {q.device}")
    if block_tables.stride(-1) != 1 or not cu_q_lens.is_contiguous() or not kv_lens.is_contiguous():
        raise ValueError(f"{op}: block_tables rows, cu_q_lens and kv_lens must be contiguous")
    _check_int(op, "sliding_window", sliding_window, 1)
    _check_int(op, "max_q_len", max_q_len, 1)
    _check_int(op, "max_kv_len", max_kv_len, 1)
    capacity = block_tables.shape[1] * k_cache.shape[1]
    if max_kv_len is not None and max_kv_len > capacity:
        raise ValueError(f"{op}: block table too short: max_kv_len {max_kv_len} needs "
                         f"{-(-max_kv_len // k_cache.shape[1])} blocks of {k_cache.shape[1]}, table has "
                         f"{block_tables.shape[1]}")
    check_kernel_inputs(op, q, k_cache, v_cache)
    return group, _check_scale(op, scale)


def _check_paged_values(op, q, k_cache, block_tables, kv_lens, cu_q_lens, max_kv_len):
    """Value-level checks: one device->host copy of the (small) step metadata."""
    from detinfer.kernels._launch import check_step_metadata

    check_step_metadata(cu_q_lens, kv_lens, block_tables, block_size=k_cache.shape[1],
                        num_blocks=k_cache.shape[0], num_tokens=q.shape[0], max_kv_len=max_kv_len, op=op)


def _launch(q, k, v, out, *, paged: bool, cu_q, kv_lens, bt, key_start, num_seqs: int, n_tiles: int,
            fixed_q_len: int, fixed_kv_len: int, block_size: int, num_blocks: int, max_blocks: int,
            split_size: int, num_splits: int, parallel: bool, window, scale: float, group: int,
            max_q_len: int, q_strides, o_strides, k_strides, v_strides, bt_stride: int,
            lse_out: torch.Tensor | None = None, quant: tuple | None = None) -> None:
    """Run the attention kernel (and the merge kernel when split-parallel) into `out` (and each row's
    log-sum-exp into `lse_out` [T, Hq], paged launches only). `quant` (q8, s8, rows, quantize), paged
    launches at head_dim 128 only (kernels/attention_quant.py): the rows go quantized into q8 (contiguous
    [T, Hq, D], as `rows`) and s8 [T, Hq] instead, `out` only names the dtype they are rounded to first, and
    split-parallel steps merge into the 16-bit `rows`, then call quantize(rows, q8, s8)."""
    hq, d = (q.shape[1], q.shape[2]) if paged else (q.shape[1], q.shape[3])
    hkv = hq // group
    tokens = q.shape[0] if paged else q.shape[0] * q.shape[2]
    gp, bt_, bm, warps = _tile_shape(d, q.dtype, group, max_q_len)
    bn = block_n_for(d)
    fixed = interpreting()
    has_window = window is not None
    pdl = use_pdl(q.device)
    splits_per_program = 1
    if parallel:
        ws_o = torch.empty((tokens, hq, num_splits, d), dtype=torch.float32, device=q.device)
        ws_ml = torch.empty((tokens, hq, num_splits, 2), dtype=torch.float32, device=q.device)
        # Consecutive splits per program (each still stored as its own partial): enough programs to
        # fill the GPU, no more, so per-program set-up is paid less often. Speed only.
        target = max(1, int(_TUNE["programs_per_sm"] * _sm_count(q.device)))
        splits_per_program = max(1, triton.cdiv(n_tiles * hkv * num_splits, target))
    else:
        ws_o = ws_ml = out  # unused pointers
    dummy_i32 = cu_q if cu_q is not None else key_start
    # STORE_LSE is a constexpr: launches without lse_out (every engine call) compile the kernel they did
    # before it existed; the pointer is then an unused stand-in. Only paged launches pass lse_out.
    store_lse = lse_out is not None
    lse_ptr = lse_out if store_lse else out
    q8, s8 = quant[:2] if quant is not None else (out, out)  # QUANT is a constexpr too: stand-ins without it
    grid = (n_tiles, hkv, triton.cdiv(num_splits, splits_per_program) if parallel else 1)
    K._attention_kernel[grid](
        q, k, v, out, ws_o, ws_ml, lse_ptr, q8, s8, dummy_i32, kv_lens if kv_lens is not None else dummy_i32,
        bt if bt is not None else dummy_i32, key_start if key_start is not None else dummy_i32,
        *q_strides, *o_strides, *k_strides, *v_strides, bt_stride,
        num_seqs, fixed_q_len, fixed_kv_len, max_blocks, num_blocks, block_size, split_size,
        window if has_window else 0, hq, num_splits, splits_per_program, scale * math.log2(math.e),
        GROUP=group, GROUP_PAD=gp, BLOCK_T=bt_, BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=d, PAGED=paged,
        SPLIT_PARALLEL=parallel, HAS_WINDOW=has_window, MASK_ALL=_TUNE["mask_all"], FIXED_ORDER_DOT=fixed,
        PRECISION=dot_precision(q.dtype), MULTI_SPLIT=splits_per_program > 1, USE_PDL=pdl, STORE_LSE=store_lse,
        QUANT=quant is not None,
        # fusion off: see the kernels' module doc.
        num_warps=warps, enable_fp_fusion=False, **launch_options(pdl),
        num_stages=_num_stages(d, parallel, splits_per_program, split_size, num_splits * split_size, bn))
    if parallel:
        # Rows of the merge program: tokens x padded group, ~16 rows on the GPU (16 x 128 fp32 partial
        # rows in flight); more in the interpreter, where each program costs milliseconds.
        tokens_per = max(1, (64 if fixed else 16) // gp)
        merged = out if quant is None else quant[2]  # quantized below (kernels/attention_quant.py)
        K._merge_splits_kernel[(triton.cdiv(tokens, tokens_per), hkv)](
            ws_o, ws_ml, merged, lse_ptr, dummy_i32, kv_lens if kv_lens is not None else dummy_i32,
            key_start if key_start is not None else dummy_i32, *o_strides,
            num_seqs, tokens, fixed_q_len, fixed_kv_len, split_size,
            window if has_window else 0, hq, num_splits,
            GROUP=group, GROUP_PAD=gp, TOKENS=tokens_per, HEAD_DIM=d, PAGED=paged, HAS_WINDOW=has_window,
            USE_PDL=pdl, STORE_LSE=store_lse, num_warps=4, enable_fp_fusion=False, **launch_options(pdl))
        if quant is not None:
            quant[3](merged, quant[0], quant[1])


def _check_out(op: str, out, shape, q: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=q.dtype, device=q.device)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(shape) or out.dtype != q.dtype \
            or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"{op}: out must be a {q.dtype} tensor of shape {tuple(shape)} on {q.device} with a "
                         f"contiguous last dim, got {getattr(out, 'dtype', type(out).__name__)} "
                         f"{tuple(getattr(out, 'shape', ()))}")
    return out


def _pick_parallel(schedule: str, n_programs: int, num_splits: int, device: torch.device) -> bool:
    if schedule == "parallel":
        return True
    if schedule == "sequential" or num_splits <= 1:
        return False
    return n_programs < _TUNE["parallel_below"] * _sm_count(device)


def _paged(op, q, k_cache, v_cache, block_tables, kv_lens, cu_q_lens, scale, sliding_window, max_q_len,
           max_kv_len, validate, split_size, schedule, fast: bool, out, lse_out=None, quant=None):
    group, scale = _check_paged(op, q, k_cache, v_cache, block_tables, kv_lens, cu_q_lens, scale,
                                sliding_window, max_q_len, max_kv_len)
    if schedule not in SCHEDULES:
        raise ValueError(f"{op}: schedule must be one of {SCHEDULES}, got {schedule!r}")
    d = q.shape[2]
    bn = block_n_for(d)
    if not fast:
        split_size = _check_split(op, split_size, d)
    if validate is None:
        validate = not _capturing(q)
    if validate:
        _check_paged_values(op, q, k_cache, block_tables, kv_lens, cu_q_lens, max_kv_len)
    t, s = q.shape[0], kv_lens.shape[0]
    # quantized rows (kernels/attention_quant.py, which checks its buffers): q stands in for `out`'s dtype
    out = q if quant is not None else _check_out(op, out, (t, q.shape[1], d), q)
    check_lse_out(op, lse_out, q)
    if t == 0 or s == 0:
        return out
    # Upper bounds need no sync: every q_len <= T, every kv_len <= the table's capacity.
    max_q_len = min(max_q_len or t, t)
    max_kv_len = max_kv_len or block_tables.shape[1] * k_cache.shape[1]
    _, bt_, _, _ = _tile_shape(d, q.dtype, group, max_q_len)
    n_tiles = t // bt_ + s  # covers every packing (see attention_kernels._seq_of_tile)
    n_programs = n_tiles * (q.shape[1] // group)
    if fast:
        # Non-invariant: as many splits as fill the GPU, sized from this step's longest sequence.
        target = _TUNE["parallel_below"] * _sm_count(q.device)
        n_split = 1 if (n_programs >= target or schedule == "sequential") else \
            min(triton.cdiv(target, n_programs), triton.cdiv(max_kv_len, bn))
        split_size = triton.cdiv(triton.cdiv(max_kv_len, n_split), bn) * bn
        parallel = n_split > 1
    else:
        parallel = _pick_parallel(schedule, n_programs, triton.cdiv(max_kv_len, split_size), q.device)
    _launch(q, k_cache, v_cache, out, paged=True, cu_q=cu_q_lens, kv_lens=kv_lens, bt=block_tables,
            key_start=None, num_seqs=s, n_tiles=n_tiles, fixed_q_len=0, fixed_kv_len=0,
            block_size=k_cache.shape[1], num_blocks=k_cache.shape[0], max_blocks=block_tables.shape[1],
            split_size=split_size, num_splits=triton.cdiv(max_kv_len, split_size), parallel=parallel,
            window=sliding_window, scale=scale, group=group, max_q_len=max_q_len,
            q_strides=(0, q.stride(0), q.stride(1)),
            o_strides=(0,) + (quant[0].stride()[:2] if quant is not None else out.stride()[:2]),
            k_strides=k_cache.stride()[:3], v_strides=v_cache.stride()[:3], bt_stride=block_tables.stride(0),
            lse_out=lse_out, quant=quant)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    kv_lens: torch.Tensor, cu_q_lens: torch.Tensor, scale: float, *,
                    sliding_window: int | None = None, max_q_len: int | None = None,
                    max_kv_len: int | None = None, validate: bool | None = None,
                    split_size: int = DEFAULT_SPLIT_SIZE, schedule: str = "auto",
                    out: torch.Tensor | None = None, lse_out: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-invariant paged attention -> [T, Hq, D] in q.dtype (see the module doc for conventions).

    max_q_len: hint for the query-tile height (speed only, any value gives the same bits; default T:
    pass 1 for decode steps). max_kv_len: an upper bound on
    kv_lens (sizes the split grid; default block_tables.shape[1] * block_size; a smaller wrong value gives
    wrong results, caught by validate). validate: check metadata values (one host sync); None = unless
    a CUDA graph is being captured. split_size: keys per split (the invariance constant; every run that
    must agree bitwise must use the same value). schedule: "auto" | "parallel" | "sequential" -- how
    splits are spread over programs; never changes the bits. out: optional [T, Hq, D] buffer to write
    (e.g. a CUDA graph's static output); rows past cu_q_lens[-1] are left untouched. lse_out: optional
    contiguous fp32 [T, Hq] buffer that also receives each query row's log-sum-exp in log2 units of the
    scaled scores, log2(sum_j 2^(scale * log2(e) * q.k_j)) (the training backward's input, so it skips
    recomputing it); a row that sees no key gets -inf; rows past cu_q_lens[-1] are left untouched.
    Storing it changes no bit of the output.
    """
    return _paged("paged_attention", q, k_cache, v_cache, block_tables, kv_lens, cu_q_lens, scale,
                  sliding_window, max_q_len, max_kv_len, validate, split_size, schedule, fast=False, out=out,
                  lse_out=lse_out)


def paged_attention_fast(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, kv_lens: torch.Tensor, cu_q_lens: torch.Tensor,
                         scale: float, *, sliding_window: int | None = None, max_q_len: int | None = None,
                         max_kv_len: int | None = None, validate: bool | None = None,
                         schedule: str = "auto", out: torch.Tensor | None = None,
                         lse_out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `paged_attention` (lse_out included) minus invariance: the split size follows the
    batch (one split per query when the batch fills the GPU, else enough splits to fill it), so bits vary
    with the batch.
    For the engine's fast mode and for measuring the cost of invariance on the same kernel."""
    return _paged("paged_attention_fast", q, k_cache, v_cache, block_tables, kv_lens, cu_q_lens, scale,
                  sliding_window, max_q_len, max_kv_len, validate, None, schedule, fast=True, out=out,
                  lse_out=lse_out)


def attention_contiguous(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_start: torch.Tensor,
                         scale: float, *, sliding_window: int | None = None, validate: bool | None = None,
                         split_size: int = DEFAULT_SPLIT_SIZE, schedule: str = "auto",
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-invariant causal attention over contiguous K/V with left padding -> [B, Hq, Lq, D].

    q [B, Hq, Lq, D]; k, v [B, Hkv, Lk, D] (HF layout); key_start [B] int32: row b's real keys are
    k[b, :, key_start[b]:]. The Lq queries are the last Lq key slots (HF prefill Lq = Lk, decode Lq = 1),
    so query j of row b sits at position (Lk - Lq + j) - key_start[b] counted from its first real key.
    Tiles and splits are anchored at key_start[b], so the bits equal `paged_attention`'s for the same
    tokens. Query slots that are left padding (position < 0) see no key and return 0.
    """
    op = "attention_contiguous"
    for name, t in (("q", q), ("k", k), ("v", v), ("key_start", key_start)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"{op}: need q [B, Hq, Lq, D] and k, v [B, Hkv, Lk, D] of one shape; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, hq, lq, d = q.shape
    if k.shape[0] != b or k.shape[2] < lq:
        raise ValueError(f"{op}: k/v must have batch {b} and at least Lq = {lq} keys, got {tuple(k.shape)}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"{op}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    group = _check_heads(op, hq, k.shape[1], d, k.shape[3])
    if key_start.shape != (b,) or key_start.dtype != torch.int32 or key_start.device != q.device:
        raise ValueError(f"{op}: key_start must be int32 [B] = [{b}] on {q.device}, got "
                         f"{key_start.dtype} {tuple(key_start.shape)} on {key_start.device}")
    _check_int(op, "sliding_window", sliding_window, 1)
    if schedule not in SCHEDULES:
        raise ValueError(f"{op}: schedule must be one of {SCHEDULES}, got {schedule!r}")
    split_size = _check_split(op, split_size, d)
    scale = _check_scale(op, scale)
    check_kernel_inputs(op, q, k, v)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    key_start = key_start.contiguous()
    lk = k.shape[2]
    if validate is None:
        validate = not _capturing(q)
    if validate and b and bool(((key_start < 0) | (key_start > lk)).any()):
        raise ValueError(f"{op}: key_start values must lie in [0, Lk = {lk}]")
    out = _check_out(op, out, (b, hq, lq, d), q)
    if b == 0 or lq == 0:
        return out
    _, bt_, _, _ = _tile_shape(d, q.dtype, group, lq)
    n_tiles = b * triton.cdiv(lq, bt_)
    num_splits = triton.cdiv(lk, split_size)
    parallel = _pick_parallel(schedule, n_tiles * k.shape[1], num_splits, q.device)
    _launch(q, k, v, out, paged=False, cu_q=None, kv_lens=None, bt=None, key_start=key_start, num_seqs=b,
            n_tiles=n_tiles, fixed_q_len=lq, fixed_kv_len=lk, block_size=1, num_blocks=0, max_blocks=0,
            split_size=split_size, num_splits=num_splits, parallel=parallel, window=sliding_window,
            scale=scale, group=group, max_q_len=lq,
            q_strides=(q.stride(0), q.stride(2), q.stride(1)), o_strides=(out.stride(0), out.stride(2),
                                                                          out.stride(1)),
            k_strides=(k.stride(0), k.stride(2), k.stride(1)), v_strides=(v.stride(0), v.stride(2),
                                                                          v.stride(1)), bt_stride=0)
    return out
