"""Qwen2 (Qwen2ForCausalLM): Qwen2 / Qwen2.5. Always a bias on the q/k/v projections, none on o or the MLP;
no q/k norm. Sliding-window attention is refused (ModelConfig.from_dict). GGUFs are not row-permuted."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from detinfer.models.families import dense_decoder
from detinfer.models.families.base import ModelFamily


def flags_from_hf(cfg: Mapping[str, Any]) -> dict[str, bool]:
    return {"qkv_bias": True, "o_bias": False, "mlp_bias": False, "qk_norm": False}


def _full_attention_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg["num_hidden_layers"]}


def hf_config_fields(cfg: Mapping[str, Any], *, attention_bias: bool, mlp_bias: bool) -> dict[str, Any]:
    # Qwen2's biases are fixed by the architecture; config.json has no switch for them.
    return _full_attention_fields(cfg)


def gguf_config_fields(cfg: Mapping[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    return _full_attention_fields(cfg)


PRESETS = {
    # Small enough for a CPU (tests, trying the tool out); tied embeddings as in the small Qwen2 models.
    "tiny-qwen2": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       max_position_embeddings=2048, tie_word_embeddings=True, eos_token_id=2),
}

FAMILY = ModelFamily(
    model_type="qwen2", architectures=("Qwen2ForCausalLM",), flags_from_hf=flags_from_hf,
    hf_config_fields=hf_config_fields, hf_weight_shapes=dense_decoder.hf_weight_shapes,
    state_dict_from_hf=dense_decoder.state_dict_from_hf, gguf_arch="qwen2", gguf_config_fields=gguf_config_fields,
    hf_sources=dense_decoder.hf_sources,
    hf_name_from_gguf=dense_decoder.hf_name_from_gguf, gguf_rotary_permuted=False, presets=PRESETS,
)
