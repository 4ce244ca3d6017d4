"""The Mixtral family: every layer sparse, always renormalised, Llama-style attention; sliding windows
refused; the tensor layout against transformers' MixtralForCausalLM (block_sparse_moe.experts.{e}.w1/w2/w3)."""

import pytest

from detinfer.models.config import ModelConfig
from detinfer.models.families import family_for_architecture
from detinfer.models.testing import tiny_config_dict

FAMILY = family_for_architecture("MixtralForCausalLM")


@pytest.mark.parametrize("experts", [(4, 2), (3, 1)])
def test_config_and_layout_match_transformers(experts, transformers_weight_shapes):
    hf_config = tiny_config_dict("MixtralForCausalLM", num_hidden_layers=3, intermediate_size=40, extra=dict(
        num_local_experts=experts[0], num_experts_per_tok=experts[1]))
    config = ModelConfig.from_dict(hf_config)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (*experts, 40)
    assert config.moe_layers == (0, 1, 2) and config.norm_topk_prob
    assert not (config.qk_norm or config.qkv_bias or config.o_bias)
    assert FAMILY.hf_weight_shapes(config) == transformers_weight_shapes(hf_config)
    assert FAMILY.gguf_arch is None


def test_sliding_window_is_refused():
    with pytest.raises(ValueError, match="sliding-window attention"):
        ModelConfig.from_dict(tiny_config_dict("MixtralForCausalLM", extra=dict(sliding_window=4096)))
