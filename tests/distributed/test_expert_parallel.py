"""Mixture-of-experts models under tensor parallelism (attention split by heads, experts split in blocks):
worker processes over gloo, fp32, tiny random Qwen3-MoE and Mixtral models, asserted bitwise.

- With tp_invariant_reduction, TP = 2 and 4 give TP=1's bits (token ids, every logprob and top-k entry,
  prompt logprobs, a forward's logits): attention's o_proj (and Qwen3-MoE's dense down_proj) add the same
  chunks in the same tree, and the MoE layers give the one-device bits at any size.
- At every TP size a request alone == in a batch, Hypothesis drawing the batch (which requests, when each
  arrives): every step routes another mix of tokens to each rank's experts.
- Without the flag: still alone == batched at TP=2; the MoE layer alone is TP-size-invariant
  (test_expert_parallel_layer.py), but o_proj's cross-rank sum rounds differently from TP=1's one matmul,
  so the model's bits are not.
- Fast mode (each rank combines its own slots, the library all-reduce adds them) runs; a TP size that does
  not divide the expert count is refused, naming the sizes allowed.

Qwen3-MoE: 8 experts, top-2, layer 1 dense; Mixtral: 4 experts (one per rank at TP=4), top-2. The vocabulary
(322) does not divide by 4. Both have 2 KV heads (replicated at TP=4). Each engine start spawns TP-1
processes, so engines are shared per module.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tensor_parallel import VOCAB, engine_at, forward_logits, greedy, run, sampled

from detinfer.distributed import check_tp_config
from detinfer.distributed.layers import ExpertParallelMoE
from detinfer.models.config import ModelConfig
from detinfer.models.testing import tiny_config_dict, write_tiny_checkpoint

ARCHS = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(intermediate_size=96, extra=dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]))),
    "mixtral": ("MixtralForCausalLM", dict(intermediate_size=48, extra=dict(num_local_experts=4,
                                                                           num_experts_per_tok=2))),
}
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
SIZES = (1, 2, 4)

_rng = random.Random(21)
POOL = {f"p{i}": ([_rng.randrange(3, VOCAB) for _ in range(n)], greedy(3, prompt_logprobs=2) if i % 2 else
                  sampled(3, seed=i)) for i, n in enumerate((13, 4, 9, 17, 2))}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    return {name: write_tiny_checkpoint(root / name, arch, seed=11, **SHAPE, **kw)
            for name, (arch, kw) in ARCHS.items()}


@pytest.fixture(scope="module")
def engines(model_dirs):
    """(model, tp) -> engine with tp_invariant_reduction, started on first use and closed with the module."""
    started = {}

    def get(name, tp):
        if (name, tp) not in started:
            started[name, tp] = engine_at(model_dirs[name], tp, tp_invariant_reduction=True)
        return started[name, tp]

    yield get
    for engine in started.values():
        engine.close()


_alone_cache: dict = {}


def alone(engines, name, tp, rid):
    key = (name, tp, rid)
    if key not in _alone_cache:
        prompt, params = POOL[rid]
        _alone_cache[key] = run(engines(name, tp), [(0, rid, prompt, params)])[rid]
    return _alone_cache[key]


@pytest.mark.parametrize("name", ARCHS)
def test_models_have_expert_parallel_layers(engines, name):
    engine = engines(name, 2)
    layers = [layer.mlp for layer in engine.runner.model.layers if isinstance(layer.mlp, ExpertParallelMoE)]
    assert layers and engine.model_config.num_experts in (4, 8)
    assert all(m.gate_up_proj.shape[0] * 2 == engine.model_config.num_experts for m in layers)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ARCHS)
def test_tp_size_does_not_change_a_bit(engines, name, tp):
    for rid in POOL:
        assert alone(engines, name, tp, rid) == alone(engines, name, 1, rid), rid
    logits = forward_logits(engines(name, tp))
    assert logits.shape == (15, VOCAB) and torch.equal(logits, forward_logits(engines(name, 1)))


compositions = st.lists(st.tuples(st.sampled_from(sorted(POOL)), st.integers(0, 2)), min_size=2, max_size=4,
                        unique_by=lambda c: c[0])


@pytest.mark.parametrize("tp", SIZES)
@pytest.mark.parametrize("name", ARCHS)
@settings(max_examples=5)  # each example drives a multi-process engine for ~10 steps
@given(batch=compositions)
def test_alone_equals_batched_at_each_tp_size(engines, name, tp, batch):
    got = run(engines(name, tp), [(step, rid, *POOL[rid]) for rid, step in batch])
    for rid, _ in batch:
        assert got[rid].error is None and got[rid] == alone(engines, name, tp, rid), rid


@pytest.mark.parametrize("name", ARCHS)
def test_default_reduction_tp2_is_batch_invariant_and_fast_mode_runs(model_dirs, name):
    engine = engine_at(model_dirs[name], 2)
    try:
        reqs = [(i // 2, rid, *POOL[rid]) for i, rid in enumerate(POOL)]
        batched = run(engine, reqs)
        assert batched == {rid: run(engine, [(0, rid, *POOL[rid])])[rid] for rid in POOL}
    finally:
        engine.close()
    engine = engine_at(model_dirs[name], 2, mode="fast")
    try:
        out = run(engine, [(0, "fast", [5, 6, 7, 8], greedy(3))])["fast"]
        assert out.error is None and len(out.completions[0].token_ids) == 3
    finally:
        engine.close()


def test_tp_size_must_divide_the_expert_count():
    six = ModelConfig.from_dict(tiny_config_dict("Qwen3MoeForCausalLM", **SHAPE, intermediate_size=96, extra=dict(
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32)))
    check_tp_config(six, 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 .*num_experts=6 is not a multiple of it.*"
                                         r"allowed sizes for this model: \[1, 2\]"):
        check_tp_config(six, 4)
    # Mixtral has no dense MLP: its intermediate_size (the experts' width) does not limit the TP size
    mixtral = ModelConfig.from_dict(tiny_config_dict("MixtralForCausalLM", **SHAPE, intermediate_size=42,
                                                     extra=dict(num_local_experts=4)))
    check_tp_config(mixtral, 4)
    check_tp_config(mixtral, 4, invariant=True)
