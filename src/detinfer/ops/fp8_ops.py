"""The block-scaled FP8 ops of the numerics backend (`Ops` inherits them; ops/backend.py's rule, FP8 part):

- `linear_fp8` (kernels/fp8_linear.py, docs/fp8.md): deterministic mode runs the Triton fp8 kernel on CUDA
  and the exact-block-dot ref elsewhere (the same numerics up to the tensor cores' accumulation; each
  batch-invariant); fast mode runs torch's blockwise scaled_mm where it runs, else dequantize + F.linear.
- `linear_fp8_tree`: row-parallel layers' fixed K-chunk tree over `linear_fp8`'s fp32 partials.
- `fp8_weight_layout`: the weight layout `linear_fp8` reads fastest here (tiled for the Triton kernel; the
  engine lays its FP8 linears out so at start-up, models/fp8.py `lay_out_fp8_linears`).
- `linear_fp8_silu_mul` (the dense SwiGLU MLP's gate_up + SiLU*mul): `linear_fp8` then `silu_mul` (a fused
  launch was measured slower than the two on an H100 at every batch size, docs/performance.md); with
  `quantized=True` (down_proj is FP8 too) the SiLU*mul rows come back as `QuantizedRows` for it.
- `rms_norm_fp8`: an RMSNorm whose output feeds only FP8 linears; deterministic mode returns `QuantizedRows`
  (quantized by the norm kernel itself on CUDA: kernels/fp8_act_quant.py), fast mode the 16-bit rows. The
  deterministic linears take either: the same bits, one launch fewer.
- `paged_attention_fp8`: the same for an attention whose output feeds only an FP8 o_proj, in decode steps
  (quantized by the attention kernel's store at head_dim 128: kernels/attention_quant.py).
- `moe_fp8` / `moe_expert_outputs_fp8`: the backend's routing and combine around the grouped FP8 expert
  GEMMs (CUDA, both modes) or per-expert `linear_fp8` + `silu_mul` calls (elsewhere; kernels/fp8_moe.py).
"""

from __future__ import annotations

import torch

from detinfer.ops._kernel_modules import kernel_module as _kernels


