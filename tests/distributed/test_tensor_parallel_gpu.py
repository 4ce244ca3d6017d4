"""Tensor parallelism on GPUs (NCCL, bf16, Triton kernels), asserted bitwise.

Skipped (shown as skipped) without CUDA; the TP>1 tests also with a single GPU. The model is a random bf16
Qwen3-shaped checkpoint (q/k norm, GQA 8/2, head_dim 128, 8 reduction chunks), big enough that the matmul
and attention kernels pick several configs. Checked: TP=1 with the chunk tree in CUDA graphs == eager (one
GPU); TP=2 == TP=1 with tp_invariant_reduction (requests and a forward's logits); TP=2 alone == batched
with the default reduction; TP=4 == TP=1 when 4 GPUs are visible; fast mode (NCCL all-reduce) runs.
"""

import random

import pytest
import torch
from test_tensor_parallel import REQUESTS, engine_at, forward_logits, greedy, prompt, run, sampled

from detinfer.models.testing import write_tiny_checkpoint

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture
def two_gpus():
    if GPUS < 2:
        pytest.skip(f"tensor parallelism needs >= 2 GPUs, {GPUS} visible")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tp_gpu") / "qwen3", "Qwen3ForCausalLM", seed=13,
                                 vocab_size=2048, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                                 num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                                 max_position_embeddings=1024, dtype="bfloat16")


def _results(model_dir, tp, **kw):
    engine = engine_at(model_dir, tp, device="cuda", max_num_batched_tokens=64, max_num_seqs=8, **kw)
    try:
        batched = run(engine, REQUESTS)
        alone = {rid: run(engine, [(0, rid, p, params)])[rid] for _, rid, p, params in REQUESTS}
        return batched, alone, forward_logits(engine).cpu()
    finally:
        engine.close()


def test_tp1_invariant_reduction_graphs_equal_eager(model_dir):
    """One GPU: the chunk-tree o_proj/down_proj inside CUDA graphs give the eager bits, alone == batched."""
    graphs = _results(model_dir, 1, tp_invariant_reduction=True)
    eager = _results(model_dir, 1, tp_invariant_reduction=True, enforce_eager=True)
    assert graphs[0] == graphs[1] == eager[0] == eager[1]
    assert torch.equal(graphs[2], eager[2])


def test_tp2_and_tp4_give_tp1_bits_with_invariant_reduction(model_dir, two_gpus):
    b1, a1, l1 = _results(model_dir, 1, tp_invariant_reduction=True)
    assert b1 == a1
    for tp in [2] + ([4] if GPUS >= 4 else []):
        b, a, logits = _results(model_dir, tp, tp_invariant_reduction=True)
        assert b == a, f"TP={tp}: alone != batched"
        assert b == b1, f"TP={tp} differs from TP=1"
        assert torch.equal(logits, l1)


def test_tp2_default_reduction_is_batch_invariant(model_dir, two_gpus):
    rng = random.Random(3)
    reqs = [(i // 3, f"r{i}", prompt(rng, 5 + 11 * i), greedy(6) if i % 2 else sampled(6, seed=i)) for i in range(6)]
    engine = engine_at(model_dir, 2, device="cuda", max_num_batched_tokens=32, max_num_seqs=8)
    try:
        batched = run(engine, reqs)
        alone = {rid: run(engine, [(0, rid, p, params)])[rid] for _, rid, p, params in reqs}
        assert batched == alone
    finally:
        engine.close()


def test_tp2_fast_mode_runs(model_dir, two_gpus):
    engine = engine_at(model_dir, 2, device="cuda", mode="fast")
    try:
        out = run(engine, [(0, "x", [5, 6, 7, 8], greedy(4))])["x"]
        assert out.error is None and len(out.completions[0].token_ids) == 4
    finally:
        engine.close()
