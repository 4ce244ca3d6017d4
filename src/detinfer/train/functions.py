"""torch.autograd.Functions for every op of the model's training forward in deterministic mode.

Each Function's forward calls the engine's own op (passed in as `fwd`, e.g. the model's `ops.linear`),
so the forward bits are exactly the engine's; its backward is a fixed-order kernel from
`detinfer.kernels.*_backward` (no atomics, no reduction whose order depends on the batch composition).
Weight gradients come back in fp32; autograd casts them to the parameter's dtype unless the parameter
asks for fp32 gradients (`Tensor.grad_dtype`, see `TrainableModel`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from detinfer.kernels._launch import interpreting
from detinfer.kernels.attention_backward import attention_backward, attention_backward_ref, kernel_supports
from detinfer.kernels.embedding_backward import embedding_backward, embedding_backward_ref
from detinfer.kernels.linear_backward import linear_backward, use_triton
from detinfer.kernels.log_softmax_backward import log_softmax_gather_backward_ref
from detinfer.kernels.moe_backward import moe_backward
from detinfer.kernels.rmsnorm import MAX_D
from detinfer.kernels.rmsnorm_backward import rms_norm_backward, rms_norm_backward_ref
from detinfer.kernels.rope_backward import rope_angles, rope_backward_ref
from detinfer.kernels.silu_mul_backward import silu_mul_backward, silu_mul_backward_ref

__all__ = ["AttentionFn", "EmbeddingFn", "LinearFn", "LogprobFn", "MoEFn", "QKNormRopeFn", "RMSNormFn",
           "RotaryFn", "SiLUMulFn"]


def _rms_norm_backward(dy, dh, x, residual, weight, eps: float):
    """The Triton kernel for CUDA tensors of kernel dtypes and D <= MAX_D; the reference elsewhere (CPU,
    fp64). Both give the reference's results (the kernel's bits differ, not its accuracy)."""
    kernel = use_triton(dy, dh, x, residual, weight) and 1 <= x.shape[-1] <= MAX_D
    return (rms_norm_backward if kernel else rms_norm_backward_ref)(dy, dh, x, residual, weight, eps)


def _silu_mul_backward(dout, gate, up):
    """The Triton kernel for CUDA tensors of kernel dtypes; the reference elsewhere (CPU, fp64)."""
    return (silu_mul_backward if use_triton(dout, gate, up) else silu_mul_backward_ref)(dout, gate, up)


def _embedding_backward(dh, ids, num_embeddings: int):
    """The Triton segment sum for CUDA tensors of kernel dtypes; the reference elsewhere (CPU, fp64)."""
    return (embedding_backward if use_triton(dh) else embedding_backward_ref)(dh, ids, num_embeddings)


class LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, fwd: Callable):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return fwd(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx, dw, db = linear_backward(dy, x, weight, ctx.has_bias)
        return dx, dw, db, None


class MoEFn(torch.autograd.Function):
    """The engine's whole MoE layer forward (`base.moe`: its bits); backward `moe_backward` with the routing
    recomputed by `base.moe_route` (the rule the forward used, so the same experts and weights)."""

    @staticmethod
    def forward(ctx, x, router_weight, w_gate_up, w_down, top_k: int, renormalize: bool, base):
        ctx.save_for_backward(x, router_weight, w_gate_up, w_down)
        ctx.top_k, ctx.renormalize, ctx.base = top_k, renormalize, base
        return base.moe(x, router_weight, w_gate_up, w_down, top_k, renormalize)

    @staticmethod
    def backward(ctx, dout):
        x, router_weight, w_gate_up, w_down = ctx.saved_tensors
        weights, ids = ctx.base.moe_route(x, router_weight, ctx.top_k, ctx.renormalize)
        grads = moe_backward(dout, x, router_weight, w_gate_up, w_down, weights, ids, ctx.renormalize)
        return (*grads, None, None, None)


class RMSNormFn(torch.autograd.Function):
    """y = rms_norm(x (+ residual)) * w; with a residual also returns h = x + residual."""

    @staticmethod
    def forward(ctx, x, weight, residual, eps: float, fwd: Callable):
        ctx.save_for_backward(x, weight, residual)
        ctx.eps, ctx.has_residual = eps, residual is not None
        return fwd(x, weight, eps, residual=residual)

    @staticmethod
    def backward(ctx, dy, dh=None):
        x, weight, residual = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(x)
        dx, dres, dw = _rms_norm_backward(dy, dh, x, residual, weight, ctx.eps)
        return dx, dw, dres, None, None


class SiLUMulFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, fwd: Callable):
        ctx.save_for_backward(gate, up)
        return fwd(gate, up)

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        dgate, dup = _silu_mul_backward(dout, gate, up)
        return dgate, dup, None


class RotaryFn(torch.autograd.Function):
    """(q, k) -> rotary(positions, q, k), the model's own rotary module in the forward."""

    @staticmethod
    def forward(ctx, q, k, positions, rotary):
        ctx.save_for_backward(positions, rotary.inv_freq)
        ctx.dtypes = (q.dtype, k.dtype)
        return rotary(positions, q, k)

    @staticmethod
    def backward(ctx, dq, dk):
        positions, inv_freq = ctx.saved_tensors
        cos, sin = rope_angles(positions, inv_freq)
        dq = None if dq is None else rope_backward_ref(dq, cos, sin, ctx.dtypes[0])
        dk = None if dk is None else rope_backward_ref(dk, cos, sin, ctx.dtypes[1])
        return dq, dk, None, None


