"""Backward of SwiGLU's elementwise part, out = silu(gate) * up. Elementwise, so trivially batch-invariant.

With s = sigmoid(g): dgate = dout * up * s * (1 + g * (1 - s)), dup = dout * silu(g). Math in fp32 (fp64
for fp64), cast back to the input dtype. sigmoid is spelled 1 / (1 + exp(-g)) because torch's vectorized
CPU sigmoid rounds a tensor's SIMD tail differently (position-dependent bits; see ops/aten_impls.py).

`silu_mul_backward` is the Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1): one pass that reads
dout, gate and up (any of fp16/bf16/fp32, gate and up by row strides, so the two halves of the fused
gate_up projection need no copies) and writes dgate and dup, the same formula in the same order of
operations in fp32. On the GPU the sigmoid's exp is libdevice's and its division Triton's fp32 division,
so the bits may differ from the reference's in the last place (tests compare by tolerance there); every
element is a function of its own three inputs only, so the result is row-slice invariant and two runs
are bitwise equal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from detinfer.kernels._launch import check_kernel_inputs, interpreting
from detinfer.kernels.activations import sigmoid_cpu
from detinfer.kernels.silu_mul import _rows, _validate

__all__ = ["silu_mul_backward", "silu_mul_backward_ref"]

_BLOCK = 1024  # elements of a row per program: 4 warps, 8 values (16 bytes of bf16) per thread and tensor


@triton.jit
def _silu_mul_backward_kernel(d_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n_cols, d_st, g_st, u_st, dg_st, du_st,
                              BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    d = tl.load(d_ptr + row * d_st + cols, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * g_st + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_st + cols, mask=ok, other=0.0).to(tl.float32)
    if LIBDEVICE:
        e = libdevice.exp(-g)
    else:  # Triton's interpreter has no libdevice (numpy's exp there)
        e = tl.exp(-g)
    s = 1.0 / (1.0 + e)
    # the reference's order: ((dout * up) * s) * (1 + g * (1 - s)) and (dout * g) * s
    dgate = d * u * s * (1.0 + g * (1.0 - s))
    dup = d * g * s
    tl.store(dg_ptr + row * dg_st + cols, dgate.to(dg_ptr.dtype.element_ty), mask=ok)
    tl.store(du_ptr + row * du_st + cols, dup.to(du_ptr.dtype.element_ty), mask=ok)


def silu_mul_backward(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    """-> (dgate, dup): new contiguous tensors of gate's shape and dtype (fp16/bf16/fp32)."""
    op = "silu_mul_backward"
    _validate(op, gate, up)
    if not isinstance(dout, torch.Tensor) or dout.shape != gate.shape:
        raise ValueError(f"{op}: dout must be a tensor of gate's shape {tuple(gate.shape)}, got "
                         f"{tuple(dout.shape) if isinstance(dout, torch.Tensor) else type(dout).__name__}")
    check_kernel_inputs(op, dout, gate, up)
    dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    dup = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    n = gate.shape[-1]
    if dgate.numel() == 0:
        return dgate, dup
    d2, g2, u2 = _rows(dout), _rows(gate), _rows(up)
    dg2, du2 = dgate.view(-1, n), dup.view(-1, n)
    # no fma contraction: the reference's separate roundings (and the interpreter's) on the GPU too
    _silu_mul_backward_kernel[(g2.shape[0], triton.cdiv(n, _BLOCK))](
        d2, g2, u2, dg2, du2, n, d2.stride(0), g2.stride(0), u2.stride(0), dg2.stride(0), du2.stride(0),
        BLOCK=_BLOCK, LIBDEVICE=not interpreting(), num_warps=4, enable_fp_fusion=False)
    return dgate, dup


def silu_mul_backward_ref(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    """-> (dgate, dup) in the dtypes of gate and up."""
    acc = torch.float64 if gate.dtype == torch.float64 else torch.float32
    g, u, d = gate.to(acc), up.to(acc), dout.to(acc)
    s = sigmoid_cpu(g)
    dgate = d * u * s * (1 + g * (1 - s))
    dup = d * g * s
    return dgate.to(gate.dtype), dup.to(up.dtype)
