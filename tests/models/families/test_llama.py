"""The Llama family: its config.json switches, the fields its checkpoints carry, its GGUF facts, and its
tensor layout against transformers' LlamaForCausalLM for every bias combination."""

import pytest

from detinfer.models.config import ModelConfig
from detinfer.models.families import family_for_architecture, family_for_gguf_arch
from detinfer.models.testing import tiny_config_dict

FAMILY = family_for_architecture("LlamaForCausalLM")


@pytest.mark.parametrize(("attention_bias", "mlp_bias"), [(False, False), (True, False), (False, True), (True, True)])
def test_bias_switches_and_layout_match_transformers(attention_bias, mlp_bias, transformers_weight_shapes):
    hf_config = tiny_config_dict("LlamaForCausalLM", attention_bias=attention_bias, mlp_bias=mlp_bias)
    assert (hf_config["model_type"], hf_config["pretraining_tp"]) == ("llama", 1)
    config = ModelConfig.from_dict(hf_config)
    assert (config.qkv_bias, config.o_bias, config.mlp_bias, config.qk_norm) == (
        attention_bias, attention_bias, mlp_bias, False)
    assert FAMILY.hf_weight_shapes(config) == transformers_weight_shapes(hf_config)


def test_missing_switches_mean_no_biases():
    assert FAMILY.flags({}) == {"qkv_bias": False, "o_bias": False, "mlp_bias": False, "qk_norm": False}


def test_gguf_facts():
    assert family_for_gguf_arch("llama") is FAMILY and FAMILY.gguf_rotary_permuted
    assert FAMILY.gguf_config_fields({}, {"blk.0.attn_q.weight"}) == {"attention_bias": False, "mlp_bias": False}
    assert FAMILY.gguf_config_fields({}, {"blk.0.attn_output.bias", "blk.0.ffn_up.bias"}) == {
        "attention_bias": True, "mlp_bias": True}
    assert FAMILY.hf_name_from_gguf("blk.7.attn_output.bias") == "model.layers.7.self_attn.o_proj.bias"
    assert FAMILY.hf_name_from_gguf("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="'blk.0.ffn_gate_exps.weight' has no HF counterpart"):
        FAMILY.hf_name_from_gguf("blk.0.ffn_gate_exps.weight")
