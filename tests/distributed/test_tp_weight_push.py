"""New full weights pushed into a running TP=2 engine (rank 0 scatters each rank its shards, in buckets) give
the bits of a fresh TP=2 engine built on those weights; the admin load path works at TP=2; bad input changes
nothing; a dead worker is an error, not a hang; bucket plans keep the model's order, one dtype and the byte bound
(property). CPU, gloo, 2 processes; dense and MoE (expert-parallel shards)."""

import os
import signal
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.distributed.weight_push import plan_buckets
from detinfer.engine import EngineConfig, LLMEngine, SamplingParams
from detinfer.engine.admin import load_weights, push_weights, run_admin, weights_sha256
from detinfer.models.config import ModelConfig
from detinfer.models.loader import load_state
from detinfer.models.testing import write_tiny_checkpoint

CKPTS = {
    "llama": ("LlamaForCausalLM", dict(vocab_size=322, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=8, attention_bias=True, mlp_bias=True)),
    "qwen3-moe": ("Qwen3MoeForCausalLM", dict(vocab_size=322, hidden_size=32, intermediate_size=64,
                                              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                              extra={"num_experts": 4, "num_experts_per_tok": 2,
                                                     "moe_intermediate_size": 16})),
}
ENGINE = dict(max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_kv_blocks=64, max_model_len=64)
PROMPTS = [[1, 5, 9, 13, 17], [1, 22, 7], [1, 40, 41, 42, 43, 44, 45]]
PARAMS = SamplingParams(max_tokens=5, temperature=1.0, seed=4, logprobs=0, ignore_eos=True)


