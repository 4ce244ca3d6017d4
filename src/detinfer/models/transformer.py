"""One decoder-only transformer for Llama, Qwen2, Qwen3 and their mixture-of-experts relatives (Qwen3-MoE,
Mixtral): differences are config flags, and MoE layers swap the dense MLP for `SparseMoE`.

It runs on a packed batch: the tokens of many sequences concatenated into one [T] vector with their
positions, no batch dimension and no padding (vLLM / gpt-fast style). Attention is the only op that mixes
tokens, and it is supplied by the caller as `attn(layer_idx, q, k, v)`: the engine's callable writes k/v into
its paged cache and runs paged attention; `attention_ref.ReferenceAttention` is a plain-torch one for tests.
An `attn` may also offer the fused pair `attn.prologue(layer_idx, positions, q, k, v, inv_freq, q_weight,
k_weight, eps) -> q'` (the q/k norm + rotary, storing k/v itself: the engine's does it in the same launch)
and `attn.attend(layer_idx, q', fp8_out) -> out`; the model then calls those instead of `ops.qk_norm_rope` +
`attn`. With fp8_out (only an FP8 o_proj reads out) out may come back as `QuantizedRows` for that o_proj.

Every numeric op (matmuls, norms, SiLU * up, q/k norm + rotary, the logits) goes through the model's one numerics
backend `self.ops` (see detinfer.ops.backend), so under a deterministic `Ops` each token's result is
independent of what else is in the batch. The submodules hold weights only: the backend is passed down
in forward, so `set_ops` switches a model between modes (same weight tensors, no copy, no rebuild). The
embedding gather and residual adds are elementwise and stay plain torch. forward has no host syncs, so it
can be captured in a CUDA graph.

Weights keep HF's layout ([out, in] linear weights, same norms). At load time q/k/v are concatenated into
one `qkv_proj` and gate/up into one `gate_up_proj` along the output dim: one matmul launch instead of three
(two), which matters for launch-bound decode steps. Fusing along the output dim does not change the
reduction of any output element, so a fused matmul is exactly as row-invariant as the separate ones.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from detinfer.kernels.fp8_quant import num_blocks
from detinfer.models import fp8 as fp8_format
from detinfer.models.config import ModelConfig
from detinfer.models.rope import RotaryEmbedding
from detinfer.ops import Ops

# attn(layer_idx, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D] (optionally with prologue/attend,
# see the module docstring)
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def fp8_scale_param(*shape: int) -> nn.Parameter:
    """An FP8 weight's per-row block scales [..., N, ceil(K / 128)] fp32 (kernels/fp8_quant.py's layout)."""
    *lead, n, k = shape
    return nn.Parameter(torch.empty(*lead, n, num_blocks(k)), requires_grad=False)


class Linear(nn.Module):
    """weight [out, in] (+ bias [out]); forward goes through `ops.linear`, never F.linear. `fp8`: the weight is
    block-scaled float8_e4m3fn with `weight_scale` beside it, and forward is `ops.linear_fp8`."""

    def __init__(self, in_features: int, out_features: int, bias: bool, fp8: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.weight_scale = fp8_scale_param(out_features, in_features) if fp8 else None

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        if self.weight_scale is not None:
            return ops.linear_fp8(x, self.weight, self.weight_scale, self.bias)
        return ops.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """HF RMSNorm over the last dim; with `residual`, returns (norm(x + residual), x + residual)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, ops: Ops, residual: torch.Tensor | None = None, fp8_out: bool = False):
        # x may be a row-parallel output whose cross-rank sum is still pending (tensor parallelism on two GPUs,
        # distributed.layers.PendingSum): it sums and normalizes in one kernel, with the bits of the two steps.
        fused = getattr(x, "rms_norm_fused", None)
        if fused is not None:
            return fused(self.weight, self.eps, residual)
        if fp8_out and not self._forward_hooks:  # only FP8 linears read it (a hook, e.g. repro's audit, reads it too)
            return ops.rms_norm_fp8(x, self.weight, self.eps, residual=residual)
        return ops.rms_norm(x, self.weight, self.eps, residual=residual)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = (config.num_attention_heads,
                                                        config.num_key_value_heads, config.head_dim)
        self.q_size, self.kv_size = config.q_size, config.kv_size
        fp8 = config.quantization == "fp8"
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias, fp8)
        self.o_proj = Linear(self.q_size, config.hidden_size, config.o_bias, fp8)
        # Qwen3 normalises each head's q and k over head_dim before rotary.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                attn: AttentionFn, ops: Ops) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x, ops)  # [T, (Hq + 2 Hkv) D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(T, self.n_heads, self.head_dim)  # [T, Hq, D]
        k = k.reshape(T, self.n_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.reshape(T, self.n_kv_heads, self.head_dim)  # [T, Hkv, D]
        # One op (one launch where the kernels run): per-head q/k norm when the model has it, then rotary,
        # reading q/k straight out of qkv by strides.
        q_w, k_w, eps = (None, None, 0.0) if self.q_norm is None else \
            (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        prologue = getattr(attn, "prologue", None)
        if prologue is not None:  # the engine's attention: that launch also stores k/v in the paged KV cache
            # An FP8 o_proj may get the rows quantized by the attention kernel (ops.paged_attention_fp8)
            out = attn.attend(self.layer_idx, prologue(self.layer_idx, positions, q, k, v, rotary.inv_freq, q_w,
                                                       k_w, eps), fp8_out=self.o_proj_fp8())
        else:
            q, k = ops.qk_norm_rope(positions, q, k, rotary.inv_freq, q_w, k_w, eps)
            out = attn(self.layer_idx, q, k, v)  # [T, Hq, D]
        if isinstance(out, torch.Tensor):
            out = out.reshape(T, self.q_size)
        return self.o_proj(out, ops)  # [T, hidden]

    def o_proj_fp8(self) -> bool:
        """Whether only an FP8 o_proj reads the attention rows (no hook, e.g. repro's audit, reads them too)."""
        o = self.o_proj
        return getattr(o, "weight_scale", None) is not None and not o._forward_pre_hooks and not o._forward_hooks


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        fp8 = config.quantization == "fp8"
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, config.mlp_bias, fp8)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, config.mlp_bias, fp8)

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        proj = self.gate_up_proj
        if proj._forward_hooks or proj._forward_pre_hooks:  # someone records gate_up's output (repro audit)
            gate, up = proj(x, ops).split(self.intermediate_size, dim=-1)  # [T, I] each
            return self.down_proj(ops.silu_mul(gate, up), ops)
        if proj.weight_scale is not None:  # FP8 (docs/fp8.md); an FP8 down_proj takes the rows quantized
            down = self.down_proj
            quantized = getattr(down, "weight_scale", None) is not None and not down._forward_pre_hooks
            return down(ops.linear_fp8_silu_mul(x, proj.weight, proj.weight_scale, proj.bias, quantized), ops)
        # One backend op: gate_up_proj, split into [T, I] halves, silu_mul (via ops: stock CPU SiLU rounds
        # differently in a tensor's SIMD tail); on decode batches one fused launch with the same bits.
        return self.down_proj(ops.linear_silu_mul(x, proj.weight, proj.bias), ops)  # [T, hidden]


