"""The mixture-of-experts SwiGLU layer over block-scaled FP8 expert weights: routing and the combine are the
bf16 layer's own (kernels/moe.py: fp32 router logits, stable top-k, combine in routing-rank order), and each
hit expert runs gate_up, SiLU*mul and down on its gathered rows through an FP8 linear (kernels/fp8_linear.py).

Batch-invariant whenever the FP8 linear is: an FP8 linear is row-wise (each row's activation scales and
reduction depend on that row only), so a gathered row's result does not depend on which rows were gathered
with it. A host loop over the hit experts (like the bf16 layer's CPU ref): it syncs with the host, so an FP8
MoE model runs without CUDA graphs; a grouped fp8 GEMM kernel (one launch for all experts) is future work.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def expert_outputs_fp8(x: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor, s_gate_up: torch.Tensor,
                       w_down: torch.Tensor, s_down: torch.Tensor, linear_fp8: Callable, silu_mul: Callable,
                       first_expert: int | None = None) -> torch.Tensor:
    """y [T, k, H] in x's dtype: y[t, r] = expert ids[t, r] applied to x[t] (experts [first_expert, +E_local)
    are held; other slots stay zero). `linear_fp8(x, w, scales)` and `silu_mul(gate, up)` are the backend's."""
    T, k = ids.shape
    inter = w_down.shape[2]
    y = x.new_zeros(T * k, x.shape[1])
    flat = ids.reshape(-1) - (first_expert or 0)
    for e in torch.unique(flat).tolist():
        if not 0 <= e < w_down.shape[0]:
            continue  # another rank's expert
        pairs = (flat == e).nonzero().squeeze(1)
        gate, up = linear_fp8(x[pairs // k], w_gate_up[e], s_gate_up[e]).split(inter, dim=-1)
        y[pairs] = linear_fp8(silu_mul(gate, up), w_down[e], s_down[e])
    return y.view(T, k, -1)
