"""SwiGLU's elementwise part, out = silu(gate) * up, in one launch that reads gate and up by strides (the two
halves of the fused gate_up projection's output: no split copies).

Semantics, those of `F.silu(gate) * up` on CUDA: silu in fp32 rounded to the model dtype, then the product
of two model-dtype values computed in fp32 and rounded. silu is spelled g / (1 + exp(-g)) with libdevice's
accurate expf.

Batch invariance: purely elementwise (no reduction), so each output element is a function of its own gate
and up elements only; the tile size is a constant, and would not matter anyway.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from detinfer.kernels._direct import LaunchCache
from detinfer.kernels._launch import check_kernel_inputs, interpreting
from detinfer.kernels.activations import silu_cpu

__all__ = ["silu_mul", "silu_mul_ref"]

_BLOCK = 1024  # elements of a row per program (4 warps, 8 values per thread)


@triton.jit
def silu_mul_values(g, u, o_ptr, LIBDEVICE: tl.constexpr):
    """silu(g) * u for fp32 g, u holding model-dtype values, rounded to o_ptr's element type (only its type
    is read). The one spelling of the formula: kernels/linear_silu_mul.py's epilogue calls it too, so the
    fused gate_up projection gives these bits."""
    dt = o_ptr.dtype.element_ty
    if LIBDEVICE:
        e = libdevice.exp(-g)
    else:  # Triton's interpreter has no libdevice (numpy's exp there)
        e = tl.exp(-g)
    s = (g / (1.0 + e)).to(dt).to(tl.float32)
    return (s * u).to(dt)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, o_ptr, n_cols, g_st, u_st, o_st, BLOCK: tl.constexpr,
                     LIBDEVICE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g = tl.load(g_ptr + row * g_st + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_st + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * o_st + cols, silu_mul_values(g, u, o_ptr, LIBDEVICE), mask=ok)


# Compiled kernels remembered per launch key (kernels/_direct.py): one decode step launches this per layer.
_LAUNCHES = LaunchCache(_silu_mul_kernel)


def _validate(op: str, gate, up) -> None:
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if gate.shape != up.shape or gate.dim() < 1:
        raise ValueError(f"{op}: gate and up must have one shape [..., I], got {tuple(gate.shape)} and "
                         f"{tuple(up.shape)}")
    if gate.dtype != up.dtype:
        raise TypeError(f"{op}: gate and up must share one dtype, got {gate.dtype} and {up.dtype}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., I] -> [M, I] with a unit last stride: a view when the leading dims merge (e.g. one half of a
    [T, 2I] projection output), else a copy."""
    if t.dim() == 1:
        t = t[None]
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return t.reshape(-1, t.shape[-1]).contiguous()


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up -> a new contiguous tensor of gate's shape and dtype (fp16/bf16/fp32)."""
    op = "silu_mul"
    _validate(op, gate, up)
    check_kernel_inputs(op, gate, up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    n = gate.shape[-1]
    if out.numel() == 0:
        return out
    g2, u2, o2 = _rows(gate), _rows(up), out.view(-1, n)
    tensors, strides = (g2, u2, o2), (g2.stride(0), u2.stride(0), o2.stride(0))
    key = (g2.shape[0], n, strides, gate.dtype)  # fixes the grid and every scalar
    if not _LAUNCHES.try_launch(key, tensors):
        _LAUNCHES.launch(key, tensors, (g2.shape[0], triton.cdiv(n, _BLOCK)), (n, *strides),
                         dict(BLOCK=_BLOCK, LIBDEVICE=not interpreting()), num_warps=4)
    return out


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The same formula in pure torch, math in fp32 (fp64 for fp64: the accuracy reference), silu rounded to
    the input dtype before the product. Elementwise with exp and a division (torch's vectorized CPU SiLU
    rounds a tensor's SIMD tail differently), so batch-invariant on any device."""
    _validate("silu_mul_ref", gate, up)
    acc = torch.float64 if gate.dtype == torch.float64 else torch.float32
    g = gate.to(acc)
    s = silu_cpu(g).to(gate.dtype).to(acc)
    return (s * up.to(acc)).to(gate.dtype)
