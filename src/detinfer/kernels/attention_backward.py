"""Backward of causal varlen attention with GQA (the training twin of `paged_attention`'s prefill path).

Packed layout: q [T, Hq, D], k, v [T, Hkv, D], sequences cut by cu_seqlens [S+1]; query i of a sequence
sees keys 0..i of the same sequence. Per sequence and kv head, the G = Hq / Hkv query heads are stacked
into one [G * L, D] block, and the recompute backward runs as matmuls in fp32:
    P = softmax(scale * Q K^T) (causal),  dV = P^T dO,  dP = dO V^T,  delta = rowsum(dO * O),
    dS = P * (dP - delta) * scale,  dQ = dS K,  dK = dS^T Q.
Every reduction is the invariant matmul (`matmul_det`: Triton on CUDA, fold-based on CPU) or `fold_sum`,
walking its axis in ascending order into one accumulator: dK / dV of a key reduce over the G * L stacked
queries in a fixed order (head-major, then query), with no atomics. A sequence's gradients depend only on
that sequence, not on how the training batch was packed. Memory: one [G * L, L] fp32 score block per kv
head of one sequence at a time.
"""

from __future__ import annotations

import torch

from detinfer.kernels._fold import fold_sum
from detinfer.kernels.linear_backward import matmul_det

__all__ = ["attention_backward_ref", "attention_forward_ref"]


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
