"""The mixture-of-experts ops of the numerics backend (`Ops` inherits them; ops/backend.py's rule, MoE part):

- `moe`: the whole SwiGLU MoE layer. Deterministic: the batch-invariant fused kernel (kernels/moe.py) or its
  reference; fast: grouped GEMMs with an M-chosen config and stock routing, or the stock loop.
- `moe_route` / `moe_expert_outputs` / `moe_combine`: the same layer in parts, for expert parallelism
  (distributed/layers.py): chosen by the same rule, so route -> slot outputs -> combine gives `moe`'s bits.
"""

from __future__ import annotations

import torch


class MoeOps:
    """Mixed into `Ops`: reads its `deterministic`, `dtype`, `dense_kernel_dtypes` and `_kernel`."""

    def moe(self, x: torch.Tensor, router_weight: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
            top_k: int, renormalize: bool) -> torch.Tensor:
        """Mixture-of-experts SwiGLU layer (router, top-k, experts, combine), x [T, H] -> [T, H]; weights as in
        kernels.moe. Deterministic: the batch-invariant fused kernel (or its ref); fast: the grouped GEMMs with
        an M-chosen config and stock routing (`moe_fast`) where the kernels run, else the stock loop."""
        from detinfer.kernels import moe

        kernel = self._kernel(x, router_weight, w_gate_up, w_down)
        if not self.deterministic:
            # moe_fast's grouped GEMMs have no backward: fast-mode training takes the stock loop (autograd).
            recording = torch.is_grad_enabled() and any(t.requires_grad for t in (x, router_weight, w_gate_up,
                                                                                   w_down))
            fn = moe.moe_fast if kernel and not recording else moe.moe_stock
        else:
            fn = moe.fused_moe if kernel else moe.fused_moe_ref
        return fn(x, router_weight, w_gate_up, w_down, top_k, renormalize)

    # The MoE layer in parts, for expert parallelism (distributed/layers.py): deterministic mode runs the
    # functions `moe` fuses, chosen by the same rule, so route -> slot outputs -> combine gives `moe`'s bits.
    def moe_route(self, x: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool):
        """(weights [T, k] fp32, expert ids [T, k] int64): `kernels.moe.route` / `route_ref` (fp32 logits,
        stable top-k); fast mode: `route_stock`."""
        from detinfer.kernels import moe

        if not self.deterministic:
            return moe.route_stock(x, router_weight, top_k, renormalize)
        return (moe.route if self._kernel(x, router_weight) else moe.route_ref)(x, router_weight, top_k, renormalize)

    def moe_expert_outputs(self, x: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                           first_expert: int | None = None, num_experts: int | None = None) -> torch.Tensor:
        """y [T, k, H] (x's dtype): each slot's expert output for the experts [first_expert, +E_local) the
        weights hold, other slots zero. The fused layer's grouped GEMMs (fast mode: with a config chosen
        from the rows per expert, of `num_experts` in all) where the kernels run, else the ref."""
        from detinfer.kernels import moe

        if not self._kernel(x, w_gate_up, w_down):
            return moe.expert_outputs_ref(x, ids, w_gate_up, w_down, first_expert)
        config_for = None
        if not self.deterministic:
            config_for = moe.fast_config_for(ids.numel() / (num_experts or w_gate_up.shape[0]))
        return moe.expert_outputs(x, ids, w_gate_up, w_down, config_for, first_expert)

    def moe_combine(self, weights: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """sum_r weights[t, r] * y[t, r] -> [T, H] `dtype`: in routing-rank order in fp32 (`combine_slots`, one
        launch where the kernels run, else `combine_slots_ref`: the same bits); fast mode: a stock weighted sum."""
        from detinfer.kernels import moe

        if not self.deterministic:
            return moe.combine_slots_fast(weights, y, dtype)
        return (moe.combine_slots if self._kernel(y) else moe.combine_slots_ref)(weights, y, dtype)

    @property
    def moe_graph_safe(self) -> bool:
        """Whether `moe` on this backend's dtype runs without host syncs (CUDA-graph capturable): the Triton
        paths only (the ref and the stock loop iterate on the host over the experts that were hit)."""
        return self.dtype in self.dense_kernel_dtypes
