"""Write a step's new K/V into the paged cache (before attention runs), so attention reads every key of a
sequence from one place in one order whether it was computed this step or steps ago.

k, v [T, Hkv, D] (any token/head strides, unit last stride: e.g. views into a fused QKV projection);
caches [num_blocks, block_size, Hkv, D]; slot_mapping [T] int32/int64 with slot = block * block_size +
offset. A slot < 0 is skipped (padded rows of a CUDA-graph batch); so is a slot past the pool, which
`validate` reports instead of letting the kernel write out of bounds. A pure copy: no arithmetic, so
nothing here can depend on the batch (how many tokens a program copies is a speed choice only).

The engine's model runner stores K/V through the attention prologue instead where that runs its kernel
(`rope_qk.qk_norm_rope_write_kv`: the same copy in the same launch as q/k's norm and rotary, one launch per
layer fewer); this op is the write of every other caller, and that fused write takes exactly its inputs
(`check_write_kv`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detinfer.kernels._launch import check_kernel_inputs, interpreting
from detinfer.kernels._pdl import launch_options, pdl_start, use_pdl

__all__ = ["check_write_kv", "write_kv", "write_kv_ref"]


@triton.jit(do_not_specialize=["num_tokens", "num_slots"])
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, num_tokens, num_slots, block_size,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, TOKENS: tl.constexpr,
                     BLOCK_HD: tl.constexpr, USE_PDL: tl.constexpr):
    """TOKENS tokens per program; each row is one token's NUM_HEADS x HEAD_DIM values, flattened."""
    pdl_start(USE_PDL)  # PDL (kernels/_pdl.py): wait for the previous kernel before reading anything
    t = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)
    slot = tl.load(slot_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
    keep = (slot >= 0) & (slot < num_slots)
    blk = slot // block_size
    off = slot % block_size
    c = tl.arange(0, BLOCK_HD)
    h = c // HEAD_DIM
    d = c % HEAD_DIM
    mask = keep[:, None] & (c < NUM_HEADS * HEAD_DIM)[None, :]
    k = tl.load(k_ptr + t[:, None] * stride_kt + (h * stride_kh + d)[None, :], mask=mask)
    v = tl.load(v_ptr + t[:, None] * stride_vt + (h * stride_vh + d)[None, :], mask=mask)
    kc = kc_ptr + (blk * stride_kcb + off * stride_kct)[:, None] + (h * stride_kch + d)[None, :]
    vc = vc_ptr + (blk * stride_vcb + off * stride_vct)[:, None] + (h * stride_vch + d)[None, :]
    tl.store(kc, k, mask=mask)
    tl.store(vc, v, mask=mask)


def _validate(op: str, k, v, k_cache, v_cache, slot_mapping) -> None:
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("slot_mapping", slot_mapping)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"{op}: k and v must both be [T, Hkv, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"{op}: k_cache and v_cache must both be [num_blocks, block_size, Hkv, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if tuple(k.shape[1:]) != tuple(k_cache.shape[2:]):
        raise ValueError(f"{op}: k/v heads and head_dim {tuple(k.shape[1:])} do not match the cache's "
                         f"{tuple(k_cache.shape[2:])}")
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype or k.dtype != v.dtype:
        raise TypeError(f"{op}: k, v and the caches must share one dtype (no silent casts), got {k.dtype}, "
                        f"{v.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: slot_mapping must be int32/int64 [T] = [{k.shape[0]}], got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if slot_mapping.device != k.device:
        raise ValueError(f"{op}: slot_mapping is on {slot_mapping.device} but k is on {k.device}")
    if any(t.stride(-1) != 1 for t in (k, v, k_cache, v_cache)):
        raise ValueError(f"{op}: k, v and the caches need a contiguous last (head_dim) dimension")


def _check_slots(op: str, slot_mapping: torch.Tensor, num_slots: int) -> None:
    slots = slot_mapping.cpu()
    if slots.numel() and int(slots.max()) >= num_slots:
        raise ValueError(f"{op}: slot_mapping holds slot {int(slots.max())} but the cache has "
                         f"{num_slots} slots (num_blocks * block_size); negative slots mean 'skip'")
    used = slots[slots >= 0]
    if used.unique().numel() != used.numel():
        # Two tokens racing for one slot would leave whichever write lands last: not deterministic.
        raise ValueError(f"{op}: slot_mapping writes some slot twice in one step")


def check_write_kv(op: str, k, v, k_cache, v_cache, slot_mapping, validate: bool | None) -> int:
    """Every check of a kernel KV write (shared with the attention prologue's fused write, which must accept
    exactly what this op does) -> num_slots. validate None: the slot values unless a graph is captured."""
    _validate(op, k, v, k_cache, v_cache, slot_mapping)
    check_kernel_inputs(op, k, v, k_cache, v_cache)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if validate is None:
        validate = not (k.is_cuda and torch.cuda.is_current_stream_capturing())
    if validate:
        _check_slots(op, slot_mapping, num_slots)
    return num_slots


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, validate: bool | None = None) -> None:
    """Copy k[t], v[t] into cache slot slot_mapping[t] (in place). validate: check slots are inside the
    pool (one host sync); None = unless a CUDA graph is being captured."""
    op = "write_kv"
    num_slots = check_write_kv(op, k, v, k_cache, v_cache, slot_mapping, validate)
    t, h, d = k.shape
    if t == 0:
        return
    if not slot_mapping.is_contiguous():
        slot_mapping = slot_mapping.contiguous()
    block_hd = triton.next_power_of_2(h * d)
    # ~4096 elements per program (8 KB of bf16 per tensor: 16-byte accesses for 128 threads, several in
    # flight); the interpreter takes bigger tiles because each program costs it milliseconds.
    tokens = max(1, min(triton.next_power_of_2(t), (1 << 16 if interpreting() else 4096) // block_hd))
    pdl = use_pdl(k.device)
    _write_kv_kernel[(triton.cdiv(t, tokens),)](
        k, v, k_cache, v_cache, slot_mapping, t, num_slots, k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        NUM_HEADS=h, HEAD_DIM=d, TOKENS=tokens, BLOCK_HD=block_hd, USE_PDL=pdl, num_warps=4,
        **launch_options(pdl))


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, **_ignored) -> None:
    """`write_kv` in pure torch (in place; any dtype/device). Always checks slots (host sync)."""
    op = "write_kv_ref"
    _validate(op, k, v, k_cache, v_cache, slot_mapping)
    _check_slots(op, slot_mapping, k_cache.shape[0] * k_cache.shape[1])
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(torch.int64)
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]
