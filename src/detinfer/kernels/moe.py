"""Batch-invariant fused mixture-of-experts (MoE) layer: router, top-k, grouped expert GEMMs, combine.

    out[t] = sum_r w[t, r] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = ids[t, r],  r = 0 .. top_k - 1

Contract (asserted bitwise in tests/kernels/test_moe.py): for fixed weights, out[t] depends only on x[t],
not on how many tokens there are, where t sits, or which experts the other tokens chose. That takes four
things a stock MoE does not do:

- Routing in fp32 with a stable tie-break. Router logits are fp32 outputs of the invariant matmul
  (`router_logits`: exact 16-bit products, fp32 sums in the kernel's fixed K order), the softmax is the
  invariant one, and top-k is a stable descending sort: equal scores go to the lower expert
  id. (`torch.topk` leaves the order of ties unspecified, and its algorithm changes with the tensor size;
  bf16 logits one ULP apart would flip routing, fp32 logits of a fixed reduction order cannot.)
  Renormalisation (`renormalize`, HF's `norm_topk_prob`) adds the k chosen probabilities in rank order.
- Grouped GEMMs whose reduction order does not depend on an expert's row count. The (token, rank) pairs
  are grouped by expert and padded to whole BLOCK_M tiles (one expert per tile); every tile walks K upward
  into one fp32 accumulator with a launch config that is a function of (N, K, dtype) only
  (`expert_config`), never of M or of how many rows an expert received. A pair's output row therefore has
  the same bits whether its expert got 1 row or 2000.
- The combine in routing-rank order: out[t] accumulates w[t, 0] * y[t, 0], then w[t, 1] * y[t, 1], ...
  in fp32 (elementwise ops, no atomics, no index_add in arrival order), then rounds once to x's dtype.
- Expert parallelism splits the layer in two: `expert_outputs` / `expert_outputs_ref` (each slot's expert
  output, rounded to x's dtype as the fused layer rounds it, computed by whichever rank holds the expert),
  then `combine_slots` on the gathered slots: the same numbers in the same order as the fused layer
  (kernels/moe_combine.py: one Triton launch with `combine_slots_ref`'s bits).
- No host syncs on the kernel path (the top-k and the grouping by expert are one Triton launch each,
  kernels/moe_routing.py, with the torch references' bits), so a decode step that runs it can be captured in
  a CUDA graph.

`fused_moe` is the Triton path (CUDA, or fp32/fp16 CPU tensors under TRITON_INTERPRET=1). `fused_moe_ref`
is the CPU path: the same routing and combine, each expert's rows through the invariant `linear_ref` (a
row's result does not depend on how many rows are gathered). Fast mode: `moe_fast` on a GPU (stock routing,
the same grouped GEMMs with a tile height chosen from the rows per expert, a stock weighted sum; no host
sync), `moe_stock` elsewhere and as the benchmark's baseline (the HF-style loop: router in x's dtype,
torch.topk, F.linear per hit expert, index_add_; batch-variant and host-syncing).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from detinfer.kernels._launch import KERNEL_DTYPES, check_kernel_inputs, dot_precision
from detinfer.kernels.activations import silu_cpu
from detinfer.kernels.matmul_ref import _acc_dtype
from detinfer.kernels.moe_combine import combine_slots, combine_slots_ref
from detinfer.kernels.moe_routing import TOPK_MAX_EXPERTS, group_by_expert, topk_stable, topk_stable_ref

__all__ = ["ExpertConfig", "combine_slots", "combine_slots_fast", "combine_slots_ref", "expert_config",
           "expert_outputs", "expert_outputs_ref", "fast_config_for", "fused_moe", "fused_moe_ref", "moe_experts",
           "moe_experts_ref", "moe_fast", "moe_stock", "route", "route_ref", "route_stock", "router_logits"]


# --------------------------------------------------------------------------------------------- routing
def _check_moe_inputs(op: str, x, router_weight, w_gate_up, w_down, top_k: int) -> None:
    for name, t, nd in (("x", x, 2), ("router_weight", router_weight, 2), ("w_gate_up", w_gate_up, 3),
                        ("w_down", w_down, 3)):
        if not isinstance(t, torch.Tensor) or t.dim() != nd:
            raise ValueError(f"{op}: {name} must be a {nd}-D tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    E, H = router_weight.shape
    _, two_i, _ = w_gate_up.shape
    if x.shape[1] != H or w_gate_up.shape != (E, two_i, H) or two_i % 2 or w_down.shape != (E, H, two_i // 2):
        raise ValueError(f"{op}: shapes do not fit: x {tuple(x.shape)}, router_weight [E, H] "
                         f"{tuple(router_weight.shape)}, w_gate_up [E, 2I, H] {tuple(w_gate_up.shape)}, "
                         f"w_down [E, H, I] {tuple(w_down.shape)}")
    if not (isinstance(top_k, int) and 1 <= top_k <= E):
        raise ValueError(f"{op}: top_k must be an int in [1, {E}] (the number of experts), got {top_k!r}")
    if len({x.dtype, w_gate_up.dtype, w_down.dtype}) > 1 or not x.dtype.is_floating_point:
        raise TypeError(f"{op}: x, w_gate_up and w_down must share one floating dtype, got "
                        f"{x.dtype}, {w_gate_up.dtype}, {w_down.dtype}")


def route_ref(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool):
    """(weights [T, k] fp32, expert ids [T, k] int64) by the fixed-order references (CPU path)."""
    from detinfer.kernels.matmul import linear_ref
    from detinfer.kernels.softmax import softmax_ref

    acc = _acc_dtype(x.dtype)
    logits = linear_ref(x.to(acc), router_weight.to(acc))
    return topk_stable_ref(softmax_ref(logits, dim=-1), top_k, renormalize)


def router_logits(x: torch.Tensor, router_weight: torch.Tensor) -> torch.Tensor:
    """fp32 router logits [T, E] = x @ router_weight^T on the invariant Triton matmul (one place: `route` and the
    backward's recompute both call it). fp32 output always: one bf16 ULP would flip routing.

    16-bit x and weight on a GPU go straight into the 16-bit tensor-core kernel with an fp32 output tile: the
    product of two 16-bit numbers is exact in fp32 and the kernel adds them in its fixed K order, so nothing
    is lost against fp32 copies, and neither the two cast launches nor the fp32 FMA kernel (a 30B-A3B decode
    step spent ~48 us per layer there on an H100: ~2 ms of ~10) are needed. Its bits are those of that
    kernel's order, not of the fp32 FMA chain: a different (equally batch-invariant) routing than before.
    Elsewhere (fp32 models, Triton's CPU interpreter, whose 16-bit dot is not IEEE) fp32 copies through the
    fp32 kernel, as `route_ref` does on the host."""
    from detinfer.kernels import matmul

    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and router_weight.dtype == x.dtype:
        x2, w = x.reshape(-1, x.shape[-1]), router_weight
        t, (e, h) = x2.shape[0], w.shape
        out = torch.empty((t, e), dtype=torch.float32, device=x.device)
        # A [1, T, H] row-major, B [1, H, E] = W^T through W's strides, C [1, T, E] fp32.
        matmul._run(x2, (0, x2.stride(0), x2.stride(1)), w, (0, w.stride(1), w.stride(0)), out,
                    (0, e, 1), None, 1, t, e, h, None)
        return out
    return matmul.linear(x.float(), router_weight.float())


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool):
    """`route_ref` with the invariant Triton matmul (`router_logits`), softmax (fp32 out) and the top-k in one
    launch (`topk_stable`: the reference's bits; rows wider than it takes go through the reference)."""
    from detinfer.kernels.softmax import softmax

    top = topk_stable if router_weight.shape[0] <= TOPK_MAX_EXPERTS else topk_stable_ref
    return top(softmax(router_logits(x, router_weight), dim=-1), top_k, renormalize)


def route_stock(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool):
    """Fast mode's routing: the router GEMM in x's dtype, torch's softmax (fp32 out) and torch.topk (ties and
    rounding may follow the batch)."""
    probs = torch.softmax(F.linear(x, router_weight), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def combine_slots_fast(weights: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Fast mode's combine: a stock weighted sum over the k slots (torch.sum's order)."""
    return (y.float() * weights[:, :, None]).sum(dim=1).to(dtype)


# ------------------------------------------------------------------------------------- reference path
def expert_outputs_ref(x: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                       first_expert: int | None = None) -> torch.Tensor:
    """y [T, k, H] in x's dtype: y[t, r] = expert ids[t, r] applied to x[t], through `linear_ref` per expert
    (batch-invariant: a gathered row's result does not depend on how many rows are gathered with it).
    w_gate_up / w_down hold experts [first_expert, first_expert + E_local) (an expert-parallel rank's block):
    slots routed elsewhere stay zero."""
    from detinfer.kernels.matmul import linear_ref

    T, k = ids.shape
    inter = w_down.shape[2]
    y = x.new_zeros(T * k, x.shape[1])
    flat = ids.reshape(-1) - (first_expert or 0)
    for e in torch.unique(flat).tolist():  # the CPU path: a host loop over the hit experts is fine
        if not 0 <= e < w_down.shape[0]:
            continue  # another rank's expert
        pairs = (flat == e).nonzero().squeeze(1)
        gate, up = linear_ref(x[pairs // k], w_gate_up[e]).split(inter, dim=-1)
        y[pairs] = linear_ref(silu_cpu(gate) * up, w_down[e])
    return y.view(T, k, -1)


def moe_experts_ref(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
                    w_down: torch.Tensor) -> torch.Tensor:
    """The experts and combine for given routing (`expert_outputs_ref`, then `combine_slots_ref`)."""
    return combine_slots_ref(weights, expert_outputs_ref(x, ids, w_gate_up, w_down), x.dtype)


def fused_moe_ref(x: torch.Tensor, router_weight: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                  top_k: int, renormalize: bool) -> torch.Tensor:
    """Pure-torch `fused_moe` (any float dtype). Batch-invariant by construction."""
    _check_moe_inputs("fused_moe_ref", x, router_weight, w_gate_up, w_down, top_k)
    if x.shape[0] == 0:
        return x.new_zeros(x.shape)
    weights, ids = route_ref(x, router_weight, top_k, renormalize)
    return moe_experts_ref(x, weights, ids, w_gate_up, w_down)


# --------------------------------------------------------------------------------------------- fast mode
def moe_stock(x: torch.Tensor, router_weight: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              top_k: int, renormalize: bool) -> torch.Tensor:
    """Fast mode: the HF-style loop (router in x's dtype, torch.topk, F.linear per hit expert with that
    expert's row count as M, index_add_ in expert order). Batch-variant; syncs with the host."""
    weights, ids = route_stock(x, router_weight, top_k, renormalize)
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        token, rank = torch.where(ids == e)
        gate, up = F.linear(x[token], w_gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w_down[e]) * weights[token, rank, None]
        out.index_add_(0, token, y.to(x.dtype))
    return out


def moe_fast(x: torch.Tensor, router_weight: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
             top_k: int, renormalize: bool) -> torch.Tensor:
    """Fast mode on a GPU: stock routing (router GEMM in x's dtype through cuBLAS, torch.topk, torch.sum)
    and the grouped expert GEMMs with a tile height picked from the rows per expert, as tuned fused-MoE
    kernels pick theirs; a stock weighted sum over the k slots. No host sync (CUDA-graph capturable),
    unlike `moe_stock`, whose per-expert loop costs ~10 launches and a sync per hit expert and layer."""
    _check_moe_inputs("moe_fast", x, router_weight, w_gate_up, w_down, top_k)
    if x.shape[0] == 0:
        return x.new_zeros(x.shape)
    weights, ids = route_stock(x, router_weight, top_k, renormalize)
    y = expert_outputs(x, ids, w_gate_up, w_down, fast_config_for(x.shape[0] * top_k / router_weight.shape[0]))
    return combine_slots_fast(weights, y, x.dtype)


def fast_config_for(rows_per_expert: float):
    """Fast mode's launch config of the expert GEMMs, chosen from the average rows per expert (M): exactly
    what the deterministic path must not do."""
    def config_for(n, k, dtype, device):
        if device.type != "cuda":
            return expert_config(n, k, dtype, device)
        if rows_per_expert <= 16:
            return ExpertConfig((16, 64, 128, 4, 4))
        return ExpertConfig((32, 64, 64, 4, 4)) if rows_per_expert <= 48 else expert_config(n, k, dtype, device)
    return config_for


# --------------------------------------------------------------------------------------------- kernel
class ExpertConfig(tuple):
    """(block_m, block_n, block_k, num_warps, num_stages) of the grouped expert GEMMs."""

    block_m = property(lambda s: s[0])
    block_n = property(lambda s: s[1])
    block_k = property(lambda s: s[2])
    num_warps = property(lambda s: s[3])
    num_stages = property(lambda s: s[4])


def expert_config(n: int, k: int, dtype: torch.dtype, device: torch.device) -> ExpertConfig:
    """The one launch config of an expert GEMM of output width n and reduction length k. Deliberately NOT
    a function of M (tokens, or rows per expert): in Triton's CPU interpreter BLOCK_K is part of the
    reduction order, and on a GPU a config picked from M is how stock fused-MoE kernels become
    batch-variant (a tuned table keyed by M, split-K for small M). A 64-row tile is a compromise: decode
    (a few rows per expert) is bound by reading the expert weights, which does not depend on BLOCK_M;
    prefill (~M * top_k / E rows per expert) gets 64 rows of reuse per weight tile."""
    if device.type != "cuda":
        # The interpreter's tl.dot is numpy's matmul (BLAS), whose result for a row depends on the row's
        # position in the block: one row per tile there (as the matmul kernel's interpreter config does).
        return ExpertConfig((1, 64, 32, 4, 1))
    if dtype == torch.float32:
        return ExpertConfig((64, 64, 32, 4, 3))
    return ExpertConfig((64, 64, 64, 4, 3))


@triton.jit
def swiglu_epilogue(acc_gate, acc_up, out_ptr):
    """The grouped expert GEMMs' SwiGLU epilogue (this module's kernel and kernels/fp8_moe.py's, one spelling):
    gate and up rounded to the output dtype first, as a separate gate_up linear's output is, then
    silu(gate) * up in fp32 (rounded by the caller's store; only out_ptr's element type is read)."""
    g = acc_gate.to(out_ptr.dtype.element_ty).to(tl.float32)
    u = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _expert_gemm_kernel(a_ptr, w_ptr, out_ptr, pair_ptr, tile_expert_ptr, N, K, top_k,
                        stride_am, stride_we, stride_wn, stride_om,
                        GATHER_TOKENS: tl.constexpr, SWIGLU: tl.constexpr, PRECISION: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One BLOCK_M x BLOCK_N tile of one expert: out[pair] = a[row(pair)] @ w[e]^T over K ascending into
    one fp32 accumulator (two with SWIGLU: gate rows n and up rows N + n, then silu(gate) * up)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + pid_m)
    if expert < 0:  # a spare tile of the fixed-size grid
        return
    pair = tl.load(pair_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # -1: padding row
    valid = pair >= 0
    if GATHER_TOKENS:
        row = tl.where(valid, pair // top_k, 0).to(tl.int64)
    else:
        row = tl.where(valid, pair, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(a_ptr + row[:, None] * stride_am + kk[None, :], mask=valid[:, None] & (kk[None, :] < K),
                    other=0.0)
        w_mask = (offs_n[None, :] < N) & (kk[:, None] < K)
        b = tl.load(w_base + offs_n[None, :].to(tl.int64) * stride_wn + kk[:, None], mask=w_mask, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if SWIGLU:
            bu = tl.load(w_base + (offs_n[None, :] + N).to(tl.int64) * stride_wn + kk[:, None], mask=w_mask,
                         other=0.0)
            acc_up = tl.dot(a, bu, acc_up, input_precision=PRECISION)
    if SWIGLU:
        acc = swiglu_epilogue(acc, acc_up, out_ptr)
    out_rows = tl.where(valid, pair, 0).to(tl.int64)
    tl.store(out_ptr + out_rows[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & (offs_n[None, :] < N))


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor) -> torch.Tensor:
    """The experts and combine for given routing on the Triton grouped GEMMs (see the module doc)."""
    return combine_slots(weights, expert_outputs(x, ids, w_gate_up, w_down), x.dtype)


def expert_outputs(x: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                   config_for=None, first_expert: int | None = None) -> torch.Tensor:
    """y [T, k, H]: y[t, r] = expert ids[t, r] applied to x[t], on the Triton grouped GEMMs.
    `config_for(n, k, dtype, device)`: the launch config (default `expert_config`; fast mode passes one
    that looks at M). `first_expert` (expert parallelism): the weights hold experts [first_expert,
    first_expert + E_local); slots routed elsewhere are zero. A computed slot's bits are those of the full
    layer's: its tile walks the same K with the same config, only the weights' base pointer moves."""
    T, k = ids.shape
    E, two_i, H = w_gate_up.shape
    foreign = first_expert is not None  # slots of other ranks' experts are never computed: zero them
    inter = two_i // 2
    x = x.contiguous()
    w_gate_up, w_down = w_gate_up.contiguous(), w_down.contiguous()
    config_for = expert_config if config_for is None else config_for
    cfg_up = config_for(inter, H, x.dtype, x.device)
    cfg_down = config_for(H, inter, x.dtype, x.device)
    act = torch.empty(T * k, inter, dtype=x.dtype, device=x.device)
    y = (torch.zeros if foreign else torch.empty)(T * k, H, dtype=x.dtype, device=x.device)
    groups = {}  # block_m -> grouping (both GEMMs share one when their tile heights agree)
    for cfg, a, w, out, n, kdim, gather in ((cfg_up, x, w_gate_up, act, inter, H, True),
                                            (cfg_down, act, w_down, y, H, inter, False)):
        if cfg.block_m not in groups:
            groups[cfg.block_m] = group_by_expert(ids, E, cfg.block_m, first_expert)
        pair_ids, tile_expert, tiles = groups[cfg.block_m]
        grid = (tiles, triton.cdiv(n, cfg.block_n))
        _expert_gemm_kernel[grid](a, w, out, pair_ids, tile_expert, n, kdim, k, a.stride(0), w.stride(0),
                                  w.stride(1), out.stride(0), GATHER_TOKENS=gather, SWIGLU=gather,
                                  PRECISION=dot_precision(x.dtype), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                                  BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y.view(T, k, H)


def fused_moe(x: torch.Tensor, router_weight: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              top_k: int, renormalize: bool) -> torch.Tensor:
    """Batch-invariant MoE layer on Triton kernels. x [T, H]; router_weight [E, H]; w_gate_up [E, 2I, H]
    (gate rows then up rows, HF's fused layout); w_down [E, H, I]. Returns [T, H] in x's dtype."""
    _check_moe_inputs("fused_moe", x, router_weight, w_gate_up, w_down, top_k)
    check_kernel_inputs("fused_moe", x, router_weight, w_gate_up, w_down, dtypes=KERNEL_DTYPES)
    if x.shape[0] == 0:
        return x.new_zeros(x.shape)
    weights, ids = route(x, router_weight, top_k, renormalize)
    return moe_experts(x, weights, ids, w_gate_up, w_down)