def generate(engine, prompts=PROMPTS, params=PARAMS):
    """(token ids, logprobs) per prompt: the bits a test compares."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [(list(done[str(i)].outputs[0].token_ids), [e.logprob for e in done[str(i)].outputs[0].logprobs])
            for i in range(len(prompts))]


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """two_checkpoints(name) -> (a, b): two tiny checkpoints of one architecture (other seeds), written once per
    module; the tests only read them."""
    made = {}

    def get(name):
        if name not in made:
            arch, kw = CKPTS[name]
            root = tmp_path_factory.mktemp(f"push_{name}")
            made[name] = (write_tiny_checkpoint(root / "a", arch, seed=3, **kw),
                          write_tiny_checkpoint(root / "b", arch, seed=11, **kw))
        return made[name]
    return get


@pytest.fixture(scope="module")
def fresh_tp2_outputs():
    """fresh_tp2_outputs(model_dir): what a fresh TP=2 engine built on model_dir generates (the bits a push
    must reproduce), computed once per checkpoint in this module."""
    made = {}

    def get(model_dir):
        if model_dir not in made:
            made[model_dir] = fresh_outputs(model_dir, tensor_parallel_size=2)
        return made[model_dir]
    return get


def full_state(model_dir):
    return load_state(model_dir, ModelConfig.from_dir(model_dir), torch.float32, torch.device("cpu"))


def fresh_outputs(model_dir, **config):
    engine = LLMEngine(model_dir, EngineConfig(**ENGINE, **config), device="cpu")
    try:
        return generate(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("name", list(CKPTS))
def test_pushed_weights_give_a_fresh_tp2_engines_bits(two_checkpoints, fresh_tp2_outputs, name):
    a, b = two_checkpoints(name)
    want = fresh_tp2_outputs(b)
    engine = LLMEngine(a, EngineConfig(tensor_parallel_size=2, **ENGINE), device="cpu")
    try:
        before = generate(engine)  # also fills the prefix cache with checkpoint a's K/V
        assert before != want
        # 4 KiB buckets: several scatters, and tensors larger than a bucket travel alone
        result = push_weights(engine, full_state(b), bucket_bytes=4096)
        assert result["prefix_cache_blocks_dropped"] > 0
        assert generate(engine) == want
    finally:
        engine.close()


def test_admin_load_weights_at_tp2_and_its_digest(two_checkpoints, fresh_tp2_outputs):
    a, b = two_checkpoints("llama")
    want = fresh_tp2_outputs(b)
    tp1 = LLMEngine(b, EngineConfig(**ENGINE), device="cpu")
    digest_b = weights_sha256(tp1.runner.model)
    engine = LLMEngine(a, EngineConfig(tensor_parallel_size=2, **ENGINE), device="cpu")
    try:
        result = run_admin(engine, "load_weights", str(b))
        assert result["weights_sha256"] == digest_b  # the full weights' digest, as a TP=1 engine reports it
        assert generate(engine) == want
        with pytest.raises(ValueError, match="weights_fingerprint needs tensor_parallel_size 1"):
            run_admin(engine, "weights_fingerprint")
    finally:
        engine.close()


def test_bad_pushes_change_nothing_and_name_the_problem(two_checkpoints, tmp_path):
    a, b = two_checkpoints("llama")
    engine = LLMEngine(a, EngineConfig(tensor_parallel_size=2, **ENGINE), device="cpu")
    try:
        before = generate(engine)
        good = full_state(b)
        name = next(iter(good))
        with pytest.raises(ValueError, match="no such parameter"):
            push_weights(engine, {**good, "layers.0.nonsense": torch.zeros(2)})
        with pytest.raises(ValueError, match=f"tensor {name} has shape"):
            push_weights(engine, {**good, name: good[name][:-1]})
        with pytest.raises(ValueError, match="no tensors to load"):
            push_weights(engine, {})
        partial = tmp_path / "partial.safetensors"
        from safetensors.torch import save_file

        save_file({name: good[name]}, str(partial))
        with pytest.raises(ValueError, match="must hold every parameter; missing"):
            load_weights(engine, str(partial))
        assert generate(engine) == before  # every refusal came before the first bucket moved
    finally:
        engine.close()


def test_a_subset_push_changes_only_those_tensors(two_checkpoints, fresh_tp2_outputs):
    a, b = two_checkpoints("llama")
    state_a, state_b = full_state(a), full_state(b)
    engine = LLMEngine(a, EngineConfig(tensor_parallel_size=2, **ENGINE), device="cpu")
    try:
        push_weights(engine, {n: t for n, t in state_b.items() if n.startswith("layers.1.")})
        push_weights(engine, {n: t for n, t in state_b.items() if not n.startswith("layers.1.")})
        assert generate(engine) == fresh_tp2_outputs(b)
        push_weights(engine, state_a)
        assert generate(engine) == fresh_tp2_outputs(a)
    finally:
        engine.close()


def test_a_worker_dead_before_a_push_is_an_error_not_a_hang(two_checkpoints):
    a, b = two_checkpoints("llama")
    engine = LLMEngine(a, EngineConfig(tensor_parallel_size=2, **ENGINE), device="cpu")
    try:
        worker = engine.runner._procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=30)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="worker rank 1 failed"):
            push_weights(engine, full_state(b))
        with pytest.raises(RuntimeError, match="worker rank 1 failed"):  # and the engine says so from then on
            push_weights(engine, full_state(b))
        assert time.monotonic() - start < 60
    finally:
        engine.close()


class _Named(torch.nn.Module):
    def __init__(self, shapes_and_dtypes):
        super().__init__()
        for i, (shape, dtype) in enumerate(shapes_and_dtypes):
            self.register_parameter(f"p{i}", torch.nn.Parameter(torch.empty(shape, dtype=dtype, device="meta")))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(1, 9), min_size=1, max_size=3),
                          st.sampled_from([torch.float32, torch.bfloat16])), min_size=1, max_size=12),
       st.integers(1, 2048), st.data())
def test_bucket_plans_keep_model_order_one_dtype_and_the_byte_bound(params, bucket_bytes, data):
    model = _Named(params)
    named = dict(model.named_parameters())
    wanted = data.draw(st.lists(st.sampled_from(sorted(named)), unique=True, min_size=1))
    buckets = plan_buckets(model, wanted, bucket_bytes)
    flat = [n for b in buckets for n in b]
    assert flat == [n for n in named if n in wanted]  # every name once, in the model's order
    for b in buckets:
        assert len({named[n].dtype for n in b}) == 1
        size = sum(named[n].numel() * named[n].element_size() for n in b)
        assert size <= bucket_bytes or len(b) == 1  # a larger tensor travels alone
    for prev, nxt in zip(buckets, buckets[1:]):  # greedy: a bucket closes only when the next tensor must not join
        first = named[nxt[0]]
        joined = sum(named[n].numel() * named[n].element_size() for n in prev) + first.numel() * first.element_size()
        assert named[prev[-1]].dtype != first.dtype or joined > bucket_bytes
