"""The attention prologue in one launch: per-head RMSNorm of q and k (Qwen3's qk_norm, optional) and the
rotary embedding (HF rotate_half layout) of both, reading q and k by strides (views into the fused QKV
projection's output: no split/reshape copies) and writing contiguous [T, H, D] results.

Semantics, exactly the unfused path (`rms_norm` per head, then `apply_rope`):

    n = (h.float() * rsqrt(mean(h.float() ** 2) + eps)).to(dtype)     # h: one head's D values
    n = (w.float() * n.float()).to(dtype)                              # only with a norm weight
    a = float(position) * inv_freq                                     # [D/2] fp32, per token
    out = (n1 cos a - n2 sin a, n2 cos a + n1 sin a).to(dtype)         # fp32 math, n = (n1, n2)

With the paged KV write folded in (`qk_norm_rope_write_kv`, what the engine runs per layer): the same
kernel also stores each token's rotated k heads and its v heads (a plain copy; v needs neither norm nor
rotary) at its KV-cache slot, as `kv_write.write_kv` would, so a step launches one kernel per layer fewer.
The grid then covers Hq + 2 Hkv head rows; the v rows are loaded apart from the norm's tile and only copied,
so the q/k rows and their sums are the plain launch's code (tests/kernels/test_rope_qk_kv_write.py checks
the bits against the two separate launches, on the GPU too).

cos/sin are computed in the kernel from the token's own position (no table sized by a maximum length),
with libdevice's accurate cosf/sinf (the approximate PTX instructions lose accuracy for large angles).

Batch invariance: every output element depends only on its own token's position and its own head's D
values. The one reduction (the head's sum of squares) is a `tl.sum` over a [HEADS, BLOCK_HALF] tile along
its own row, whose tree is fixed by the compiled layout; HEADS, BLOCK_HALF and num_warps are functions of
head_dim alone, never of the number of tokens (nor of whether the KV write is folded in), so a token's
bits do not depend on the batch.
"""

from __future__ import annotations

import math
import numbers

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from detinfer.kernels._launch import check_kernel_inputs, interpreting, next_pow2
from detinfer.kernels._pdl import launch_options, pdl_start, use_pdl
from detinfer.kernels.kv_write import check_write_kv
from detinfer.kernels.rmsnorm import rms_norm_ref
from detinfer.kernels.rope import apply_rope, rope_angles, rotate_pairs

__all__ = ["kernel_takes", "qk_norm_rope", "qk_norm_rope_ref", "qk_norm_rope_write_kv"]

