"""One decoder-only transformer for Llama, Qwen2 and Qwen3 (differences are config flags).

It runs on a packed batch: the tokens of many sequences concatenated into one [T] vector with their
positions, no batch dimension and no padding (vLLM / gpt-fast style). Attention is the only op that mixes
tokens, and it is supplied by the caller as `attn(layer_idx, q, k, v)`: the engine's callable writes k/v into
its paged cache and runs paged attention; `attention_ref.ReferenceAttention` is a plain-torch one for tests.

Every matmul and norm, and SiLU * up, goes through `ops` (see detinfer.ops), so under `Ops("deterministic")`
each token's result is independent of what else is in the batch. Rotary (mul/add/cos/sin), the embedding
gather and residual adds are elementwise ops whose bits do not depend on an element's position, and stay
plain torch. forward has no host syncs, so it can be captured in a CUDA graph.

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

from detinfer.models.config import ModelConfig
from detinfer.models.rope import RotaryEmbedding
from detinfer.ops import Ops

# attn(layer_idx, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Linear(nn.Module):
    """weight [out, in] (+ bias [out]); forward goes through `ops.linear`, never F.linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ops: Ops):
        super().__init__()
        self.ops = ops
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """HF RMSNorm over the last dim; with `residual`, returns (norm(x + residual), x + residual)."""

    def __init__(self, dim: int, eps: float, ops: Ops):
        super().__init__()
        self.ops = ops
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.ops.rms_norm(x, self.weight, self.eps, residual=residual)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, ops: Ops):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = (config.num_attention_heads,
                                                        config.num_key_value_heads, config.head_dim)
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias, ops)
        self.o_proj = Linear(self.q_size, config.hidden_size, config.o_bias, ops)
        # Qwen3 normalises each head's q and k over head_dim before rotary.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops) if config.qk_norm else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                attn: AttentionFn) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(T, self.n_heads, self.head_dim)  # [T, Hq, D]
        k = k.reshape(T, self.n_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.reshape(T, self.n_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        out = attn(self.layer_idx, q, k, v)  # [T, Hq, D]
        return self.o_proj(out.reshape(T, self.q_size))  # [T, hidden]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, ops: Ops):
        super().__init__()
        self.ops = ops
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, config.mlp_bias, ops)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, config.mlp_bias, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # [T, I] each
        # via ops: stock CPU SiLU rounds differently in a tensor's SIMD tail, i.e. depends on position
        return self.down_proj(self.ops.silu_mul(gate, up))  # [T, hidden]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, ops: Ops):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.self_attn = Attention(config, layer_idx, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.mlp = MLP(config, ops)

    def forward(self, h, residual, positions, rotary, attn):
        """Pre-norm block with the residual carried separately (so the add fuses into the norm):
        returns (h, residual) with h + residual == this layer's output stream."""
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, positions, rotary, attn)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops):
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        if not isinstance(ops, Ops):
            raise TypeError(f"ops must be a detinfer.ops.Ops, got {type(ops).__name__}")
        self.config, self.ops = config, ops
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size),
                                         requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(config, i, ops) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        # Tied checkpoints reuse embed_tokens as the output projection; no separate parameter then.
        self.lm_head = (None if config.tie_word_embeddings else
                        nn.Parameter(torch.empty(config.vocab_size, config.hidden_size), requires_grad=False))
        self.rotary = RotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        """input_ids [T], positions [T] (packed tokens of many sequences) -> normed hidden [T, hidden]."""
        h = F.embedding(input_ids, self.embed_tokens)  # [T, hidden]
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, positions, self.rotary, attn)
        h, _ = self.norm(h, residual)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] (the rows that need a next token) -> logits [S, vocab] fp32."""
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        return self.ops.linear(hidden, weight).float()
