"""Weight pushes into a TP=2 engine on GPUs (NCCL scatter, bf16, CUDA graphs), asserted bitwise: after the push
the engine samples what a fresh TP=2 engine built on the pushed weights samples, and its captured graphs replay
with the new weights (the copy is in place). The state may live on another GPU than rank 0 (the split layout's
trainer). Skipped (shown as skipped) without 2 GPUs. Timing of a Qwen3-8B-sized push: bench/bench_weight_push.py."""

import pytest
import torch
from test_tp_weight_push import ENGINE, generate

from detinfer.engine import EngineConfig, LLMEngine
from detinfer.engine.admin import push_weights, run_admin, weights_sha256
from detinfer.models.config import ModelConfig
from detinfer.models.loader import load_state
from detinfer.models.testing import write_tiny_checkpoint

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
SHAPE = dict(vocab_size=2048, hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=128, max_position_embeddings=1024, dtype="bfloat16")



@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("push_gpu")
    return tuple(write_tiny_checkpoint(root / name, "Qwen3ForCausalLM", seed=seed, **SHAPE)
                 for name, seed in (("a", 13), ("b", 17)))


def _engine(model_dir, **kw):
    return LLMEngine(model_dir, EngineConfig(**ENGINE, **kw), device="cuda")


@pytest.mark.parametrize("source_gpu", [0, 1])
def test_push_into_a_tp2_engine_with_graphs_gives_a_fresh_engines_bits(checkpoints, two_gpus, source_gpu):
    a, b = checkpoints
    fresh = _engine(b, tensor_parallel_size=2)
    try:
        want = generate(fresh)
    finally:
        fresh.close()
    engine = _engine(a, tensor_parallel_size=2)
    try:
        assert engine.runner.local.use_graphs
        before = generate(engine)
        assert before != want
        state = load_state(b, ModelConfig.from_dir(b), torch.bfloat16, torch.device("cuda", source_gpu))
        push_weights(engine, state, bucket_bytes=1 << 20)  # several buckets
        assert generate(engine) == want
    finally:
        engine.close()


def test_admin_load_at_tp2_on_gpus_reports_the_tp1_digest(checkpoints, two_gpus):
    a, b = checkpoints
    one = _engine(b)
    try:
        digest = weights_sha256(one.runner.model)
    finally:
        one.close()
    engine = _engine(a, tensor_parallel_size=2)
    try:
        assert run_admin(engine, "load_weights", str(b))["weights_sha256"] == digest
    finally:
        engine.close()
