"""Sharded loading on GPUs: random presets drawn on a GPU have the CPU's bits, an 8B-shaped rank's shard is
drawn in seconds, and a random preset at TP=2 (each rank drawing its own slices on its own GPU) gives TP=1's
bits with tp_invariant_reduction. Skipped (shown as skipped) without CUDA; the TP=2 test also with one GPU.
"""

import time

import pytest
import torch
from test_sharded_loading import ENGINE, expected_shard_bytes, outputs

from detinfer.engine import EngineConfig, LLMEngine
from detinfer.models.random_weights import random_state
from detinfer.models.weight_sources import RandomWeights
from detinfer.repro.random_model import preset_config

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(autouse=True)
def cuda():
    if GPUS < 1:
        pytest.skip("needs CUDA")


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3-moe", "tiny-mixtral"])
@pytest.mark.parametrize("size", [1, 2])
def test_gpu_draws_the_cpu_bits(preset, size):
    cfg = preset_config(preset)
    for rank in range(size):
        cpu = random_state(cfg, seed=3, dtype=torch.bfloat16, device="cpu", rank=rank, size=size)
        gpu = random_state(cfg, seed=3, dtype=torch.bfloat16, device="cuda", rank=rank, size=size)
        for name, t in cpu.items():
            assert torch.equal(gpu[name].cpu(), t), name


def test_an_8b_shard_is_drawn_in_seconds():
    cfg = preset_config("qwen3-8b")
    random_state(preset_config("tiny"), seed=0, dtype=torch.bfloat16, device="cuda")  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    state = random_state(cfg, seed=0, dtype=torch.bfloat16, device="cuda", rank=0, size=2)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(f"qwen3-8b rank 0 of 2 drawn in {seconds:.2f} s")
    assert sum(t.numel() * t.element_size() for t in state.values()) == expected_shard_bytes(cfg, 2, 2)
    assert seconds < 60


def test_random_preset_tp2_equals_tp1():
    if GPUS < 2:
        pytest.skip(f"tensor parallelism needs >= 2 GPUs, {GPUS} visible")
    cfg = preset_config("qwen3-0.6b")
    weights = RandomWeights(seed=1, dtype=torch.bfloat16)
    kw = dict(ENGINE, max_model_len=128)
    tp1 = outputs(LLMEngine.from_weights(weights, cfg, EngineConfig(**kw), "cuda"), cfg.vocab_size)
    engine = LLMEngine.from_weights(weights, cfg, EngineConfig(tensor_parallel_size=2, **kw), "cuda")
    assert engine.runner.weight_bytes == (expected_shard_bytes(cfg, 2, 2),) * 2
    tp2 = outputs(engine, cfg.vocab_size)
    assert tp2 == tp1 and all(sig.error is None for sig in tp2.values())
