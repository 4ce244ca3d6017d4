"""The pure-torch reference of kernels/matmul.py: the CPU path (and the fp64 path) of matmul / bmm / linear,
and the shape and dtype checks both paths share.

Only elementwise products and fixed-order folds (`fold_sum`), walked over K in constant blocks of
`REF_BLOCK_K`, so they are batch-invariant and zero-extension-invariant by construction, for any float
dtype (contracts A and B of kernels/matmul.py). `linear_ref` takes the exact-chunk-sum path of
`_exact_dot` where it applies (bf16/fp16/fp32 weights with finite rows), the fold otherwise.
"""

from __future__ import annotations

import math

import torch

from detinfer.kernels._exact_dot import exact_linear_fp32, rounded_weight
from detinfer.kernels._fold import fold_sum

__all__ = ["matmul_ref", "bmm_ref", "linear_ref", "REF_BLOCK_K", "REF_MAX_PRODUCTS"]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _check_same_dtype(op: str, *tensors: torch.Tensor | None) -> None:
    dts = {t.dtype for t in tensors if t is not None}
    if len(dts) > 1:
        raise TypeError(f"{op}: all operands must have one dtype, got {sorted(map(_name, dts))}")


def _check_matmul_shapes(op: str, a: torch.Tensor, b: torch.Tensor, nd: int) -> None:
    if a.dim() != nd or b.dim() != nd:
        want = "[M, K] and [K, N]" if nd == 2 else "[B, M, K] and [B, K, N]"
        raise ValueError(f"{op}: expected {nd}-D operands {want}, got shapes {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"{op}: inner dimensions differ: a is {tuple(a.shape)} (K={a.shape[-1]}), "
                         f"b is {tuple(b.shape)} (K={b.shape[-2]})")
    if nd == 3 and a.shape[0] != b.shape[0]:
        raise ValueError(f"{op}: batch sizes differ: a has {a.shape[0]}, b has {b.shape[0]} (no broadcasting)")


def _check_linear_shapes(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() < 1 or weight.dim() != 2:
        raise ValueError(f"{op}: expected x [..., K] and weight [N, K], got shapes {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{op}: x has K={x.shape[-1]} features but weight {tuple(weight.shape)} expects "
                         f"K={weight.shape[1]} (weight is [N, K], nn.Linear layout)")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"{op}: bias must have shape [N] = [{weight.shape[0]}], got {tuple(bias.shape)}")


# K block of the reference: products of one block are summed by a pairwise fold, blocks are added in
# order starting at k = 0. A constant (never chosen from K): that is what makes appending zeros to K
# exact (the last block's fold pads to a power of two <= REF_BLOCK_K with zeros anyway, and whole extra
# blocks add exact zeros).
REF_BLOCK_K = 32
# At most this many fp32/fp64 products are materialised at once (4-8 MiB, cache-friendly): bounds memory for
# big vocabularies. Chunking only groups elementwise work, so it cannot change any bit.
REF_MAX_PRODUCTS = 1 << 20


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    if not dtype.is_floating_point:
        raise TypeError(f"the *_ref matmuls take floating-point tensors, got {_name(dtype)}")
    return torch.float64 if dtype == torch.float64 else torch.float32


