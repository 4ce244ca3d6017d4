"""The ops model code calls, in one of two modes.

`Ops("deterministic")` routes every reduction to a batch-invariant implementation: the Triton kernel for
CUDA tensors of a kernel dtype (bf16/fp16/fp32), otherwise the op's pure-torch `*_ref` (fixed-order folds,
batch-invariant by construction — the CPU path, and fp64 anywhere). `Ops("fast")` uses stock torch
(cuBLAS, fused softmax), which is faster and batch-variant: the engine runs both so the cost of determinism
is measured in one process.

Most elementwise ops (rotary, residual adds, embedding gathers) are batch-invariant already. The exception
is CPU activations: torch's vectorized CPU SiLU handles a tensor's tail with scalar code of a different
approximation, so an element's bits depend on its position in the tensor. `silu_mul` spells SiLU with
exp and a division (position-independent) in deterministic mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from detinfer.kernels._launch import KERNEL_DTYPES

MODES = ("deterministic", "fast")


def _use_triton(*tensors: torch.Tensor | None) -> bool:
    """Triton kernels for CUDA tensors of kernel dtypes; everything else takes the *_ref path."""
    return all(t is None or (t.is_cuda and t.dtype in KERNEL_DTYPES) for t in tensors)


@dataclass(frozen=True)
class Ops:
    mode: str = "deterministic"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")

    @property
    def deterministic(self) -> bool:
        return self.mode == "deterministic"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] @ weight[N, K]^T (+ bias[N]) -> [..., N]."""
        if not self.deterministic:
            return F.linear(x, weight, bias)
        from detinfer.kernels import matmul as mm

        return (mm.linear if _use_triton(x, weight, bias) else mm.linear_ref)(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                 residual: torch.Tensor | None = None):
        """HF-style RMSNorm over the last dim; with `residual`, returns (normed(x + residual), x + residual)."""
        if not self.deterministic:
            h = x if residual is None else x + residual
            hf = h.float()
            y = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
            if weight is not None:
                y = weight * y
            return y if residual is None else (y, h)
        from detinfer.kernels import rmsnorm

        fn = rmsnorm.rms_norm if _use_triton(x, weight, residual) else rmsnorm.rms_norm_ref
        return fn(x, weight, eps, residual=residual)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up (the SwiGLU MLP's elementwise part)."""
        if self.deterministic and not gate.is_cuda:
            from detinfer.ops.aten_impls import silu_cpu

            return silu_cpu(gate) * up
        return F.silu(gate) * up

    def log_softmax(self, x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = torch.float32):
        if not self.deterministic:
            return torch.log_softmax(x, dim=dim, dtype=dtype)
        from detinfer.kernels import softmax

        fn = softmax.log_softmax if _use_triton(x) else softmax.log_softmax_ref
        return fn(x, dim=dim, dtype=dtype)

    def softmax(self, x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = torch.float32):
        if not self.deterministic:
            return torch.softmax(x, dim=dim, dtype=dtype)
        from detinfer.kernels import softmax

        fn = softmax.softmax if _use_triton(x) else softmax.softmax_ref
        return fn(x, dim=dim, dtype=dtype)
