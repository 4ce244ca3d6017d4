"""Tensor-parallel engines load sharded: every rank (rank 0 too) reads only its own slices of a checkpoint or
draws only its own slices of a random preset, and reports the bytes it holds, which are its shard's as the
config implies. The results are the bits of the old path (rank 0 shards a whole in-memory model) and, with
tp_invariant_reduction, TP=1's. CPU, gloo, 2 and 4 processes.
"""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from detinfer.distributed import layers
from detinfer.engine import EngineConfig, LLMEngine, SamplingParams
from detinfer.engine.testing import drive
from detinfer.models import loader
from detinfer.models.config import ModelConfig
from detinfer.models.testing import expected_shard_numel, write_tiny_checkpoint
from detinfer.models.weight_sources import RandomWeights
from detinfer.repro.random_model import preset_config

ENGINE = dict(max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_kv_blocks=64, max_model_len=64,
              tp_invariant_reduction=True)


def expected_shard_bytes(cfg: ModelConfig, size: int, element_size: int) -> int:
    return expected_shard_numel(cfg, size) * element_size


def requests(vocab: int):
    rng = random.Random(3)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, ignore_eos=True, prompt_logprobs=1)
    sampled = SamplingParams(temperature=0.8, seed=4, max_tokens=4, logprobs=2, ignore_eos=True)
    return [(0, "a", [rng.randrange(3, vocab) for _ in range(11)], greedy),
            (1, "b", [rng.randrange(3, vocab) for _ in range(5)], sampled)]


def outputs(engine, vocab):
    try:
        return drive(engine, requests(vocab))
    finally:
        engine.close()


def test_checkpoint_tp2_loads_sharded_and_matches_the_whole_model_path_and_tp1(stories_dir, monkeypatch):
    cfg = ModelConfig.from_dir(stories_dir)
    whole_model_path = LLMEngine.from_model(*loader.load_model(stories_dir),
                                            EngineConfig(tensor_parallel_size=2, **ENGINE),
                                            tokenizer=loader.load_tokenizer(stories_dir))  # (outputs carry text)
    old = outputs(whole_model_path, cfg.vocab_size)
    tp1 = outputs(LLMEngine(stories_dir, EngineConfig(**ENGINE), device="cpu"), cfg.vocab_size)

    def refuse(*args, **kwargs):
        raise AssertionError("rank 0 built or split the whole model")

    monkeypatch.setattr(loader, "load_model", refuse)  # rank 0 is this process: it never has the full model
    monkeypatch.setattr(layers, "shard_state", refuse)
    monkeypatch.setattr("detinfer.engine.llm_engine.load_model", refuse)
    monkeypatch.setattr("detinfer.engine.tp_runner.shard_state", refuse)
    engine = LLMEngine(stories_dir, EngineConfig(tensor_parallel_size=2, **ENGINE), device="cpu")
    assert engine.runner.weight_bytes == (expected_shard_bytes(cfg, 2, 4),) * 2
    assert sum(engine.runner.weight_bytes) < 2 * expected_shard_bytes(cfg, 1, 4)  # less than two full copies
    sharded = outputs(engine, cfg.vocab_size)
    assert sharded == old, "sharded loading changed the bits of the whole-model path"
    assert sharded == tp1
    assert all(sig.error is None for sig in sharded.values())


def test_random_preset_tp4_draws_per_rank_and_matches_tp1():
    cfg = preset_config("tiny")  # 2 KV heads on 4 ranks: replicated; the padded-free 512 vocab
    weights = RandomWeights(seed=9, dtype=torch.float32)
    tp1 = outputs(LLMEngine.from_weights(weights, cfg, EngineConfig(**ENGINE), "cpu"), cfg.vocab_size)
    engine = LLMEngine.from_weights(weights, cfg, EngineConfig(tensor_parallel_size=4, **ENGINE), "cpu")
    assert engine.runner.weight_bytes == (expected_shard_bytes(cfg, 4, 4),) * 4
    tp4 = outputs(engine, cfg.vocab_size)
    assert tp4 == tp1 and all(sig.error is None for sig in tp4.values())


def test_loading_errors_name_the_rank_and_the_tensor(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "m", "LlamaForCausalLM", num_hidden_layers=1)
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors = load_file(ckpt / "model.safetensors")
    tensors[name][-1, 0] = float("nan")  # read by rank 1 only
    save_file(tensors, str(ckpt / "model.safetensors"))
    message = rf"(?s)worker rank 1 failed during start-up.*rank 1 of 2: .*{name} holds NaN"
    with pytest.raises(RuntimeError, match=message):
        LLMEngine(ckpt, EngineConfig(tensor_parallel_size=2, **ENGINE), device="cpu")
    tensors.pop("model.layers.0.mlp.up_proj.weight")
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(ValueError, match=r"(?s)rank 0 of 2: .*missing tensors: model.layers.0.mlp.up_proj.weight"):
        LLMEngine(ckpt, EngineConfig(tensor_parallel_size=2, **ENGINE), device="cpu")
