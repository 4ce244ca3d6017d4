"""Backward of SwiGLU's elementwise part, out = silu(gate) * up. Elementwise, so trivially batch-invariant.

With s = sigmoid(g): dgate = dout * up * s * (1 + g * (1 - s)), dup = dout * silu(g). Math in fp32 (fp64
for fp64), cast back to the input dtype. sigmoid is spelled 1 / (1 + exp(-g)) because torch's vectorized
CPU sigmoid rounds a tensor's SIMD tail differently (position-dependent bits; see ops/aten_impls.py).
"""

from __future__ import annotations

import torch

from detinfer.kernels.activations import sigmoid_cpu

__all__ = ["silu_mul_backward_ref"]


def silu_mul_backward_ref(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    """-> (dgate, dup) in the dtypes of gate and up."""
    acc = torch.float64 if gate.dtype == torch.float64 else torch.float32
    g, u, d = gate.to(acc), up.to(acc), dout.to(acc)
    s = sigmoid_cpu(g)
    dgate = d * u * s * (1 + g * (1 - s))
    dup = d * g * s
    return dgate.to(gate.dtype), dup.to(up.dtype)
