"""Mixture-of-experts models under tensor parallelism on GPUs (NCCL, bf16, the Triton grouped expert GEMMs),
asserted bitwise. Skipped (shown as skipped) with fewer than 2 GPUs.

Random bf16 Qwen3-MoE (16 experts, top-4, one dense layer) and Mixtral (8 experts, top-2), head_dim 128 / 64
so the attention kernels run. Checked at TP=2 (and 4 when 4 GPUs are visible): with tp_invariant_reduction,
TP=N == TP=1 (requests and a forward's logits) and alone == batched; with the default reduction alone ==
batched; fast mode (local combine + NCCL all-reduce) runs; rank 0 holds exactly its share of the experts.
"""

import random

import pytest
import torch
from test_tensor_parallel import REQUESTS, engine_at, forward_logits, greedy, prompt, run, sampled

from detinfer.distributed.layers import ExpertParallelMoE
from detinfer.models.testing import write_tiny_checkpoint

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
COMMON = dict(vocab_size=2048, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
              max_position_embeddings=1024, dtype="bfloat16")
MODELS = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(head_dim=128, intermediate_size=1024, extra=dict(
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True, mlp_only_layers=[3]))),
    "mixtral": ("MixtralForCausalLM", dict(intermediate_size=512, extra=dict(num_local_experts=8,
                                                                            num_experts_per_tok=2))),
}


@pytest.fixture(scope="module", autouse=True)
def two_gpus():
    if GPUS < 2:
        pytest.skip(f"expert parallelism needs >= 2 GPUs, {GPUS} visible")


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_dir(request, tmp_path_factory):
    arch, kw = MODELS[request.param]
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ep_gpu") / request.param, arch, seed=17, **COMMON, **kw)


def _results(model_dir, tp, **kw):
    engine = engine_at(model_dir, tp, device="cuda", max_num_batched_tokens=64, max_num_seqs=8, **kw)
    try:
        if tp > 1:
            moe = [layer.mlp for layer in engine.runner.model.layers if isinstance(layer.mlp, ExpertParallelMoE)]
            assert moe and all(m.gate_up_proj.shape[0] * tp == engine.model_config.num_experts for m in moe)
        batched = run(engine, REQUESTS)
        alone = {rid: run(engine, [(0, rid, p, params)])[rid] for _, rid, p, params in REQUESTS}
        return batched, alone, forward_logits(engine).cpu()
    finally:
        engine.close()


def test_tp_sizes_give_tp1_bits_with_invariant_reduction(model_dir):
    b1, a1, l1 = _results(model_dir, 1, tp_invariant_reduction=True)
    assert b1 == a1
    for tp in [2] + ([4] if GPUS >= 4 else []):
        b, a, logits = _results(model_dir, tp, tp_invariant_reduction=True)
        assert b == a, f"TP={tp}: alone != batched"
        assert b == b1, f"TP={tp} differs from TP=1"
        assert torch.equal(logits, l1)


def test_default_reduction_is_batch_invariant(model_dir):
    rng = random.Random(3)
    reqs = [(i // 3, f"r{i}", prompt(rng, 5 + 11 * i), greedy(6) if i % 2 else sampled(6, seed=i)) for i in range(6)]
    engine = engine_at(model_dir, 2, device="cuda", max_num_batched_tokens=32, max_num_seqs=8)
    try:
        batched = run(engine, reqs)
        alone = {rid: run(engine, [(0, rid, p, params)])[rid] for _, rid, p, params in reqs}
        assert batched == alone
    finally:
        engine.close()


def test_fast_mode_runs(model_dir):
    engine = engine_at(model_dir, 2, device="cuda", mode="fast")
    try:
        out = run(engine, [(0, "x", [5, 6, 7, 8], greedy(4))])["x"]
        assert out.error is None and len(out.completions[0].token_ids) == 4
    finally:
        engine.close()
