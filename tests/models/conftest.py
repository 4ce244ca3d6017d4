"""Shared fixtures for model tests: tiny HF-format checkpoints (written once per session); the real
stories260k checkpoint is tests/conftest.py's `stories_dir`."""

from pathlib import Path

import pytest

from detinfer.models.testing import write_tiny_checkpoint

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

# name -> (architecture, write_tiny_checkpoint kwargs). Together they cover GQA and MQA, tied and untied
# embeddings, both rotary spellings, llama3 and linear rope scaling, Llama attention/MLP biases, Qwen2's
# qkv bias and Qwen3's q/k norm with head_dim != hidden / heads, and the MoE families (sparse-step and
# mlp-only layers, renormalised or not).
VARIANTS = {
    "llama-gqa": ("LlamaForCausalLM", {}),
    # sizes that are not multiples of a SIMD width, so elementwise CPU kernels hit their tail code paths
    "llama-odd-sizes": ("LlamaForCausalLM", dict(hidden_size=48, intermediate_size=75, num_attention_heads=4,
                                                 num_key_value_heads=2)),
    "llama-llama3rope-tied": ("LlamaForCausalLM", dict(tie_word_embeddings=True, rope_theta=500000.0,
                                                       rope_scaling=LLAMA3_ROPE, rope_style="parameters")),
    "llama-llama3rope-legacy-bias": ("LlamaForCausalLM", dict(rope_scaling=LLAMA3_ROPE, attention_bias=True,
                                                              mlp_bias=True, num_key_value_heads=4)),
    "qwen2-mqa-tied": ("Qwen2ForCausalLM", dict(num_key_value_heads=1, tie_word_embeddings=True,
                                                rope_theta=1000000.0)),
    "qwen3-headdim32": ("Qwen3ForCausalLM", dict(head_dim=32, rope_style="parameters")),
    "qwen3-linear-rope": ("Qwen3ForCausalLM", dict(rope_scaling={"rope_type": "linear", "factor": 2.0},
                                                   tie_word_embeddings=True)),
    # Mixture of experts: 8 experts top-2 renormalised, layer 1 dense (mlp_only_layers); and Mixtral's 4 top-2.
    "qwen3-moe-mlp-only": ("Qwen3MoeForCausalLM", dict(head_dim=32, rope_style="parameters", extra=dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=True,
        mlp_only_layers=[1]))),
    "qwen3-moe-top3-unnormed": ("Qwen3MoeForCausalLM", dict(num_hidden_layers=3, extra=dict(
        num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24, norm_topk_prob=False,
        decoder_sparse_step=2))),
    "mixtral": ("MixtralForCausalLM", dict(intermediate_size=40, rope_theta=1000000.0)),
}


def pytest_generate_tests(metafunc):
    """Tests taking `tiny_variant` run once per entry of VARIANTS."""
    if "tiny_variant" in metafunc.fixturenames:
        metafunc.parametrize("tiny_variant", list(VARIANTS))


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_ckpts")
    return {name: write_tiny_checkpoint(root / name, arch, seed=i, **kw)
            for i, (name, (arch, kw)) in enumerate(VARIANTS.items())}
