"""Qwen3 (Qwen3ForCausalLM): RMSNorm over head_dim on q and k before rotary (q_norm / k_norm), optional
attention biases (`attention_bias`), an explicit head_dim (often != hidden / heads). Sliding-window attention
is refused (ModelConfig.from_dict). GGUFs are not row-permuted."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from detinfer.models.families import dense_decoder
from detinfer.models.families.base import ModelFamily


def flags_from_hf(cfg: Mapping[str, Any]) -> dict[str, bool]:
    attention_bias = bool(cfg.get("attention_bias", False))
    return {"qkv_bias": attention_bias, "o_bias": attention_bias, "mlp_bias": False, "qk_norm": True}


def _full_attention_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg["num_hidden_layers"]}


def hf_config_fields(cfg: Mapping[str, Any], *, attention_bias: bool, mlp_bias: bool) -> dict[str, Any]:
    # Qwen3 configs always spell head_dim out.
    return {"attention_bias": attention_bias, **_full_attention_fields(cfg),
            "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]}


def gguf_config_fields(cfg: Mapping[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    return {**_full_attention_fields(cfg), "attention_bias": "blk.0.attn_q.bias" in tensor_names}


# HF config.json fields of public models (shapes only; no weights involved).
PRESETS = {
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                     rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False,
                     eos_token_id=151645),
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                       rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=True,
                       eos_token_id=151645),
    # Small enough for a CPU (tests, trying the tool out).
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
                 max_position_embeddings=2048, tie_word_embeddings=False, eos_token_id=2),
}

FAMILY = ModelFamily(
    model_type="qwen3", architectures=("Qwen3ForCausalLM",), flags_from_hf=flags_from_hf,
    hf_config_fields=hf_config_fields, hf_weight_shapes=dense_decoder.hf_weight_shapes,
    state_dict_from_hf=dense_decoder.state_dict_from_hf, gguf_arch="qwen3", gguf_config_fields=gguf_config_fields,
    hf_sources=dense_decoder.hf_sources,
    hf_name_from_gguf=dense_decoder.hf_name_from_gguf, gguf_rotary_permuted=False, presets=PRESETS,
)
