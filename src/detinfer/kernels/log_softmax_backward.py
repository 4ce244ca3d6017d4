"""Backward of `log_softmax(logits)[t, target_t]` (the logprob of one chosen token per row).

lp_t = z_t,c - logsumexp(z_t), so d z_t,j = g_t * ([j == c] - p_t,j) with p = exp(log_softmax(z)).
Only one entry per row is gathered, so there is no reduction at all: every element of the gradient is an
elementwise function of its own logprob, the row's incoming gradient and whether it is the target.
"""

from __future__ import annotations

import torch

__all__ = ["log_softmax_gather_backward_ref"]


def log_softmax_gather_backward_ref(grad: torch.Tensor, logprobs: torch.Tensor,
                                    targets: torch.Tensor) -> torch.Tensor:
    """grad [T] (d loss / d lp_t), logprobs [T, V] (the forward's full log_softmax), targets [T] int64
    -> d logits [T, V] in logprobs' dtype."""
    g = grad.to(logprobs.dtype)
    dz = torch.exp(logprobs).mul_(-g[:, None])
    rows = torch.arange(dz.shape[0], device=dz.device)
    dz[rows, targets] += g  # one element per row: no two writes collide, so no order to fix
    return dz
