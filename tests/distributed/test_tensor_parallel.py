"""Tensor parallelism on CPU: worker processes over gloo, fp32, a tiny model, asserted bitwise.

- With tp_invariant_reduction, TP = 2 and 4 give TP=1's bits: token ids, every logprob and top-k entry,
  prompt logprobs, and the logits of a forward; and at every TP size a request alone == in a batch.
- Without it, TP=2 is batch-invariant through chunked prefill, prefix-cache hits and preemption.
- Bad configurations are refused with messages naming what is allowed; a killed worker gives an error
  (the request ends with it, later steps fail at once), never a hang.

The model covers GQA-to-MQA replication (one KV head on 2 and 4 ranks), a vocabulary that does not divide
by the TP size (padded last shard), untied lm_head, and biases on every projection (row-parallel biases are
added once, after the cross-rank sum). Each engine start spawns TP-1 processes (a few seconds each on 2
cores), so engines are shared per module and few.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

from detinfer.cache.layout import StepLayout
from detinfer.distributed import check_tp_config, tp_invariant_chunks
from detinfer.engine import EngineConfig, LLMEngine, SamplingParams
from detinfer.engine.testing import drive
from detinfer.engine.tp_worker import LayoutBatch
from detinfer.models.config import ModelConfig
from detinfer.models.testing import tiny_config_dict, write_tiny_checkpoint

VOCAB = 322  # not a multiple of 4: the last vocab shard is padded
MODEL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=1,
             head_dim=8, attention_bias=True, mlp_bias=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tp") / "llama", "LlamaForCausalLM", seed=7, **MODEL)


def run(engine, requests, max_steps=400):
    """requests: [(arrival_step, id, prompt ids, params)] -> {id: signature}."""
    return drive(engine, requests, max_steps=max_steps)


def greedy(n, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, logprobs=2, ignore_eos=True, **kw)


def sampled(n, seed, **kw):
    return SamplingParams(temperature=0.9, top_p=0.9, seed=seed, max_tokens=n, logprobs=2, ignore_eos=True, **kw)


def prompt(rng, n):
    return [rng.randrange(3, VOCAB) for _ in range(n)]


_rng = random.Random(5)
REQUESTS = [(0, "a", prompt(_rng, 13), greedy(4, prompt_logprobs=2)), (0, "b", prompt(_rng, 7), sampled(4, seed=3)),
            (1, "c", prompt(_rng, 21), greedy(3)), (2, "d", prompt(_rng, 2), sampled(3, seed=9))]


def forward_logits(engine, argmax_only: bool = False) -> torch.Tensor:
    """The logits of one packed forward (two sequences, every row), straight from the runner (or, with
    `argmax_only`, each row's argmax as the runner finds it: from the ranks' own maxima under TP)."""
    rng = random.Random(1)
    layout = StepLayout.build([[40, 41], [42, 43, 44]], [0, 0], [6, 9], 4, token_ids=[prompt(rng, 6), prompt(rng, 9)],
                              num_logits=[6, 9])
    return engine.runner.execute(LayoutBatch(layout), argmax_only=argmax_only).clone()


# Plain greedy requests (no logprobs, no processors): their steps take the argmax-only path; the same
# requests with logprobs take the full logits through the sampler.
PLAIN = [(0, f"p{i}", prompt(_rng, 5 + 4 * i), SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
         for i in range(3)]


def engine_at(model_dir, tp, device="cpu", **kw):
    cfg = dict(max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_kv_blocks=64, max_model_len=64)
    return LLMEngine(model_dir, EngineConfig(tensor_parallel_size=tp, **{**cfg, **kw}), device=device)


@pytest.fixture(scope="module")
def invariant_runs(model_dir):
    """tp -> (batched results, alone results, forward logits), tp_invariant_reduction on."""
    runs = {}
    for tp in (1, 2, 4):
        engine = engine_at(model_dir, tp, tp_invariant_reduction=True)
        try:
            batched = run(engine, REQUESTS)
            alone = {rid: run(engine, [(0, rid, p, params)])[rid] for _, rid, p, params in REQUESTS}
            plain = run(engine, PLAIN)
            with_logprobs = run(engine, [(t, rid, p, greedy(5)) for t, rid, p, _ in PLAIN])
            runs[tp] = (batched, alone, forward_logits(engine), forward_logits(engine, argmax_only=True),
                        plain, with_logprobs)
        finally:
            engine.close()
    return runs


def test_model_shapes_exercise_the_edge_cases(model_dir):
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.num_key_value_heads == 1 and VOCAB % 4 and not cfg.tie_word_embeddings and cfg.o_bias
    assert tp_invariant_chunks(cfg) == 4


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_alone_equals_batched_at_each_tp_size(invariant_runs, tp):
    batched, alone = invariant_runs[tp][:2]
    assert batched == alone
    assert all(sig.error is None and len(sig.completions[0].token_ids) > 0 for sig in batched.values())


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_size_does_not_change_a_bit(invariant_runs, tp):
    batched, alone, logits, ids, plain = invariant_runs[tp][:5]
    batched1, _, logits1, ids1, plain1 = invariant_runs[1][:5]
    assert batched == batched1 and plain == plain1
    assert logits.shape == (15, VOCAB) and torch.equal(logits, logits1) and torch.equal(ids, ids1)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_argmax_only_steps_give_the_logits_argmax(invariant_runs, tp):
    """The runner's argmax-only finish (at TP: each rank's best (value, id), the first maximum picked) gives
    argmax of the full logits, and plain greedy requests get the tokens they get through the sampler."""
    _, _, logits, ids, plain, with_logprobs = invariant_runs[tp]
    assert ids.dtype == torch.int64 and torch.equal(ids, torch.argmax(logits, dim=-1))
    assert {rid: s.completions[0].token_ids for rid, s in plain.items()} == \
        {rid: s.completions[0].token_ids for rid, s in with_logprobs.items()}
    assert all(len(s.completions[0].token_ids) == 5 for s in plain.values())


def test_tp2_batch_invariant_through_chunks_prefix_cache_and_preemption(model_dir):
    """Default reduction (one partial per rank, gathered, added in rank order). 4-token blocks, 20 blocks:
    each request alone fits, all four together do not (preemption); the alone runs after the batch hit the
    prefix cache; a 16-token budget chunks every prefill."""
    rng = random.Random(11)
    system = prompt(rng, 8)
    reqs = [(i // 2, f"r{i}", system + prompt(rng, 6 + 3 * i), greedy(8) if i % 2 else sampled(8, seed=i))
            for i in range(4)]
    engine = engine_at(model_dir, 2, num_kv_blocks=20)
    try:
        batched = run(engine, reqs)
        assert engine.stats().num_preemptions > 0, "the scenario was meant to force preemption"
        hits = engine.stats().prefix_cache_hit_tokens
        alone = {rid: run(engine, [(0, rid, p, params)])[rid] for _, rid, p, params in reqs}
        assert engine.stats().prefix_cache_hit_tokens > hits, "expected prefix-cache hits"
        assert batched == alone
        from detinfer.train import TrainableModel

        with pytest.raises(ValueError, match="tensor_parallel_size=1"):
            TrainableModel(engine)
    finally:
        engine.close()


def test_bad_configs_name_what_is_allowed():
    cfg = ModelConfig.from_dict(tiny_config_dict("LlamaForCausalLM", **MODEL))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 .*num_attention_heads=4.*allowed sizes .*\[1, 2, 4"):
        check_tp_config(cfg, 3)
    wide = ModelConfig.from_dict(tiny_config_dict("LlamaForCausalLM", **{**MODEL, "num_attention_heads": 8,
                                                                         "num_key_value_heads": 4}))
    assert tp_invariant_chunks(wide) == 8
    odd = ModelConfig.from_dict(tiny_config_dict("LlamaForCausalLM", **{**MODEL, "intermediate_size": 66}))
    with pytest.raises(ValueError, match=r"intermediate_size=66 .*allowed sizes for this model: \[1, 2\]"):
        check_tp_config(odd, 4)
    twelve = ModelConfig.from_dict(tiny_config_dict("LlamaForCausalLM", **{**MODEL, "num_attention_heads": 12,
                                                                           "intermediate_size": 96}))
    check_tp_config(twelve, 3)
    with pytest.raises(ValueError, match=r"tp_invariant_reduction .*4 reduction chunks.*allowed sizes .*\[1, 2, 4\]"):
        check_tp_config(twelve, 3, invariant=True)
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be in \[1, 64\]"):
        EngineConfig(tensor_parallel_size=0)
    # Means nothing in fast mode: the engine's resolved config drops it (a new config; the given one is unchanged).
    given = EngineConfig(mode="fast", tp_invariant_reduction=True)
    assert given.resolved(64).tp_invariant_reduction is False and given.tp_invariant_reduction is True
    assert EngineConfig(tp_invariant_reduction=True).replace(mode="fast").resolved(64).tp_invariant_reduction is False
    assert EngineConfig(tp_invariant_reduction=True).resolved(64).tp_invariant_reduction is True


def test_engine_refuses_a_tp_size_the_model_cannot_take(model_dir):
    with pytest.raises(ValueError, match=r"allowed sizes for this model: \[1, 2, 4\]"):
        engine_at(model_dir, 3)


def test_fast_mode_runs_and_a_killed_worker_is_an_error_not_a_hang(model_dir):
    engine = engine_at(model_dir, 2, mode="fast")
    try:
        out = run(engine, [(0, "fast", [5, 6, 7, 8], greedy(3))])["fast"]
        assert out.error is None and len(out.completions[0].token_ids) == 3  # fast mode (library all-reduce) generates
        worker = engine.runner._procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=30)
        start = time.monotonic()
        dead = run(engine, [(0, "after", [5, 6, 7], greedy(3))])["after"]
        assert "tensor-parallel worker rank 1 failed" in dead.error
        with pytest.raises(RuntimeError, match="worker rank 1 failed"):
            engine.runner.execute(LayoutBatch(StepLayout.build([[0]], [0], [1], 4, token_ids=[[5]], num_logits=[1])))
        assert time.monotonic() - start < 60
    finally:
        engine.close()