class Fp8Ops:
    """Mixed into `Ops`: reads its `deterministic`, `device`, `attention_impl`, `silu_mul`, `rms_norm`,
    `paged_attention`, `_kernel`, `_fused_kernel`, `moe_route` and `moe_combine`."""

    def linear_fp8(self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] @ dequant(weight)^T for a block-scaled fp8 weight [N, K] with per-row block scales
        [N, ceil(K/128)] (kernels/fp8_linear.py), activations quantized per token per 128-group.
        Deterministic: the Triton kernel on CUDA, else the exact-block-dot ref (CPU); fast: the stock path
        (torch's blockwise scaled_mm where it runs, else dequantize + F.linear)."""
        if not self.deterministic:
            return _kernels("fp8_stock").linear_fp8_stock(x, weight, weight_scale, bias)
        return self._linear_fp8_det(x, weight, weight_scale, bias)

    def _linear_fp8_det(self, x, weight, weight_scale, bias=None, out_dtype=None, uniform=None) -> torch.Tensor:
        fp8 = _kernels("fp8_linear")
        fn = fp8.linear_fp8 if self.device.type == "cuda" and x.is_cuda else fp8.linear_fp8_ref
        return fn(x, weight, weight_scale, bias, out_dtype=out_dtype, uniform=uniform)

    def fp8_weight_layout(self, weight: torch.Tensor) -> torch.Tensor:
        """An FP8 linear's weight [N, K] in the layout this backend's `linear_fp8` reads fastest: the Triton
        kernel (deterministic mode on CUDA) streams fp8_quant's tiled layout faster at decode (the same
        values, so the same bits: kernels/fp8_tiles.py); fast mode's cuBLASLt and the CPU reference read
        [N, K], so a tiled weight (a model an engine of the other mode held before) comes back untiled.
        Returns the new copy, or `weight` itself where it is laid out already (or does not tile)."""
        quant = _kernels("fp8_quant")
        if not (self.deterministic and self.device.type == "cuda" and weight.is_cuda):
            return quant.untile_weight(weight) if quant.is_tiled(weight) else weight
        return quant.tile_weight(weight) if quant.can_tile(weight) else weight

    def linear_fp8_tree(self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        num_chunks: int) -> torch.Tensor:
        """`linear_tree` for an fp8 weight (deterministic mode; row-parallel layers under tensor parallelism):
        fp32 partials of `num_chunks` K chunks of whole scale blocks, added in the fixed pairwise tree."""
        return _kernels("fp8_linear").linear_fp8_tree(self._linear_fp8_det, x, weight, weight_scale, num_chunks)

    def linear_fp8_silu_mul(self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                            bias: torch.Tensor | None = None, quantized: bool = False):
        """The SwiGLU MLP up to down_proj over a block-scaled fp8 gate_up weight [2I, K] (gate rows, then up
        rows): silu_mul of the two halves of `linear_fp8(x, weight, weight_scale, bias)` -> [..., I].
        `quantized` (the caller's down_proj is FP8): deterministic mode returns those rows as `QuantizedRows`
        (x 2-D), quantized by the SiLU*mul kernel on CUDA (the same bits as quantizing its output)."""
        rows = _kernels("fp8_quant").fp8_weight_shape(weight)[0]
        if rows % 2:
            raise ValueError(f"linear_fp8_silu_mul: weight must be the fused [2I, K] gate_up weight (gate rows, "
                             f"then up rows), got an odd row count {rows}")
        gate, up = self.linear_fp8(x, weight, weight_scale, bias).split(rows // 2, dim=-1)
        if not (quantized and self.deterministic and gate.dim() == 2):
            return self.silu_mul(gate, up)
        if self.device.type == "cuda" and self._fused_kernel(gate, up):
            return _kernels("fp8_act_quant").silu_mul_quantized(gate, up)
        return _kernels("fp8_quant").QuantizedRows.of(self.silu_mul(gate, up))

    def rms_norm_fp8(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                     residual: torch.Tensor | None = None):
        """`rms_norm` for a norm whose output feeds only FP8 linears: deterministic mode returns the normed
        rows as `QuantizedRows` (x 2-D; quantized by the norm kernel on CUDA, kernels/fp8_act_quant.py: the
        same bits as quantizing rms_norm's output); fast mode (which quantizes in cuBLASLt's layout) and
        other shapes get `rms_norm`'s output."""
        if not self.deterministic or x.dim() != 2:
            return self.rms_norm(x, weight, eps, residual=residual)
        if self.device.type == "cuda" and self._kernel(x, weight, residual):
            return _kernels("fp8_act_quant").rms_norm_quantized(x, weight, eps, residual)
        out = self.rms_norm(x, weight, eps, residual=residual)
        of = _kernels("fp8_quant").QuantizedRows.of
        return of(out) if residual is None else (of(out[0]), out[1])

    def paged_attention_fp8(self, q, k_cache, v_cache, block_tables, kv_lens, cu_q_lens, scale, *, max_q_len,
                            max_kv_len, validate: bool = True, out: torch.Tensor | None = None, quant_out=None):
        """`paged_attention` for an attention whose output feeds only an FP8 o_proj: in deterministic decode
        steps (max_q_len 1) on CUDA at head_dim 128, the rows [T, Hq * D] as `QuantizedRows` quantized by the
        attention kernel's store (kernels/attention_quant.py: the same bits as o_proj quantizing them);
        elsewhere paged_attention's [T, Hq, D] rows, which o_proj quantizes itself. out / quant_out: a CUDA
        graph's fixed buffers for the 16-bit rows (also where a split-parallel step merges before quantizing)
        / the quantized ones."""
        kw = dict(max_q_len=max_q_len, max_kv_len=max_kv_len, validate=validate)
        # Not in mixed steps: with prefill tiles they measured ~1% slower (kernels/attention_quant.py); not off
        # CUDA: the interpreter's fp8 cast is not torch's. Fast mode quantizes in cuBLASLt's layout.
        if self.deterministic and self.attention_impl == "kernel" and self.device.type == "cuda" and \
                max_q_len == 1 and _kernels("attention_quant").quantizes(q):
            return _kernels("attention_quant").paged_attention_quantized(
                q, k_cache, v_cache, block_tables, kv_lens, cu_q_lens, scale, out=quant_out, rows_out=out, **kw)
        return self.paged_attention(q, k_cache, v_cache, block_tables, kv_lens, cu_q_lens, scale, out=out, **kw)

    def moe_fp8(self, x: torch.Tensor, router_weight: torch.Tensor, w_gate_up: torch.Tensor, s_gate_up: torch.Tensor,
                w_down: torch.Tensor, s_down: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
        """`moe` over block-scaled fp8 experts (per-row block scales s_* beside them): this backend's routing
        and combine, each hit expert through `linear_fp8` + `silu_mul` (kernels/fp8_moe.py)."""
        if x.shape[0] == 0:
            return x.new_zeros(x.shape)
        weights, ids = self.moe_route(x, router_weight, top_k, renormalize)
        y = self.moe_expert_outputs_fp8(x, ids, w_gate_up, s_gate_up, w_down, s_down)
        return self.moe_combine(weights, y, x.dtype)

    def moe_expert_outputs_fp8(self, x: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
                               s_gate_up: torch.Tensor, w_down: torch.Tensor, s_down: torch.Tensor,
                               first_expert: int | None = None) -> torch.Tensor:
        """`moe_expert_outputs` for fp8 experts [first_expert, +E_local): on CUDA (both modes) the grouped
        FP8 Triton GEMMs (no host sync); elsewhere a loop over the hit experts through `linear_fp8` +
        `silu_mul` (kernels/fp8_moe.py)."""
        from detinfer.kernels import fp8_moe

        if self.device.type == "cuda" and x.is_cuda:
            return fp8_moe.expert_outputs_fp8_grouped(x, ids, w_gate_up, s_gate_up, w_down, s_down, first_expert)
        return fp8_moe.expert_outputs_fp8(x, ids, w_gate_up, s_gate_up, w_down, s_down, self.linear_fp8,
                                          self.silu_mul, first_expert)
