"""Engine-level batch invariance on CPU (deterministic mode), asserted bitwise.

A request's outputs (token ids, every logprob and top-k entry, cumulative logprob, text, prompt logprobs)
must be identical whether it runs alone or among other requests arriving at random steps, whatever the
token budget (chunked prefill at 16 / 64 / 512), block size, prefix-cache state (cold, hot, shared system
prefix) or preemption (a KV pool too small for everyone). Greedy and seeded sampling (temperature > 0)
are both covered. Floats are compared through float.hex, so even -0.0 vs 0.0 would fail.
"""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.engine import EngineConfig, LLMEngine, SamplingParams
from detinfer.engine.testing import drive
from detinfer.models.testing import write_tiny_checkpoint

VOCAB = 320



@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # head_dim 64: a size the Triton attention kernel takes (run here in Triton's interpreter).
    return write_tiny_checkpoint(tmp_path_factory.mktemp("engine_inv") / "llama", "LlamaForCausalLM", seed=3,
                                 hidden_size=64, intermediate_size=96, num_attention_heads=2,
                                 num_key_value_heads=1, head_dim=64)




def run(model_dir, requests, engine=None, **config):
    """requests: [(arrival_step, request_id, prompt_ids, params)]. Steps the engine, adding each request
    at its arrival step, checking the scheduler/block-manager invariants after every step. Returns
    ({request_id: signature}, engine)."""
    engine = engine or LLMEngine(model_dir, EngineConfig(**config), device="cpu")
    results = drive(engine, requests, max_steps=500, after_step=lambda _: engine.scheduler.check_invariants())
    assert engine.stats().kv_blocks_used == 0
    return results, engine


ALONE = dict(max_num_batched_tokens=512, max_num_seqs=8, block_size=16, num_kv_blocks=64)


@pytest.fixture(scope="module")
def alone(model_dir):
    """Memoised 'request run alone on a fresh engine' results, keyed by (prompt, params)."""
    cache = {}

    def get(prompt, params):
        key = (tuple(prompt), params)
        if key not in cache:
            cache[key] = run(model_dir, [(0, "alone", list(prompt), params)], **ALONE)[0]["alone"]
        return cache[key]

    return get


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2, ignore_eos=True, **kw)


def sampled(max_tokens, seed, **kw):
    return SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=seed, max_tokens=max_tokens, logprobs=2,
                          ignore_eos=True, **kw)


def prompt(rng, n):
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def assert_all_match_alone(results, requests, alone):
    for _, rid, p, params in requests:
        assert results[rid] == alone(p, params), f"request {rid} differs from its run alone"


@pytest.mark.parametrize("budget", [16, 64, 512, 2048])
def test_mixed_batch_equals_alone_per_budget(model_dir, alone, budget):
    rng = random.Random(budget)
    requests = [
        (0, "greedy-long", prompt(rng, 37), greedy(5)),
        (0, "sampled", prompt(rng, 20), sampled(5, seed=11)),
        (1, "greedy-short", prompt(rng, 3), greedy(6)),
        (2, "sampled-late", prompt(rng, 26), sampled(4, seed=5, prompt_logprobs=1)),
        (4, "one-token", prompt(rng, 1), greedy(3)),
    ]
    results, _ = run(model_dir, requests, max_num_batched_tokens=budget, max_num_seqs=8, block_size=4,
                     num_kv_blocks=96)
    assert_all_match_alone(results, requests, alone)


