"""The Qwen3-MoE family: which layers are sparse (decoder_sparse_step, mlp_only_layers), top-k and its
renormalisation from config.json, refused variants, and the tensor layout against transformers'
Qwen3MoeForCausalLM (per-expert names, as its save_pretrained writes them)."""

import pytest

from detinfer.models.config import ModelConfig
from detinfer.models.families import family_for_architecture, family_for_gguf_arch
from detinfer.models.testing import tiny_config_dict

FAMILY = family_for_architecture("Qwen3MoeForCausalLM")


@pytest.mark.parametrize(("extra", "moe_layers"), [
    (dict(), (0, 1, 2, 3)),
    (dict(decoder_sparse_step=2), (1, 3)),
    (dict(mlp_only_layers=[0, 2], norm_topk_prob=False), (1, 3)),
    (dict(num_experts=0), ()),
])
def test_sparse_layers_and_layout_match_transformers(extra, moe_layers, transformers_weight_shapes):
    hf_config = tiny_config_dict("Qwen3MoeForCausalLM", num_hidden_layers=4, extra={
        "num_experts": 5, "num_experts_per_tok": 2, "moe_intermediate_size": 24, **extra})
    config = ModelConfig.from_dict(hf_config)
    assert config.moe_layers == moe_layers
    assert config.qk_norm and not config.qkv_bias
    if moe_layers:
        assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (5, 2, 24)
        assert config.norm_topk_prob == hf_config["norm_topk_prob"]
    assert FAMILY.hf_weight_shapes(config) == transformers_weight_shapes(hf_config)


def test_hub_spelling_and_defaults():
    """Hub configs say num_experts; transformers 5 writes num_local_experts. HF's default: no renormalising."""
    base = tiny_config_dict("Qwen3MoeForCausalLM")
    for key in ("num_experts", "num_local_experts"):
        cfg = {k: v for k, v in base.items() if k not in ("num_experts", "norm_topk_prob")}
        config = ModelConfig.from_dict({**cfg, key: 6})
        assert config.num_experts == 6 and config.norm_topk_prob is False


@pytest.mark.parametrize(("extra", "message"), [
    (dict(shared_expert_intermediate_size=64), "shared experts"),
    (dict(num_experts_per_tok=9), r"num_experts_per_tok must be in \[1, num_experts=8\]"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size must be positive"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step must be a positive int"),
])
def test_bad_moe_configs_are_refused(extra, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(tiny_config_dict("Qwen3MoeForCausalLM", extra=extra))


def test_gguf_facts():
    assert family_for_gguf_arch("qwen3moe") is FAMILY and not FAMILY.gguf_rotary_permuted
    assert FAMILY.hf_name_from_gguf("blk.2.ffn_gate_inp.weight") == "model.layers.2.mlp.gate.weight"
    assert (FAMILY.hf_name_from_gguf("blk.2.ffn_down_exps.weight")
            == "model.layers.2.mlp.experts.{expert}.down_proj.weight")
    assert FAMILY.hf_name_from_gguf("blk.0.attn_q_norm.weight") == "model.layers.0.self_attn.q_norm.weight"
    fields = FAMILY.gguf_config_fields({"num_hidden_layers": 2}, set())
    assert fields["norm_topk_prob"] is True and fields["mlp_only_layers"] == []
