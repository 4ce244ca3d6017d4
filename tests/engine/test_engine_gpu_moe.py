"""Engine on the GPU with a mixture-of-experts model (random bf16 Qwen3-MoE: 16 experts, top-4, one dense
layer): bitwise invariance with CUDA graphs on and off in deterministic mode (the fused MoE kernel), fast mode
(stock routing, M-chosen tiles) as the negative control; both modes keep CUDA graphs. Skipped without CUDA."""

import pytest
from test_engine_gpu import VOCAB, assert_invariance_graphs_on_and_off

from detinfer.models.testing import write_tiny_checkpoint

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("engine_gpu_moe") / "qwen3moe", "Qwen3MoeForCausalLM",
                                 seed=12, vocab_size=VOCAB, hidden_size=512, intermediate_size=1024,
                                 num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                                 max_position_embeddings=1024, dtype="bfloat16", extra=dict(
                                     num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
                                     norm_topk_prob=True, mlp_only_layers=[3]))


@pytest.mark.parametrize("mode", ["deterministic", "fast"])
def test_moe_invariance_graphs_on_and_off(moe_dir, mode):
    assert_invariance_graphs_on_and_off(moe_dir, mode, seed=1, moe_layers=(0, 1, 2))
