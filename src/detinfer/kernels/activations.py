"""Position-independent pure-torch spellings of the activations whose stock CPU kernels are not: torch's
vectorized CPU SiLU / sigmoid / GELU / softplus round a tensor's SIMD tail differently from its body, so an
element's bits would depend on where it sits in the tensor (and thus on the batch). Plain elementwise
exp / division / erf / tanh have no such tail. The one definition of each: deterministic mode's CPU SiLU*mul
(`Ops.silu_mul`), the drop-in mode's CPU overrides (ops/aten_impls.py), `silu_mul_ref`, the MoE reference's
experts and the SwiGLU backward use them.
"""

from __future__ import annotations

import math

import torch

__all__ = ["gelu_cpu", "sigmoid_cpu", "silu_cpu", "softplus_cpu"]


def silu_cpu(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x))


def sigmoid_cpu(x: torch.Tensor) -> torch.Tensor:
    return 1 / (1 + torch.exp(-x))


def gelu_cpu(x: torch.Tensor, *, approximate: str = "none") -> torch.Tensor:
    if approximate == "tanh":
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)))
    return 0.5 * x * (1 + torch.erf(x * (1 / math.sqrt(2))))


def softplus_cpu(x: torch.Tensor, beta=1, threshold=20) -> torch.Tensor:
    bx = x * beta
    return torch.where(bx > threshold, x, torch.log1p(torch.exp(bx)) / beta)