# Steps of at most this many tokens take the fused prologue + KV write (`qk_norm_rope_write_kv`); longer ones
# the two launches, which store the cache rows whole (H100, Qwen3-8B shapes, 36 layers in a CUDA graph, us per
# layer unfused / fused: 1 token 2.53 / 2.11, 64 tokens 5.03 / 3.79, 128 5.51 / 5.24, 256 7.47 / 7.23, 512
# 10.5 / 11.4, 1024 16.7 / 19.8, 2048 29.9 / 36.6). Speed only: both give the same bits.
FUSED_KV_WRITE_MAX_TOKENS = 256
# Elements of q/k per program: several heads per program amortize the per-program cost at 128-dim heads.
_TILE = 1024


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, pos_ptr, freq_ptr, wq_ptr, wk_ptr, qo_ptr, ko_ptr,
                         v_ptr, kc_ptr, vc_ptr, slot_ptr,
                         n_q_heads, n_heads, half, eps,
                         q_st, q_sh, k_st, k_sh, qo_st, qo_sh, ko_st, ko_sh,
                         v_st, v_sh, kc_sb, kc_st, kc_sh, vc_sb, vc_st, vc_sh, block_size, num_slots,
                         HAS_NORM: tl.constexpr, HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr,
                         LIBDEVICE: tl.constexpr, STORE_K: tl.constexpr, WRITE_KV: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)  # PDL (kernels/_pdl.py): wait for the previous kernel before reading anything
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)  # q heads first, then k heads (then v heads: WRITE_KV)
    i = tl.arange(0, BLOCK_HALF)
    is_q = h < n_q_heads
    is_k = (h >= n_q_heads) & (h < n_heads)
    i_ok = i < half
    mq = is_q[:, None] & i_ok[None, :]
    mk = is_k[:, None] & i_ok[None, :]
    hq = tl.where(is_q, h, 0).to(tl.int64)
    hk = tl.where(is_k, h - n_q_heads, 0).to(tl.int64)
    q_src = q_ptr + t * q_st + hq[:, None] * q_sh + i[None, :]
    k_src = k_ptr + t * k_st + hk[:, None] * k_sh + i[None, :]
    # Two masked loads per half (only one of them touches memory for a given head).
    x1 = tl.where(mq, tl.load(q_src, mask=mq, other=0.0), tl.load(k_src, mask=mk, other=0.0))
    x2 = tl.where(mq, tl.load(q_src + half, mask=mq, other=0.0), tl.load(k_src + half, mask=mk, other=0.0))
    dt = qo_ptr.dtype.element_ty
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if HAS_NORM:
        # The head's sum of squares, each row of the tile along its own axis (a fixed tree per row).
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        rstd = tl.math.rsqrt(ss / (2 * half) + eps)
        wq1 = tl.load(wq_ptr + i, mask=i_ok, other=0.0).to(tl.float32)
        wq2 = tl.load(wq_ptr + half + i, mask=i_ok, other=0.0).to(tl.float32)
        wk1 = tl.load(wk_ptr + i, mask=i_ok, other=0.0).to(tl.float32)
        wk2 = tl.load(wk_ptr + half + i, mask=i_ok, other=0.0).to(tl.float32)
        w1 = tl.where(is_q[:, None], wq1[None, :], wk1[None, :])
        w2 = tl.where(is_q[:, None], wq2[None, :], wk2[None, :])
        # Two roundings to the model dtype, as the unfused norm: after the scaling, after the weight.
        x1 = (w1 * (x1 * rstd[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        x2 = (w2 * (x2 * rstd[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    pos = tl.load(pos_ptr + t).to(tl.float32)
    angle = pos * tl.load(freq_ptr + i, mask=i_ok, other=0.0)
    if LIBDEVICE:
        c = libdevice.cos(angle)[None, :]
        s = libdevice.sin(angle)[None, :]
    else:  # Triton's interpreter has no libdevice (numpy's cos/sin there)
        c = tl.cos(angle)[None, :]
        s = tl.sin(angle)[None, :]
    o1 = (x1 * c - x2 * s).to(dt)
    o2 = (x2 * c + x1 * s).to(dt)
    q_dst = qo_ptr + t * qo_st + hq[:, None] * qo_sh + i[None, :]
    k_dst = ko_ptr + t * ko_st + hk[:, None] * ko_sh + i[None, :]
    tl.store(q_dst, o1, mask=mq)
    tl.store(q_dst + half, o2, mask=mq)
    if STORE_K:
        tl.store(k_dst, o1, mask=mk)
        tl.store(k_dst + half, o2, mask=mk)
    if WRITE_KV:
        # write_kv's copy, folded in: the rotated k rows and the v heads go to the token's slot (slot < 0:
        # padding, or past the pool: nothing is written). v rows (h >= n_heads) are loaded here, apart from
        # the norm's tile: the q/k values, their sums and the rotation above are the plain launch's.
        # Splat to the rows (Triton's interpreter types a scalar & vector mask as int, which tl.store refuses).
        slot = tl.broadcast_to(tl.load(slot_ptr + t).to(tl.int64), [HEADS])
        keep = (slot >= 0) & (slot < num_slots)
        blk = slot // block_size
        off = slot % block_size
        mkc = (is_k & keep)[:, None] & i_ok[None, :]
        kc_dst = kc_ptr + (blk * kc_sb + off * kc_st + hk * kc_sh)[:, None] + i[None, :]
        tl.store(kc_dst, o1, mask=mkc)
        tl.store(kc_dst + half, o2, mask=mkc)
        is_v = (h >= n_heads) & (h < 2 * n_heads - n_q_heads)
        mv = (is_v & keep)[:, None] & i_ok[None, :]
        hv = tl.where(is_v, h - n_heads, 0).to(tl.int64)
        v_src = v_ptr + t * v_st + hv[:, None] * v_sh + i[None, :]
        vc_dst = vc_ptr + (blk * vc_sb + off * vc_st + hv * vc_sh)[:, None] + i[None, :]
        tl.store(vc_dst, tl.load(v_src, mask=mv), mask=mv)
        tl.store(vc_dst + half, tl.load(v_src + half, mask=mv), mask=mv)


def _layout_for(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_HALF, HEADS per program, num_warps), from head_dim alone: they fix each head's sum tree."""
    block_half = next_pow2(max(1, head_dim // 2))
    heads = max(1, _TILE // (2 * block_half))
    warps = max(1, min(8, heads * block_half * 2 // 256))
    return block_half, heads, warps


def _validate(op: str, positions, q, k, inv_freq, q_weight, k_weight, eps) -> None:
    for name, t in (("positions", positions), ("q", q), ("k", k), ("inv_freq", inv_freq)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"{op}: need q [T, Hq, D] and k [T, Hkv, D] with one T and D, got {tuple(q.shape)} "
                         f"and {tuple(k.shape)}")
    t, d = q.shape[0], q.shape[2]
    if d % 2:
        raise ValueError(f"{op}: head_dim must be even (rotary pairs i and i + D/2), got {d}")
    if q.dtype != k.dtype:
        raise TypeError(f"{op}: q and k must share one dtype, got {q.dtype} and {k.dtype}")
    if positions.shape != (t,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: positions must be int32/int64 [T] = [{t}], got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    if inv_freq.shape != (d // 2,) or inv_freq.dtype != torch.float32:
        raise ValueError(f"{op}: inv_freq must be float32 [D/2] = [{d // 2}], got {inv_freq.dtype} "
                         f"{tuple(inv_freq.shape)}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError(f"{op}: q_weight and k_weight must both be given (qk_norm) or both be None")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and (not isinstance(w, torch.Tensor) or w.shape != (d,) or w.dtype != q.dtype):
            raise ValueError(f"{op}: {name} must be a {q.dtype} tensor of shape [{d}], got "
                             f"{getattr(w, 'dtype', type(w).__name__)} {tuple(getattr(w, 'shape', ()))}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{op}: eps must be a finite real number >= 0, got {eps!r}")


def kernel_takes(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None) -> bool:
    """Whether the kernel's layout assumptions hold (else callers compose the unfused ops): unit last
    strides, and a norm weight of the model dtype (a promoting weight changes the output dtype)."""
    return q.stride(-1) == 1 and k.stride(-1) == 1 and (q_weight is None or q_weight.dtype == q.dtype)


def qk_norm_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (q', k') contiguous [T, H, D] in q.dtype: per-head RMSNorm (when weights are given) then RoPE.

    q [T, Hq, D], k [T, Hkv, D]: any token/head strides with a unit last stride (views into a fused QKV
    output); positions [T] int; inv_freq [D/2] fp32; q_weight/k_weight [D] in q's dtype, or both None."""
    op = "qk_norm_rope"
    _validate(op, positions, q, k, inv_freq, q_weight, k_weight, eps)
    _check_kernel_takes(op, q, k, q_weight, k_weight, inv_freq)
    return _launch(positions, q, k, inv_freq, q_weight, k_weight, eps, None, store_k=True)


def qk_norm_rope_write_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          inv_freq: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                          eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                          validate: bool | None = None,
                          return_k: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`qk_norm_rope` and `kv_write.write_kv` of its k' and of v in one launch -> (q', k' or None).

    Stores k' and v [T, Hkv, D] (v: any strides, unit last stride) at slot_mapping [T] of the caches
    [num_blocks, block_size, Hkv, D] exactly as write_kv(k', v, ...) would (slot < 0: skipped; `validate`
    as there), and returns q' contiguous [T, Hq, D]; k' too with return_k (else it exists only in the
    cache). Bits: q' and the cache bytes are those of the two separate ops."""
    op = "qk_norm_rope_write_kv"
    _validate(op, positions, q, k, inv_freq, q_weight, k_weight, eps)
    num_slots = check_write_kv(op, k, v, k_cache, v_cache, slot_mapping, validate)
    _check_kernel_takes(op, q, k, q_weight, k_weight, inv_freq)
    if not slot_mapping.is_contiguous():
        slot_mapping = slot_mapping.contiguous()
    return _launch(positions, q, k, inv_freq, q_weight, k_weight, eps,
                   (v, k_cache, v_cache, slot_mapping, num_slots), store_k=return_k)


def _check_kernel_takes(op: str, q, k, q_weight, k_weight, inv_freq) -> None:
    check_kernel_inputs(op, q, k, q_weight, k_weight, inv_freq)
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(f"{op}: q and k need a unit last stride (head_dim contiguous)")


def _launch(positions, q, k, inv_freq, q_weight, k_weight, eps, kv_write, store_k: bool):
    """One launch of the kernel over checked inputs; kv_write: (v, k_cache, v_cache, slot_mapping, num_slots)
    to store k' and v in the caches as well (the grid then also covers the Hkv v heads), or None."""
    positions, inv_freq = positions.contiguous(), inv_freq.contiguous()
    t, hq, d = q.shape
    hkv = k.shape[1]
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hkv, d), dtype=k.dtype, device=k.device) if store_k else None
    if t == 0 or d == 0:
        return q_out, k_out
    block_half, heads, warps = _layout_for(d)
    has_norm = q_weight is not None
    wq = q_weight.contiguous() if has_norm else inv_freq  # unused pointer without a norm
    wk = k_weight.contiguous() if has_norm else inv_freq
    ko = k_out if store_k else q_out  # unused pointer without STORE_K
    if kv_write is None:  # unused pointers and strides without WRITE_KV
        v, k_cache, v_cache, slots, num_slots = q, q_out, q_out, positions, 0
        cache_strides, block_size = (0,) * 6, 1
    else:
        v, k_cache, v_cache, slots, num_slots = kv_write
        cache_strides, block_size = (*k_cache.stride()[:3], *v_cache.stride()[:3]), k_cache.shape[1]
    rows = hq + (2 * hkv if kv_write is not None else hkv)  # q heads, k heads (and v heads)
    pdl = use_pdl(q.device)
    _qk_norm_rope_kernel[(t, triton.cdiv(rows, heads))](
        q, k, positions, inv_freq, wq, wk, q_out, ko, v, k_cache, v_cache, slots,
        hq, hq + hkv, d // 2, float(eps),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1),
        ko.stride(0), ko.stride(1), v.stride(0), v.stride(1), *cache_strides, block_size, num_slots,
        HAS_NORM=has_norm, HEADS=heads, BLOCK_HALF=block_half, LIBDEVICE=not interpreting(),
        STORE_K=store_k, WRITE_KV=kv_write is not None, USE_PDL=pdl,
        # No fma contraction: the same plain mul/add sequence as the unfused torch formulas.
        num_warps=warps, enable_fp_fusion=False, **launch_options(pdl))
    return q_out, k_out


def qk_norm_rope_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor,
                     q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                     eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused definition in pure torch (`rms_norm_ref` per head, then `apply_rope`): batch-invariant
    by construction on any device; with fp64 inputs it doubles as the accuracy reference."""
    _validate("qk_norm_rope_ref", positions, q, k, inv_freq, q_weight, k_weight, eps)
    if q_weight is not None:
        q, k = rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps)
    if q.dtype == torch.float64:  # the accuracy reference: the (fp32, by definition) angle, then fp64
        c, s = rope_angles(positions, inv_freq, torch.float64)
        return rotate_pairs(q, c, s), rotate_pairs(k, c, s)
    return apply_rope(positions, q, k, inv_freq)
