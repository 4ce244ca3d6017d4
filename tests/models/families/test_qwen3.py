"""The Qwen3 family: q/k RMSNorm always, optional attention biases, head_dim spelled out, and its tensor
layout against transformers' Qwen3ForCausalLM."""

import pytest

from detinfer.models.config import ModelConfig
from detinfer.models.families import family_for_architecture, family_for_gguf_arch
from detinfer.models.testing import tiny_config_dict

FAMILY = family_for_architecture("Qwen3ForCausalLM")


@pytest.mark.parametrize(("attention_bias", "head_dim"), [(False, None), (True, 32)])
def test_qk_norm_biases_and_layout_match_transformers(attention_bias, head_dim, transformers_weight_shapes):
    hf_config = tiny_config_dict("Qwen3ForCausalLM", attention_bias=attention_bias, head_dim=head_dim)
    assert hf_config["head_dim"] == (head_dim or hf_config["hidden_size"] // hf_config["num_attention_heads"])
    config = ModelConfig.from_dict(hf_config)
    assert (config.qkv_bias, config.o_bias, config.mlp_bias, config.qk_norm) == (
        attention_bias, attention_bias, False, True)
    assert config.head_dim == hf_config["head_dim"]
    assert FAMILY.hf_weight_shapes(config) == transformers_weight_shapes(hf_config)


def test_gguf_facts():
    assert family_for_gguf_arch("qwen3") is FAMILY and not FAMILY.gguf_rotary_permuted
    fields = FAMILY.gguf_config_fields({"num_hidden_layers": 2}, {"blk.0.attn_q.bias", "blk.0.attn_q_norm.weight"})
    assert fields == {"use_sliding_window": False, "sliding_window": None, "max_window_layers": 2,
                      "attention_bias": True}
    assert FAMILY.hf_name_from_gguf("blk.1.attn_k_norm.weight") == "model.layers.1.self_attn.k_norm.weight"
