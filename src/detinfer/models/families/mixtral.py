"""Mixtral (MixtralForCausalLM): Llama-style attention (no biases, no q/k norm, rotary pairs as HF stores
them) and a sparse block in every layer: a router over `num_local_experts` experts (each of
`intermediate_size`), the top `num_experts_per_tok` of a softmax, always renormalised. Sliding-window
attention is refused. No GGUF support yet (llama.cpp writes Mixtral as arch "llama" with expert tensors).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from detinfer.models.families import moe_decoder
from detinfer.models.families.base import ModelFamily

NAMES = moe_decoder.MIXTRAL_NAMES


def flags_from_hf(cfg: Mapping[str, Any]) -> dict[str, bool]:
    return {"qkv_bias": False, "o_bias": False, "mlp_bias": False, "qk_norm": False}


def moe_from_hf(cfg: Mapping[str, Any]) -> dict[str, Any]:
    if cfg.get("sliding_window") is not None:
        raise ValueError(f"sliding-window attention (sliding_window={cfg['sliding_window']}) is not supported")
    experts = cfg.get("num_local_experts", 8)
    return {"num_experts": experts, "num_experts_per_tok": cfg.get("num_experts_per_tok", 2),
            "moe_intermediate_size": cfg["intermediate_size"], "norm_topk_prob": True,
            "moe_layers": tuple(range(cfg["num_hidden_layers"]))}


def hf_config_fields(cfg: Mapping[str, Any], *, attention_bias: bool, mlp_bias: bool) -> dict[str, Any]:
    tiny = {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None, "router_jitter_noise": 0.0,
            "router_aux_loss_coef": 0.001, "output_router_logits": False}
    return {k: cfg.get(k, v) for k, v in tiny.items()}


PRESETS = {
    "mixtral-8x7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1000000.0,
                         max_position_embeddings=32768, tie_word_embeddings=False, eos_token_id=2,
                         num_local_experts=8, num_experts_per_tok=2, sliding_window=None),
    # Small enough for a CPU: 4 experts of 48, top-2.
    "tiny-mixtral": dict(vocab_size=512, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=1000000.0,
                         max_position_embeddings=2048, tie_word_embeddings=False, eos_token_id=2,
                         num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
}

FAMILY = ModelFamily(
    model_type="mixtral", architectures=("MixtralForCausalLM",), flags_from_hf=flags_from_hf,
    hf_config_fields=hf_config_fields, hf_weight_shapes=partial(moe_decoder.hf_weight_shapes, NAMES),
    state_dict_from_hf=partial(moe_decoder.state_dict_from_hf, NAMES), moe_from_hf=moe_from_hf,
    hf_sources=partial(moe_decoder.hf_sources, NAMES),
    presets=PRESETS,
)