def test_preemption_keeps_every_bit(model_dir, alone):
    rng = random.Random(7)
    requests = [(i // 2, f"r{i}", prompt(rng, 14 + 3 * i), (greedy(8) if i % 2 else sampled(8, seed=i)))
                for i in range(4)]
    # 4-token blocks, 12 blocks: each request alone fits (<= 9 blocks), all four together cannot.
    results, engine = run(model_dir, requests, max_num_batched_tokens=32, max_num_seqs=4, block_size=4,
                          num_kv_blocks=12)
    assert engine.stats().num_preemptions > 0, "the scenario was meant to force preemption"
    assert_all_match_alone(results, requests, alone)


def test_prefix_cache_hot_and_shared_system_prefix(model_dir, alone):
    rng = random.Random(3)
    system = prompt(rng, 18)
    target = system + prompt(rng, 9)
    params = sampled(5, seed=99)
    engine = LLMEngine(model_dir, EngineConfig(max_num_batched_tokens=64, max_num_seqs=4, block_size=4,
                                               num_kv_blocks=64), device="cpu")
    cold, engine = run(model_dir, [(0, "cold", target, params)], engine=engine)
    hits_before = engine.stats().prefix_cache_hit_tokens
    # Same prompt again (its full blocks are cached now), next to another user of the same system prefix.
    other = system + prompt(rng, 5)
    hot, engine = run(model_dir, [(0, "hot", target, params), (0, "other", other, greedy(4))], engine=engine)
    assert engine.stats().prefix_cache_hit_tokens - hits_before >= 2 * 16, "expected prefix-cache hits"
    assert cold["cold"] == hot["hot"] == alone(target, params)
    assert hot["other"] == alone(other, greedy(4))


@st.composite
def scenarios(draw):
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    target_prompt = prompt(rng, draw(st.integers(1, 24)))
    mode = draw(st.sampled_from(["greedy", "sampled"]))
    target = greedy(4) if mode == "greedy" else sampled(4, seed=draw(st.integers(0, 2**40)))
    others = []
    for i in range(draw(st.integers(1, 3))):
        n = draw(st.integers(1, 20))
        shared = draw(st.integers(0, len(target_prompt)))  # a common prefix with the target
        p = (target_prompt[:shared] + prompt(rng, n))[:24]
        params = greedy(draw(st.integers(1, 4))) if i % 2 else sampled(draw(st.integers(1, 4)), seed=i)
        others.append((draw(st.integers(0, 4)), f"o{i}", p, params))
    config = dict(max_num_batched_tokens=draw(st.sampled_from([16, 64, 512])), max_num_seqs=4,
                  block_size=draw(st.sampled_from([4, 16])), enable_prefix_caching=draw(st.booleans()))
    config["num_kv_blocks"] = draw(st.sampled_from([3, 64])) * (16 // config["block_size"])
    return (draw(st.integers(0, 3)), "target", target_prompt, target), others, config


@settings(max_examples=4)
@given(scenarios())
def test_random_schedules_equal_alone(model_dir, alone, scenario):
    target, others, config = scenario
    results, _ = run(model_dir, [target, *others], **config)
    assert results["target"] == alone(target[2], target[3])


def test_decode_logprob_equals_prompt_logprob_fed_back(model_dir):
    """The logprob (and top-k) a token got when it was sampled equals the prompt logprob of the same
    token when prompt + output is fed back as a prompt, here prefilled in chunks of 16."""
    rng = random.Random(21)
    p = prompt(rng, 11)
    first, _ = run(model_dir, [(0, "gen", p, sampled(6, seed=4))], **ALONE)
    out_ids, out_lps = first["gen"].completions[0].token_ids, first["gen"].completions[0].logprobs
    back, _ = run(model_dir, [(0, "back", list(p) + list(out_ids),
                               SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2))],
                  max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_kv_blocks=32)
    prompt_lps = back["back"].prompt_logprobs
    assert prompt_lps[len(p):] == out_lps


def test_fast_mode_negative_control(model_dir):
    """The same comparison in fast mode (stock CPU matmuls, batch-sized attention splits) finds
    differences: the harness above can see a batch-variant engine."""
    rng = random.Random(16)
    requests = [(0, "long", prompt(rng, 37), greedy(5)), (0, "sampled", prompt(rng, 20), sampled(5, seed=11)),
                (1, "short", prompt(rng, 3), greedy(6))]
    fast = dict(mode="fast", max_num_seqs=8, block_size=4, num_kv_blocks=96)
    mixed, _ = run(model_dir, requests, max_num_batched_tokens=16, **fast)
    alone_fast = {rid: run(model_dir, [(0, rid, p, params)], max_num_batched_tokens=512, **fast)[0][rid]
                  for _, rid, p, params in requests}
    assert any(mixed[rid] != alone_fast[rid] for rid in alone_fast)
