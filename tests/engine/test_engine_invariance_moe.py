"""Engine-level batch invariance of a mixture-of-experts model (Qwen3-MoE: 8 experts, top-2, one dense
layer) in deterministic mode, asserted bitwise with the scenarios of test_engine_invariance.py: a request's
outputs are identical alone or among others, whatever the token budget (chunked prefill), prefix-cache
state or preemption. Here which tokens reach which expert, and how many, changes from step to step."""

import random

import pytest

# The dense module's scenarios, collected here again: pytest resolves their `model_dir` (and `alone`) fixtures
# in this module, so they run against the MoE checkpoint below.
from test_engine_invariance import (  # noqa: F401
    ALONE,
    alone,
    greedy,
    prompt,
    run,
    sampled,
    test_mixed_batch_equals_alone_per_budget,
    test_preemption_keeps_every_bit,
    test_prefix_cache_hot_and_shared_system_prefix,
)

from detinfer.engine import EngineConfig, LLMEngine
from detinfer.models.testing import write_tiny_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("engine_inv_moe") / "qwen3moe", "Qwen3MoeForCausalLM",
                                 seed=5, hidden_size=64, intermediate_size=96, num_attention_heads=2,
                                 num_key_value_heads=1, head_dim=32, extra=dict(
                                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                     norm_topk_prob=True, mlp_only_layers=[1]))


def test_model_is_moe(model_dir):
    engine = LLMEngine(model_dir, EngineConfig(num_kv_blocks=8), device="cpu")
    assert engine.model_config.moe_layers == (0,) and engine.model_config.num_experts == 8


def test_stock_moe_layer_negative_control(model_dir, monkeypatch):
    """Everything deterministic except the MoE layer, swapped for the stock loop (torch.topk, F.linear with
    each expert's row count as M, index_add_): the same comparison finds differences, so the tests above
    can see a batch-variant MoE (the scenarios imported above)."""
    from detinfer.kernels import moe
    from detinfer.ops import Ops

    monkeypatch.setattr(Ops, "moe", lambda self, *args: moe.moe_stock(*args))
    rng = random.Random(17)
    requests = [(0, "long", prompt(rng, 33), greedy(5)), (0, "sampled", prompt(rng, 17), sampled(5, seed=11)),
                (1, "short", prompt(rng, 3), greedy(6))]
    mixed, _ = run(model_dir, requests, max_num_batched_tokens=16, max_num_seqs=8, block_size=4, num_kv_blocks=96)
    stock_alone = {rid: run(model_dir, [(0, rid, p, params)], **ALONE)[0][rid] for _, rid, p, params in requests}
    assert any(mixed[rid] != stock_alone[rid] for rid in stock_alone)
