"""Fused SwiGLU activation, out = silu(gate) * up, in one launch (fast mode's MLP activation).

Stock torch spells it as two kernels (F.silu, then the multiply), each reading and writing the [T, I]
intermediate; serving stacks (vLLM's `silu_and_mul`) fuse them. This kernel reads gate and up once and
writes the product once, math in fp32 with a single rounding to the output dtype:

    out = (g / (1 + exp(-g))) * u        g, u upcast to fp32

Elementwise, so every element's bits depend only on its own (g, u): batch-invariant by construction on
any launch shape (it could serve deterministic mode too, but its rounding differs from the two-kernel
F.silu(g) * u that mode uses, and deterministic mode's bits are not changed here). `silu_mul_ref` is the
same formula in pure torch (fp64 for fp64 inputs: the accuracy reference of the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detinfer.kernels._direct import LaunchCache
from detinfer.kernels._launch import check_kernel_inputs

__all__ = ["silu_mul", "silu_mul_ref"]

# Columns per program: 4 KB of bf16 per operand, 8 elements (16 bytes) per thread at 4 warps.
BLOCK_COLS = 1024
_WARPS = 4


@triton.jit(do_not_specialize=["n_rows"])
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n_rows, n_cols, g_stride, u_stride, out_stride,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g = tl.load(g_ptr + row * g_stride + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_stride + cols, mask=ok, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


_LAUNCHES = LaunchCache(_silu_mul_kernel)


def _check_pair(op: str, gate, up) -> None:
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{op}: {name} must be a float tensor, got dtype {t.dtype}")
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(f"{op}: gate and up must have one shape, dtype and device; got {tuple(gate.shape)} "
                         f"{gate.dtype} {gate.device} and {tuple(up.shape)} {up.dtype} {up.device}")
    if gate.dim() < 1:
        raise ValueError(f"{op}: gate and up must have at least 1 dim [..., I], got 0-dim tensors")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[rows, I] with unit inner stride: a view for the usual split of a [T, 2I] gate_up output."""
    r = t if t.dim() == 2 else t.reshape(-1, t.shape[-1])
    return r if r.shape[-1] <= 1 or r.stride(-1) == 1 else r.contiguous()


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate, up [..., I] (fp16/bf16/fp32, any row strides): one kernel launch."""
    _check_pair("silu_mul", gate, up)
    check_kernel_inputs("silu_mul", gate, up)
    n_cols = gate.shape[-1]
    g2, u2 = _rows(gate), _rows(up)
    n_rows = g2.shape[0]
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if n_rows == 0 or n_cols == 0:
        return out
    if n_rows > 2**31 - 1:
        raise ValueError(f"silu_mul: {n_rows} rows exceed the kernel's grid limit of 2**31 - 1")
    tensors, strides = (g2, u2, out), (g2.stride(0), u2.stride(0), n_cols)
    key = (n_rows, n_cols, strides, gate.dtype)  # fixes the grid and every scalar
    if not _LAUNCHES.try_launch(key, tensors):
        _LAUNCHES.launch(key, tensors, (n_rows, -(-n_cols // BLOCK_COLS)), (n_rows, n_cols, *strides),
                         dict(BLOCK=BLOCK_COLS), num_warps=_WARPS)
    return out


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The kernel's formula in pure torch: fp32 math (fp64 for fp64 inputs), one rounding."""
    _check_pair("silu_mul_ref", gate, up)
    acc = torch.float64 if gate.dtype == torch.float64 else torch.float32
    g, u = gate.to(acc), up.to(acc)
    return (g / (1 + torch.exp(-g)) * u).to(gate.dtype)
