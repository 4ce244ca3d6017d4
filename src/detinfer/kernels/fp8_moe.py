"""The mixture-of-experts SwiGLU layer over block-scaled FP8 expert weights: routing and the combine are the
bf16 layer's own (kernels/moe.py: fp32 router logits, stable top-k, combine in routing-rank order), and each
hit expert runs gate_up, SiLU*mul and down on its gathered rows through an FP8 linear (kernels/fp8_linear.py).

Batch-invariant whenever the FP8 linear is: an FP8 linear is row-wise (each row's activation scales and
reduction depend on that row only), so a gathered row's result does not depend on which rows were gathered
with it. Two paths: `expert_outputs_fp8`, a host loop over the hit experts (the CPU path, like the bf16
layer's ref), and `expert_outputs_fp8_grouped`, the grouped Triton GEMMs (CUDA: one launch per projection for
all experts, no host sync, so CUDA graphs capture it), which matches the loop up to the tensor cores' fp8
accumulation (GPU-only, like kernels/fp8_linear.py's kernel).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

# The SwiGLU epilogue both grouped expert kernels share (a module-level name: the kernel below resolves it
# from this module's globals, in the compiler and in Triton's interpreter alike).
from detinfer.kernels.moe import swiglu_epilogue


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


# -- the grouped FP8 expert GEMMs (CUDA: one launch per projection for all experts, no host sync) --------------
def expert_config_fp8(n: int, k: int) -> dict:
    """The launch config of an FP8 expert GEMM: from (N, K) only, never from the rows per expert (the reason
    kernels/moe.py's `expert_config` gives). BLOCK_K is the scale block: one scale pair per fp32 partial."""
    return dict(BLOCK_M=64, BLOCK_N=128 if n >= 1024 else 64, BLOCK_K=128, num_warps=4,
                num_stages=4 if k >= 1024 else 3)


@functools.cache
def _grouped_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _expert_fp8_kernel(a_ptr, sa_ptr, w_ptr, sw_ptr, out_ptr, pair_ptr, tile_expert_ptr, N, K, KB, top_k,
                           stride_am, stride_sam, stride_we, stride_wn, stride_swe, stride_swn, stride_om,
                           GATHER_TOKENS: tl.constexpr, SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """One BLOCK_M x BLOCK_N tile of one expert: the FP8 linear's K-block loop (kernels/fp8_linear.py) on
        the tile's gathered rows (with SWIGLU: gate rows n and up rows N + n, then silu(gate) * up)."""
        expert = tl.load(tile_expert_ptr + tl.program_id(0))
        if expert < 0:  # a spare tile of the fixed-size grid
            return
        pair = tl.load(pair_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))  # -1: padding row
        valid = pair >= 0
        if GATHER_TOKENS:
            row = tl.where(valid, pair // top_k, 0).to(tl.int64)
        else:
            row = tl.where(valid, pair, 0).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        rk = tl.arange(0, BLOCK_K)
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        s_base = sw_ptr + expert.to(tl.int64) * stride_swe
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, KB):
            kk = kb * BLOCK_K + rk
            k_ok = kk < K
            a = tl.load(a_ptr + row[:, None] * stride_am + kk[None, :], mask=valid[:, None] & k_ok[None, :],
                        other=0.0)
            sa = tl.load(sa_ptr + row * stride_sam + kb, mask=valid, other=0.0)
            w_mask = n_ok[None, :] & k_ok[:, None]
            b = tl.load(w_base + offs_n[None, :].to(tl.int64) * stride_wn + kk[:, None], mask=w_mask, other=0.0)
            sb = tl.load(s_base + offs_n.to(tl.int64) * stride_swn + kb, mask=n_ok, other=0.0)
            acc += (tl.dot(a, b, out_dtype=tl.float32) * sa[:, None]) * sb[None, :]
            if SWIGLU:
                bu = tl.load(w_base + (offs_n[None, :] + N).to(tl.int64) * stride_wn + kk[:, None], mask=w_mask,
                             other=0.0)
                su = tl.load(s_base + (offs_n + N).to(tl.int64) * stride_swn + kb, mask=n_ok, other=0.0)
                acc_up += (tl.dot(a, bu, out_dtype=tl.float32) * sa[:, None]) * su[None, :]
        if SWIGLU:
            acc = swiglu_epilogue(acc, acc_up, out_ptr)  # kernels/moe.py's, as the per-expert path rounds
        out_rows = tl.where(valid, pair, 0).to(tl.int64)
        tl.store(out_ptr + out_rows[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & n_ok[None, :])

    return triton, _expert_fp8_kernel


def expert_outputs_fp8_grouped(x: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor, s_gate_up: torch.Tensor,
                               w_down: torch.Tensor, s_down: torch.Tensor,
                               first_expert: int | None = None) -> torch.Tensor:
    """`expert_outputs_fp8` on two grouped Triton launches (CUDA, fp8 tensor cores): the token rows are
    quantized once (per row: the same x_q whichever expert reads them), each tile of one expert's gathered
    rows runs the FP8 K-block loop; the SwiGLU output is quantized per row for the down projection. No host
    sync (CUDA-graph capturable). Batch-invariant: the configs come from (N, K) only."""
    from detinfer.kernels.fp8_linear import quantize_activations_gpu as quantize_activations  # one launch
    from detinfer.kernels.fp8_quant import num_blocks
    from detinfer.kernels.moe_routing import group_by_expert

    T, k = ids.shape
    E, two_i, H = w_gate_up.shape
    foreign = first_expert is not None  # slots of other ranks' experts are never computed: zero them
    inter = two_i // 2
    triton, kernel = _grouped_kernel()
    w_gate_up, s_gate_up = w_gate_up.contiguous(), s_gate_up.contiguous()
    w_down, s_down = w_down.contiguous(), s_down.contiguous()
    act = torch.empty(T * k, inter, dtype=x.dtype, device=x.device)
    y = (torch.zeros if foreign else torch.empty)(T * k, H, dtype=x.dtype, device=x.device)
    a_q, a_s = quantize_activations(x)
    for w, s, out, n, kdim, gather in ((w_gate_up, s_gate_up, act, inter, H, True),
                                       (w_down, s_down, y, H, inter, False)):
        if not gather:
            a_q, a_s = quantize_activations(act)
        cfg = expert_config_fp8(n, kdim)
        pair_ids, tile_expert, tiles = group_by_expert(ids, E, cfg["BLOCK_M"], first_expert)
        kernel[(tiles, triton.cdiv(n, cfg["BLOCK_N"]))](
            a_q, a_s, w, s, out, pair_ids, tile_expert, n, kdim, num_blocks(kdim), k, a_q.stride(0), a_s.stride(0),
            w.stride(0), w.stride(1), s.stride(0), s.stride(1), out.stride(0), GATHER_TOKENS=gather, SWIGLU=gather,
            **cfg)
    return y.view(T, k, H)
