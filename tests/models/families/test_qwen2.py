"""The Qwen2 family: q/k/v biases whatever config.json says, sliding windows off, and its tensor layout
against transformers' Qwen2ForCausalLM."""

import pytest

from detinfer.models.config import ModelConfig
from detinfer.models.families import family_for_architecture, family_for_gguf_arch
from detinfer.models.testing import tiny_config_dict

FAMILY = family_for_architecture("Qwen2ForCausalLM")


@pytest.mark.parametrize("tie", [False, True])
def test_fixed_biases_and_layout_match_transformers(tie, transformers_weight_shapes):
    hf_config = tiny_config_dict("Qwen2ForCausalLM", tie_word_embeddings=tie, num_hidden_layers=3)
    assert (hf_config["use_sliding_window"], hf_config["max_window_layers"]) == (False, 3)
    config = ModelConfig.from_dict({**hf_config, "attention_bias": False})  # not a Qwen2 switch: ignored
    assert (config.qkv_bias, config.o_bias, config.mlp_bias, config.qk_norm) == (True, False, False, False)
    assert FAMILY.hf_weight_shapes(config) == transformers_weight_shapes(hf_config)


def test_sliding_window_is_refused():
    with pytest.raises(ValueError, match="sliding-window attention"):
        ModelConfig.from_dict({**tiny_config_dict("Qwen2ForCausalLM"), "use_sliding_window": True})


def test_gguf_facts():
    assert family_for_gguf_arch("qwen2") is FAMILY and not FAMILY.gguf_rotary_permuted
    assert FAMILY.gguf_config_fields({"num_hidden_layers": 5}, {"blk.0.attn_q.bias"}) == {
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": 5}
    assert FAMILY.hf_name_from_gguf("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
