"""Backward of the MoE layer (kernels/moe.py), every reduction in a fixed order: two identical steps give
identical gradients, bit for bit (no atomics, no index_add in arrival order).

Forward (per token t, routing ranks r = 0 .. k-1, e = ids[t, r]):
    logits = x R^T (fp32);  p = softmax(logits);  v[t, r] = p[t, e];  w = v / sum_r v (renormalize) or v
    a[t, r] = silu(g) * u  with [g u] = x[t] Wgu[e]^T;  y[t, r] = a[t, r] W2[e]^T;  out[t] = sum_r w y
Gradients, with the roundings of the forward taken as identities (what autograd does for a bf16 layer):
    dy[t, r] = w[t, r] dout[t]        dw[t, r] = <dout[t], y[t, r]> (fp32, over H)
    per expert e, its slots in (t, r) order: dW2[e], da by `linear_backward`; dg, du by
    `silu_mul_backward_ref`; dWgu[e] and the slots' dx by `linear_backward` (tokens reduced in ascending
    slot order in fixed blocks)
    routing: dv from dw through the renormalisation, dlogits = p (dp - <dp, p>) with dp non-zero only at the
    k chosen experts (so <dp, p> is a k-term sum in rank order), then dR and dx by `linear_backward` in fp32
    dx[t] = the k slot contributions in rank order, then the router's.
The routing itself (which experts) has no gradient, as in every MoE implementation.

The per-expert loop runs on the host (training steps are not graph-captured); the expert outputs y and
activations are recomputed from x with the invariant `linear` (the forward's grouped GEMM is not kept).
"""

from __future__ import annotations

import torch

from detinfer.kernels.linear_backward import linear_backward, use_triton
from detinfer.kernels.matmul_ref import _acc_dtype
from detinfer.kernels.silu_mul import silu_mul_ref
from detinfer.kernels.silu_mul_backward import silu_mul_backward_ref

__all__ = ["moe_backward"]


def _router_probs(x: torch.Tensor, router_weight: torch.Tensor) -> torch.Tensor:
    """softmax(x R^T) in fp32 (fp64 for fp64), by the same invariant ops as `moe.route` / `route_ref`."""
    from detinfer.kernels import matmul, softmax

    acc = _acc_dtype(x.dtype)
    if use_triton(x, router_weight):
        from detinfer.kernels.moe import router_logits

        return softmax.softmax(router_logits(x, router_weight), dim=-1)
    return softmax.softmax_ref(matmul.linear_ref(x.to(acc), router_weight.to(acc)), dim=-1)


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    from detinfer.kernels import matmul

    return (matmul.linear if use_triton(x, weight) else matmul.linear_ref)(x, weight)


def _routing_backward(dw: torch.Tensor, probs: torch.Tensor, ids: torch.Tensor, renormalize: bool):
    """dw [T, k] (gradient of the combine weights) -> dlogits [T, E]."""
    v = probs.gather(1, ids)  # [T, k]
    dv = dw
    if renormalize:
        total = v[:, 0]
        for r in range(1, v.shape[1]):
            total = total + v[:, r]
        w = v / total[:, None]
        dot = dw[:, 0] * w[:, 0]
        for r in range(1, w.shape[1]):
            dot = dot + dw[:, r] * w[:, r]
        dv = (dw - dot[:, None]) / total[:, None]
    inner = dv[:, 0] * v[:, 0]  # <dp, p>: dp is non-zero only at the chosen experts
    for r in range(1, v.shape[1]):
        inner = inner + dv[:, r] * v[:, r]
    dp = torch.zeros_like(probs).scatter(1, ids, dv)  # a row's k ids are distinct: plain writes
    return probs * (dp - inner[:, None])


def moe_backward(dout: torch.Tensor, x: torch.Tensor, router_weight: torch.Tensor, w_gate_up: torch.Tensor,
                 w_down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, renormalize: bool):
    """(dx in x.dtype, dR, dWgu, dW2 in fp32 (fp64 for fp64)) for out = moe(x, ...) with the forward's
    routing (weights [T, k], ids [T, k]); see the module doc."""
    T, H = x.shape
    k = ids.shape[1]
    E, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    acc = _acc_dtype(x.dtype)
    d = dout.to(acc)
    flat_ids, flat_w = ids.reshape(-1), weights.reshape(-1).to(acc)
    dx_slots = torch.zeros(T * k, H, dtype=acc, device=x.device)
    y_slots = torch.zeros(T * k, H, dtype=acc, device=x.device)
    d_gate_up = torch.zeros(E, two_i, H, dtype=acc, device=x.device)
    d_down = torch.zeros(E, H, inter, dtype=acc, device=x.device)
    for e in torch.unique(flat_ids).tolist():  # ascending experts; slots of each in (t, r) order
        slots = (flat_ids == e).nonzero().squeeze(1)
        x_e = x[slots // k]
        gate, up = _linear(x_e, w_gate_up[e]).split(inter, dim=-1)
        a = silu_mul_ref(gate, up)  # x's dtype, as the forward rounds the activations
        y_slots[slots] = _linear(a, w_down[e]).to(acc)
        dy = (flat_w[slots, None] * d[slots // k]).to(x.dtype)
        da, dw2, _ = linear_backward(dy, a, w_down[e], False)
        dgate, dup = silu_mul_backward_ref(da, gate, up)
        dx_e, dwgu, _ = linear_backward(torch.cat((dgate, dup), dim=-1), x_e, w_gate_up[e], False)
        dx_slots[slots] = dx_e.to(acc)
        d_down[e], d_gate_up[e] = dw2.to(acc), dwgu.to(acc)
    y_slots = y_slots.view(T, k, H)
    dw = (d[:, None, :] * y_slots).sum(dim=-1)  # [T, k]; torch's sum: run-to-run fixed for fixed shapes
    probs = _router_probs(x, router_weight)
    dlogits = _routing_backward(dw, probs, ids, renormalize)
    dx_router, d_router, _ = linear_backward(dlogits, x.to(acc), router_weight.to(acc), False)
    dx_slots = dx_slots.view(T, k, H)
    dx = dx_slots[:, 0]
    for r in range(1, k):  # a token's slot contributions in routing-rank order, then the router's
        dx = dx + dx_slots[:, r]
    dx = dx + dx_router.to(acc)
    return dx.to(x.dtype), d_router.to(acc), d_gate_up, d_down