class QKNormRopeFn(torch.autograd.Function):
    """(q, k) -> rotary(per-head RMSNorm (q, k)), the backend's fused attention prologue (`Ops.qk_norm_rope`)
    in the forward; the backward is the unfused ops' backwards (rotary, then the norm) from saved inputs,
    the same arithmetic as RotaryFn followed by RMSNormFn."""

    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, positions, inv_freq, eps: float, fwd: Callable):
        ctx.save_for_backward(q, k, q_weight, k_weight, positions, inv_freq)
        ctx.eps = eps
        return fwd(positions, q, k, inv_freq, q_weight, k_weight, eps)

    @staticmethod
    def backward(ctx, dq, dk):
        q, k, q_weight, k_weight, positions, inv_freq = ctx.saved_tensors
        cos, sin = rope_angles(positions, inv_freq)
        grads = []
        for dout, x, w in ((dq, q, q_weight), (dk, k, k_weight)):
            if dout is None:
                grads.append((None, None))
                continue
            # the rotation's input was the normed x, of dtype promote(w, x) (x itself without a norm)
            normed_dtype = x.dtype if w is None else torch.promote_types(w.dtype, x.dtype)
            dn = rope_backward_ref(dout, cos, sin, normed_dtype)
            if w is None:
                grads.append((dn, None))
            else:
                dx, _, dw = _rms_norm_backward(dn, None, x, None, w, ctx.eps)
                grads.append((dx, dw))
        (dq_in, dwq), (dk_in, dwk) = grads
        return dq_in, dk_in, dwq, dwk, None, None, None, None


class EmbeddingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.num_embeddings = weight.shape[0]
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, dh):
        (ids,) = ctx.saved_tensors
        return None, _embedding_backward(dh, ids, ctx.num_embeddings)


class LogprobFn(torch.autograd.Function):
    """lp[t] = log_softmax(logits)[t, targets[t]] with the engine's log_softmax (sampler.compute_logprobs).
    Keeps the whole [T, V] log-distribution for backward: `score` uses the chunked output layer of
    logprobs.py instead, which is tested bitwise against this unchunked form."""

    @staticmethod
    def forward(ctx, logits, targets, log_softmax: Callable):
        logprobs = log_softmax(logits, dim=-1)
        ctx.save_for_backward(logprobs, targets)
        return logprobs.gather(1, targets[:, None])[:, 0]

    @staticmethod
    def backward(ctx, grad):
        logprobs, targets = ctx.saved_tensors
        return log_softmax_gather_backward_ref(grad, logprobs, targets).to(logprobs.dtype), None, None


def _attention_kernel_backward_runs(q: torch.Tensor) -> bool:
    """The Triton backward runs on CUDA (and on CPU in fp32 under Triton's interpreter, as the engine's
    attention kernel), for head_dims it takes; the pure-torch reference elsewhere."""
    kernel_ok = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16, torch.float32) or \
        (interpreting() and q.dtype == torch.float32)
    return kernel_ok and kernel_supports(q.shape[-1])


class AttentionFn(torch.autograd.Function):
    """Causal varlen GQA attention: forward = the engine's paged attention (via `fwd(q, k, v)`), backward =
    the fixed-order recompute backward over the same packed layout.

    `fwd_fills_lse`: `fwd` takes `lse_out=` (a [T, Hq] fp32 buffer for the rows' log-sum-exps, as
    `paged_attention` defines them). Then, where the Triton backward runs, the forward stores them and the
    backward reads them instead of recomputing (one pass over the keys fewer). The reference backward
    recomputes its own softmax in its accumulation dtype and takes none."""

    @staticmethod
    def forward(ctx, q, k, v, fwd: Callable, cu_seqlens: list[int], scale: float, fwd_fills_lse: bool = False):
        lse = None
        if fwd_fills_lse and _attention_kernel_backward_runs(q):
            lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
            out = fwd(q, k, v, lse_out=lse)
        else:
            out = fwd(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cu_seqlens, ctx.scale = cu_seqlens, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        args = (dout.contiguous(), q, k, v, out, ctx.cu_seqlens, ctx.scale)
        if lse is not None:
            dq, dk, dv = attention_backward(*args, lse=lse)
        elif _attention_kernel_backward_runs(q):
            dq, dk, dv = attention_backward(*args)
        else:
            dq, dk, dv = attention_backward_ref(*args)
        return dq, dk, dv, None, None, None, None
