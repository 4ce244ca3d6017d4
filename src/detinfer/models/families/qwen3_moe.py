"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (q/k norm, explicit head_dim) with a sparse block in
the layers that `decoder_sparse_step` / `mlp_only_layers` select: a router over `num_experts` experts, the
top `num_experts_per_tok` of a softmax, renormalised when `norm_topk_prob`. No shared experts (that is
Qwen2-MoE, not supported: its config's `shared_expert_intermediate_size` is refused). GGUF arch
"qwen3moe" (llama.cpp renormalises the top-k and makes every layer sparse, as the public models do).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from detinfer.models.families import moe_decoder, qwen3
from detinfer.models.families.base import ModelFamily

NAMES = moe_decoder.QWEN_MOE_NAMES
# Config fields the tiny-checkpoint writer fills in when not given (small CPU test models).
_TINY_DEFAULTS = {"num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
                  "mlp_only_layers": [], "router_aux_loss_coef": 0.001, "output_router_logits": False}


def moe_from_hf(cfg: Mapping[str, Any]) -> dict[str, Any]:
    if cfg.get("shared_expert_intermediate_size"):
        raise ValueError("shared experts (shared_expert_intermediate_size) are not supported")
    experts = cfg.get("num_experts", cfg.get("num_local_experts")) or 0
    step = cfg.get("decoder_sparse_step", 1)
    if not (isinstance(step, int) and step >= 1):
        raise ValueError(f"decoder_sparse_step must be a positive int, got {step!r}")
    dense = set(cfg.get("mlp_only_layers") or ())
    layers = tuple(i for i in range(cfg["num_hidden_layers"])
                   if experts and i not in dense and (i + 1) % step == 0)
    return {"num_experts": experts, "num_experts_per_tok": cfg.get("num_experts_per_tok", 0) if experts else 0,
            "moe_intermediate_size": cfg.get("moe_intermediate_size", 0) if experts else 0,
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)), "moe_layers": layers}


def hf_config_fields(cfg: Mapping[str, Any], *, attention_bias: bool, mlp_bias: bool) -> dict[str, Any]:
    fields = qwen3.hf_config_fields(cfg, attention_bias=attention_bias, mlp_bias=mlp_bias)
    tiny = {**_TINY_DEFAULTS, "moe_intermediate_size": max(1, cfg["intermediate_size"] // 2)}
    return {**fields, **{k: cfg.get(k, v) for k, v in tiny.items()}}


def gguf_config_fields(cfg: Mapping[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    return {**qwen3.gguf_config_fields(cfg, tensor_names), "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": []}


_QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                      num_attention_heads=32, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6,
                      rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False,
                      eos_token_id=151645, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
# Qwen3-235B-A22B's config.json (94 layers, 128 experts, top-8): ~470 GB in bf16, served across GPUs.
_QWEN3_235B_A22B = dict(_QWEN3_30B_A3B, hidden_size=4096, intermediate_size=12288, num_hidden_layers=94,
                        num_attention_heads=64, num_key_value_heads=4, moe_intermediate_size=1536)
PRESETS = {
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    "qwen3-235b-a22b": _QWEN3_235B_A22B,
    # Small enough for a CPU: 8 experts, top-2; layer 1 keeps a dense MLP (mlp_only_layers).
    "tiny-qwen3-moe": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                           rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=False,
                           eos_token_id=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1]),
}

FAMILY = ModelFamily(
    model_type="qwen3_moe", architectures=("Qwen3MoeForCausalLM",), flags_from_hf=qwen3.flags_from_hf,
    hf_config_fields=hf_config_fields, hf_weight_shapes=partial(moe_decoder.hf_weight_shapes, NAMES),
    state_dict_from_hf=partial(moe_decoder.state_dict_from_hf, NAMES), moe_from_hf=moe_from_hf,
    hf_sources=partial(moe_decoder.hf_sources, NAMES),
    gguf_arch="qwen3moe", gguf_config_fields=gguf_config_fields,
    hf_name_from_gguf=partial(moe_decoder.hf_name_from_gguf, NAMES), presets=PRESETS,
)
