"""Llama (LlamaForCausalLM): Llama 2/3, SmolLM, TinyLlama, stories*. Optional biases on the attention
projections (`attention_bias`: q/k/v and o) and on the MLP (`mlp_bias`); no q/k norm. llama.cpp's converter
permutes the q/k rows of Llama GGUFs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from detinfer.models.families import dense_decoder
from detinfer.models.families.base import ModelFamily


def flags_from_hf(cfg: Mapping[str, Any]) -> dict[str, bool]:
    attention_bias = bool(cfg.get("attention_bias", False))
    return {"qkv_bias": attention_bias, "o_bias": attention_bias, "mlp_bias": bool(cfg.get("mlp_bias", False)),
            "qk_norm": False}


def hf_config_fields(cfg: Mapping[str, Any], *, attention_bias: bool, mlp_bias: bool) -> dict[str, Any]:
    return {"attention_bias": attention_bias, "mlp_bias": mlp_bias, "pretraining_tp": 1}


def gguf_config_fields(cfg: Mapping[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    # llama.cpp has no bias flags in the metadata; a bias tensor's presence is the flag.
    return {"attention_bias": "blk.0.attn_output.bias" in tensor_names,
            "mlp_bias": "blk.0.ffn_up.bias" in tensor_names}


PRESETS = {
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
                         max_position_embeddings=131072, tie_word_embeddings=False, eos_token_id=128009),
    # ~141 GB in bf16: more than one 80 GB or 141 GB GPU holds with a KV cache (a tensor-parallel size check).
    "llama-3.1-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
                          max_position_embeddings=131072, tie_word_embeddings=False, eos_token_id=128009),
    # Small enough for a CPU (tests, trying the tool out).
    "tiny-llama": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=2048, tie_word_embeddings=False, eos_token_id=2),
}

FAMILY = ModelFamily(
    model_type="llama", architectures=("LlamaForCausalLM",), flags_from_hf=flags_from_hf,
    hf_config_fields=hf_config_fields, hf_weight_shapes=dense_decoder.hf_weight_shapes,
    state_dict_from_hf=dense_decoder.state_dict_from_hf, gguf_arch="llama", gguf_config_fields=gguf_config_fields,
    hf_sources=dense_decoder.hf_sources,
    hf_name_from_gguf=dense_decoder.hf_name_from_gguf, gguf_rotary_permuted=True, presets=PRESETS,
)
