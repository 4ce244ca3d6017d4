"""`PagedAttention`: the attention callback the `Transformer` runs over the paged KV cache in one step. Both
the eager path (`ModelRunner`) and every captured CUDA graph (`cuda_graphs.StepGraphs`) build one, so it
lives apart from both.
"""

from __future__ import annotations

import torch

from detinfer.cache.paged_kv import StepMetadata
from detinfer.ops import Ops


class PagedAttention:
    """The model's `attn(layer_idx, q, k, v)` for one step: write this step's K/V into the layer's pools,
    then attend over the pools (both through the numerics backend). The model calls the fused pair
    instead: `prologue` (q/k norm + rotary that also stores k/v in the pools: one launch where the kernels
    run) then `attend` (no second write). `out` (graphs) is a fixed buffer the kernel writes the real rows of;
    `quant_out` (graphs of FP8 models) the fixed `QuantizedRows` of `attend(..., fp8_out=True)`.

    validate=False throughout: the metadata comes from the scheduler's checked state, and value checks
    would cost a device->host sync per layer (and are impossible under graph capture)."""

    def __init__(self, kv_cache, meta: StepMetadata, ops: Ops, scale: float, out: torch.Tensor | None,
                 quant_out=None):
        self.kv_cache, self.meta, self.ops = kv_cache, meta, ops
        self.scale, self.out, self.quant_out = scale, out, quant_out

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.kv_cache[layer_idx]
        self.ops.write_kv(k, v, k_cache, v_cache, self.meta.slot_mapping, validate=False)
        return self.attend(layer_idx, q)

    def prologue(self, layer_idx: int, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 inv_freq: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                 eps: float) -> torch.Tensor:
        """`Ops.qk_norm_rope_write_kv` into this layer's pools -> the rotated q, for `attend`."""
        k_cache, v_cache = self.kv_cache[layer_idx]
        return self.ops.qk_norm_rope_write_kv(positions, q, k, v, inv_freq, q_weight, k_weight, eps, k_cache,
                                              v_cache, self.meta.slot_mapping, validate=False)

    def attend(self, layer_idx: int, q: torch.Tensor, fp8_out: bool = False):
        """Paged attention of q over the layer's pools, which already hold this step's K/V. `fp8_out` (only an
        FP8 o_proj reads the rows): `Ops.paged_attention_fp8`, which may return them as `QuantizedRows`."""
        m = self.meta
        k_cache, v_cache = self.kv_cache[layer_idx]
        args = (q, k_cache, v_cache, m.block_tables, m.kv_lens, m.cu_q_lens, self.scale)
        kw = dict(max_q_len=m.max_q_len, max_kv_len=m.max_kv_len, validate=False, out=self.out)
        if fp8_out:
            return self.ops.paged_attention_fp8(*args, **kw, quant_out=self.quant_out)
        return self.ops.paged_attention(*args, **kw)