class SparseMoE(nn.Module):
    """Mixture-of-experts SwiGLU block: a router [E, hidden] picks each token's top-k experts, whose
    outputs are summed with the (renormalised, per config) softmax weights. Expert weights are stacked:
    gate_up_proj [E, 2 I, hidden] (each expert's gate rows, then its up rows), down_proj [E, hidden, I]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        E, H, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.top_k, self.renormalize = config.num_experts_per_tok, config.norm_topk_prob
        self.router = nn.Parameter(torch.empty(E, H), requires_grad=False)
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * inter, H), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(E, H, inter), requires_grad=False)
        # FP8: the expert weights are block-scaled float8_e4m3fn, their per-row block scales beside them.
        fp8 = config.quantization == "fp8"
        self.gate_up_proj_scale = fp8_scale_param(E, 2 * inter, H) if fp8 else None
        self.down_proj_scale = fp8_scale_param(E, H, inter) if fp8 else None

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        # one backend op: routing, every expert and the combine (deterministic: batch-invariant as a whole)
        if self.gate_up_proj_scale is not None:
            return ops.moe_fp8(x, self.router, self.gate_up_proj, self.gate_up_proj_scale, self.down_proj,
                               self.down_proj_scale, self.top_k, self.renormalize)
        return ops.moe(x, self.router, self.gate_up_proj, self.down_proj, self.top_k, self.renormalize)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SparseMoE(config) if layer_idx in config.moe_layers else MLP(config)

    def forward(self, h, residual, positions, rotary, attn, ops: Ops):
        """Pre-norm block with the residual carried separately (so the add fuses into the norm):
        returns (h, residual) with h + residual == this layer's output stream."""
        qkv_fp8, mlp_fp8 = self.fp8_inputs()
        if residual is None:
            h, residual = self.input_layernorm(h, ops, fp8_out=qkv_fp8), h
        else:
            h, residual = self.input_layernorm(h, ops, residual, fp8_out=qkv_fp8)
        h = self.self_attn(h, positions, rotary, attn, ops)
        h, residual = self.post_attention_layernorm(h, ops, residual, fp8_out=mlp_fp8)
        return self.mlp(h, ops), residual

    def fp8_inputs(self) -> tuple[bool, bool]:
        """Whether the two norms' outputs go only to FP8 linears (the fused q/k/v; a dense MLP's gate_up), so
        they may come back quantized (ops.rms_norm_fp8). Read per call: FP8 checkpoints may leave linears in
        16 bits (`Transformer._keep_unquantized_linears`), and hooks (repro's audit) read the inputs."""
        qkv = self.self_attn.qkv_proj
        gate_up = getattr(self.mlp, "gate_up_proj", None)
        return (qkv.weight_scale is not None and not qkv._forward_pre_hooks,
                isinstance(gate_up, Linear) and gate_up.weight_scale is not None and not gate_up._forward_pre_hooks)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops):
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        self.config = config
        self.set_ops(ops)
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size),
                                         requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Tied checkpoints reuse embed_tokens as the output projection; no separate parameter then.
        self.lm_head = (None if config.tie_word_embeddings else
                        nn.Parameter(torch.empty(config.vocab_size, config.hidden_size), requires_grad=False))
        self.rotary = RotaryEmbedding(config)
        self._keep_unquantized_linears(config)

    def _keep_unquantized_linears(self, config: ModelConfig) -> None:
        """An FP8 checkpoint may leave some linears in the model dtype (quantization_config's
        modules_to_not_convert): those drop their scales, so they hold a 16-bit weight and run `ops.linear`.
        Decided after the modules are built because the decision needs the HF names each module is made of
        (models/fp8.py `unquantized_linears`); tensor parallelism's layers follow these modules."""
        if config.quantization != "fp8" or not config.fp8_unquantized:
            return
        modules = dict(self.named_modules())
        linears = [n for n, m in modules.items() if isinstance(m, Linear) and m.weight_scale is not None]
        experts = [f"{n}.{p}" for n, m in modules.items() if isinstance(m, SparseMoE)
                   and m.gate_up_proj_scale is not None for p in ("gate_up_proj", "down_proj")]
        for name in fp8_format.unquantized_linears(config, linears, experts):
            modules[name].weight_scale = None

    def set_ops(self, ops: Ops) -> None:
        """Compute with another numerics backend from now on (e.g. `model.set_ops(model.ops.replace(
        mode="fast"))`): the same weight tensors, nothing rebuilt or copied."""
        if not isinstance(ops, Ops):
            raise TypeError(f"ops must be a detinfer.ops.Ops, got {type(ops).__name__}")
        if self.config.head_dim != ops.head_dim and ops.head_dim is not None:
            raise ValueError(f"ops were chosen for head_dim {ops.head_dim}, the model has {self.config.head_dim}")
        self.ops = ops

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        """input_ids [T], positions [T] (packed tokens of many sequences) -> normed hidden [T, hidden]."""
        ops = self.ops
        h = self.embed(input_ids)  # [T, hidden]
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, positions, self.rotary, attn, ops)
        h, _ = self.norm(h, ops, residual)
        return h

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> embedding rows [T, hidden] (a gather; tensor parallelism overrides it)."""
        return F.embedding(input_ids, self.embed_tokens)

    @property
    def output_weight(self) -> torch.Tensor:
        """The output projection [vocab, hidden]: lm_head, or embed_tokens for tied checkpoints."""
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] (the rows that need a next token) -> logits [S, vocab] fp32."""
        return self.gather_logits(self.local_logits(hidden))

    # The logits in two halves, so that a tensor-parallel model (distributed/layers.py `TPTransformer`) can
    # finish its shard of them two ways: the full rows, or only each row's argmax (a greedy step without
    # processors or logprobs), which moves 16 bytes per row across the GPUs instead of the row.
    gathers_logits = False  # True where gather_logits / greedy_ids run collectives (every rank must call them)

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> this model's logits columns [S, V'] fp32 (all of them here)."""
        return self.ops.logits(hidden, self.output_weight)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """`local_logits`' output -> the full logits [S, vocab]."""
        return local

    def greedy_ids(self, local: torch.Tensor) -> torch.Tensor:
        """`local_logits`' output -> [S] int64: each row's argmax over the full vocabulary, bitwise what
        `torch.argmax(gather_logits(local), -1)` gives (first maximum; a NaN counts as the maximum)."""
        return torch.argmax(local, dim=-1)
