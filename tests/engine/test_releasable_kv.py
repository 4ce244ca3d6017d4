"""A releasable KV pool (`releasable_kv_cache=True`; cache/releasable.py): an idle engine hands the pool's memory
back and takes it again; afterwards it gives the bits of an engine that never did (token ids and logprobs),
at TP=1 and TP=2 (gloo on CPU; GPUs: CUDA graphs on, the pool's addresses unchanged, the memory really freed).
Refusals: unfinished requests, a step while released, a pool built without the option."""

import gc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.engine import EngineConfig, LLMEngine, SamplingParams
from detinfer.engine.testing import drive
from detinfer.models.testing import write_tiny_checkpoint

ENGINE = dict(max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_kv_blocks=64, max_model_len=64)


def generate(engine, prompts, seed=4):
    """Each request's signature (token ids, logprobs as exact hex, finish reasons, ...) by request id."""
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=seed, logprobs=0, ignore_eos=True)
    return drive(engine, [(0, str(i), p, params) for i, p in enumerate(prompts)])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("releasable") / "llama", "LlamaForCausalLM", seed=5,
                                 vocab_size=322, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=8)


@pytest.fixture(scope="module")
def engines(tiny_dir):
    plain = LLMEngine(str(tiny_dir), EngineConfig(**ENGINE), device="cpu")
    releasable = LLMEngine(str(tiny_dir), EngineConfig(**ENGINE, releasable_kv_cache=True), device="cpu")
    return plain, releasable


@settings(max_examples=8, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(1, 321), min_size=1, max_size=12), min_size=1, max_size=4),
       seed=st.integers(0, 1000), cycles=st.integers(1, 3))
def test_release_and_restore_change_no_bit(engines, prompts, seed, cycles):
    plain, releasable = engines
    expected = generate(plain, prompts, seed)
    assert generate(releasable, prompts, seed) == expected  # a prefix cache built here is dropped below
    for _ in range(cycles):
        releasable.release_kv_cache()
        assert releasable.runner.kv_released
        assert all(k.numel() == 0 and v.numel() == 0 for k, v in releasable.runner.kv_cache)  # memory given back
        releasable.restore_kv_cache()
    assert not releasable.runner.kv_released
    assert generate(releasable, prompts, seed) == expected


def test_refusals_name_the_problem(engines):
    plain, releasable = engines
    with pytest.raises(RuntimeError, match="not releasable; build it with releasable_kv_cache=True"):
        plain.release_kv_cache()
    releasable.add_request("busy", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="1 unfinished requests"):
        releasable.release_kv_cache()
    assert not releasable.runner.kv_released
    while releasable.has_unfinished_requests():
        releasable.step()
    releasable.release_kv_cache()
    releasable.add_request("early", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="KV cache is released"):
        releasable.step()
    releasable.abort_request("early")
    releasable.restore_kv_cache()
    releasable.restore_kv_cache()  # nothing to do: not released
    while releasable.has_unfinished_requests():
        releasable.step()
    assert generate(releasable, [[1, 7, 9]]) == generate(plain, [[1, 7, 9]])


def test_config_rejects_a_non_bool():
    with pytest.raises(TypeError, match="releasable_kv_cache must be a bool"):
        EngineConfig(releasable_kv_cache="yes")


@pytest.mark.slow
def test_tp2_releases_every_rank_and_keeps_the_bits(tiny_dir):
    prompts = [[1, 5, 9, 13, 17], [1, 22, 7], [1, 40, 41, 42, 43, 44, 45]]
    engine = LLMEngine(str(tiny_dir), EngineConfig(**ENGINE, tensor_parallel_size=2, releasable_kv_cache=True),
                       device="cpu")
    try:
        expected = generate(engine, prompts)
        engine.release_kv_cache()
        assert engine.runner.kv_released
        engine.restore_kv_cache()
        assert generate(engine, prompts) == expected
    finally:
        engine.close()


def _cuda_engine(model_dir, **kw):
    gc.collect()
    torch.cuda.empty_cache()
    cfg = dict(max_num_batched_tokens=256, max_num_seqs=8, block_size=16, num_kv_blocks=4096, dtype="bfloat16")
    return LLMEngine(str(model_dir), EngineConfig(**cfg, **kw), device="cuda")


@pytest.fixture(scope="module")
def gpu_model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("releasable_gpu") / "qwen3", "Qwen3ForCausalLM", seed=3,
                                 vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                 num_attention_heads=8, num_key_value_heads=2, head_dim=128, dtype="bfloat16")


@pytest.mark.gpu
def test_gpu_graphs_stay_valid_and_the_memory_is_freed(gpu_model_dir):
    """CUDA graphs on: the pool is unmapped (free device memory grows by its size), mapped again at the same
    addresses, and the graphs captured before give the plain engine's bits."""
    prompts = [[1, 5, 9, 13, 17] * 7, [1, 22, 7], [1, 40, 41, 42, 43, 44, 45] * 3]
    expected = generate(_cuda_engine(gpu_model_dir), prompts)
    engine = _cuda_engine(gpu_model_dir, releasable_kv_cache=True)
    assert engine.runner.graphs is not None
    assert generate(engine, prompts) == expected
    addresses = [(k.data_ptr(), v.data_ptr()) for k, v in engine.runner.kv_cache]
    pool_bytes = sum(k.nbytes + v.nbytes for k, v in engine.runner.kv_cache)
    free_before = torch.cuda.mem_get_info()[0]
    engine.release_kv_cache()
    freed = torch.cuda.mem_get_info()[0] - free_before
    assert freed >= pool_bytes, (freed, pool_bytes)
    engine.restore_kv_cache()
    assert [(k.data_ptr(), v.data_ptr()) for k, v in engine.runner.kv_cache] == addresses
    assert generate(engine, prompts) == expected


@pytest.mark.gpu
def test_gpu_tp2_release_and_restore_keep_the_bits(gpu_model_dir, two_gpus):
    prompts = [[1, 5, 9, 13, 17] * 7, [1, 22, 7]]
    engine = _cuda_engine(gpu_model_dir, tensor_parallel_size=2, releasable_kv_cache=True)
    try:
        expected = generate(engine, prompts)
        free_before = torch.cuda.mem_get_info(1)[0]
        engine.release_kv_cache()
        assert torch.cuda.mem_get_info(1)[0] > free_before  # the worker on cuda:1 gave its pool back too
        engine.restore_kv_cache()
        assert generate(engine, prompts) == expected
    finally:
        engine.close()