def _ref_bnk(a: torch.Tensor, bt: torch.Tensor, bias: torch.Tensor | None,
             acc: torch.Tensor | None = None) -> torch.Tensor:
    """a [B, M, K] times bt [B, N, K] (B operand with K last) -> [B, M, N] in a.dtype.

    `acc` (optional, [B, M, N] in the accumulation dtype): the K blocks are added onto it in place instead
    of onto zeros, which continues an earlier call's K walk bit for bit when that call's K was a multiple
    of REF_BLOCK_K (the same blocks, added in the same order)."""
    acc_dt = _acc_dtype(a.dtype)
    nb, m, k = a.shape
    n = bt.shape[1]
    if acc is None:
        acc = torch.zeros((nb, m, n), dtype=acc_dt, device=a.device)
    elif acc.shape != (nb, m, n) or acc.dtype != acc_dt:
        raise ValueError(f"the accumulator must be {(nb, m, n)} {_name(acc_dt)}, got {tuple(acc.shape)} "
                         f"{_name(acc.dtype)}")
    per_row = max(1, n * REF_BLOCK_K)
    rows = max(1, REF_MAX_PRODUCTS // per_row)  # rows of one batch entry per step
    batches = max(1, rows // max(m, 1)) if m <= rows else 1
    for k0 in range(0, k, REF_BLOCK_K):
        k1 = min(k, k0 + REF_BLOCK_K)
        w = bt[:, :, k0:k1].to(acc_dt).contiguous()  # [B, N, kb], converted once per K block
        for z0 in range(0, nb, batches):
            z1 = min(nb, z0 + batches)
            for r0 in range(0, m, rows):
                r1 = min(m, r0 + rows)
                x = a[z0:z1, r0:r1, k0:k1].to(acc_dt)  # [b, r, kb]
                prod = x[:, :, None, :] * w[z0:z1, None, :, :]  # [b, r, N, kb]: exact elementwise products
                acc[z0:z1, r0:r1] += fold_sum(prod, dim=-1)
    if bias is not None:
        acc += bias.to(acc_dt)
    return acc.to(a.dtype)


def _check_ref_inputs(op: str, *tensors: torch.Tensor | None) -> None:
    for t in tensors:
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: expected torch.Tensor, got {type(t).__name__}")
    _check_same_dtype(op, *tensors)
    for t in tensors:
        if t is not None:
            _acc_dtype(t.dtype)
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise ValueError(f"{op}: all tensors must be on one device, got {sorted(map(str, devices))}")


def matmul_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pure-torch `matmul` (any float dtype; fp32 accumulation, fp64 for fp64). Batch-invariant."""
    _check_ref_inputs("matmul_ref", a, b)
    _check_matmul_shapes("matmul_ref", a, b, 2)
    return _ref_bnk(a.unsqueeze(0), b.t().unsqueeze(0), None)[0]


def bmm_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pure-torch `bmm` (any float dtype). Batch-invariant."""
    _check_ref_inputs("bmm_ref", a, b)
    _check_matmul_shapes("bmm_ref", a, b, 3)
    return _ref_bnk(a, b.transpose(1, 2), None)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-torch `linear` (any float dtype). Batch-invariant; bias added after the reduction."""
    _check_ref_inputs("linear_ref", x, weight, bias)
    _check_linear_shapes("linear_ref", x, weight, bias)
    n, k = weight.shape
    x2 = x.reshape(math.prod(x.shape[:-1]), k)
    wq = rounded_weight(weight) if x.dtype != torch.float64 and x2.shape[0] and n else None
    if wq is None:  # float64 (the accuracy reference), a weight with inf/NaN, or an empty product
        y = _ref_bnk(x2.unsqueeze(0), weight.unsqueeze(0), bias)[0]
    else:
        y = _linear_exact(x2, weight, wq, bias)
    return y.reshape(tuple(x.shape[:-1]) + (n,))


def _linear_exact(x2: torch.Tensor, weight: torch.Tensor, wq: torch.Tensor, bias: torch.Tensor | None):
    """The exact-chunk-sum path (`_exact_dot`). A row holding an inf or a NaN has no grid: such rows (and
    only they, so a row's path never depends on its neighbours) take the fold path."""
    acc = exact_linear_fp32(x2, wq)
    if acc is None:
        finite = torch.isfinite(x2).all(-1)
        acc = torch.empty((x2.shape[0], weight.shape[0]), dtype=torch.float32, device=x2.device)
        ok = finite.nonzero().squeeze(-1)
        bad = (~finite).nonzero().squeeze(-1)
        if ok.numel():
            acc[ok] = exact_linear_fp32(x2[ok], wq)
        acc[bad] = _ref_bnk(x2[bad].unsqueeze(0), weight.unsqueeze(0), None)[0].to(torch.float32)
    if bias is not None:
        acc += bias.to(torch.float32)  # after the reduction, in float32 (as the kernel does)
    return acc.to(x2.dtype)
