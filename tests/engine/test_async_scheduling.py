"""Overlapped scheduling (EngineConfig.async_scheduling) never changes a bit, and never leaks a KV block.

With it on, step n+1 is scheduled and launched before step n's sampled ids are read back: decodes of
those sequences take their input token on the device, sequences that step n finishes (stop token, EOS,
stop string) have one discarded step in flight, aborts drop the pending token. For many workloads
(Hypothesis: prompts with shared prefixes, n, max_tokens, stop tokens and strings, budgets, block sizes,
prefix caching, a KV pool small enough to preempt, aborts mid-stream, greedy / seeded sampling, logprobs
and prompt logprobs), every request's outputs (token ids, text, finish and stop reasons, every logprob
bit) are the same with overlap on and off, in deterministic mode, and the block pool is back to its start
state (all blocks free, consistent) once everything finished. The model is the real stories260k (it has
a tokenizer, so stop strings and EOS fire on real text).
"""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import detinfer.engine.device_step as device_step
from detinfer.engine import EngineConfig, LLMEngine, SamplingParams
from detinfer.engine.testing import drive as drive_engine
from detinfer.models.loader import load_model, load_tokenizer

STOP_STRINGS = ("Lily", " the", ".", "ball", "!")


@pytest.fixture(scope="module")
def stories(stories_dir):
    model, model_config = load_model(stories_dir, torch.float32, "cpu", "deterministic")
    tokenizer = load_tokenizer(stories_dir)
    # Token ids the model likes to emit after "Once upon a time": stop tokens that actually fire.
    engine = LLMEngine.from_model(model, model_config, EngineConfig(max_model_len=128), tokenizer)
    engine.add_request("probe", "Once upon a time", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    common = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            common = list(out.outputs[0].token_ids)
    return model, model_config, tokenizer, common




def drive(stories, config: dict, requests, aborts=None):
    """requests: [(arrival_step, request_id, prompt, params)]; aborts: {request_id: k}: abort the request
    once its streamed output shows >= k tokens. Checks the scheduler's invariants after every step and the
    block pool's start state at the end. Returns ({request_id: signature}, engine)."""
    model, model_config, tokenizer, _ = stories
    engine = LLMEngine.from_model(model, model_config, EngineConfig(**config), tokenizer)
    bm = engine.scheduler.block_manager
    aborts = dict(aborts or {})

    def abort_when_seen(out, _step):  # once its streamed output shows >= k tokens
        if out.request_id in aborts and len(out.outputs[0].token_ids) >= aborts[out.request_id]:
            del aborts[out.request_id]
            engine.abort_request(out.request_id)

    results = drive_engine(engine, requests, on_output=abort_when_seen,
                           after_step=lambda _: engine.scheduler.check_invariants())
    assert engine.get_num_unfinished_requests() == 0
    bm.check_invariants([])  # every block free, ref counts 0, free lists and cache map consistent
    assert bm.num_free_blocks == bm.num_blocks and engine.stats().kv_blocks_used == 0
    return results, engine


def both_ways(stories, config, requests, aborts=None):
    """Run with overlap on and off; assert bitwise-equal outputs; return (results, on-engine, off-engine)."""
    on, engine_on = drive(stories, {**config, "async_scheduling": True}, requests, aborts)
    off, engine_off = drive(stories, {**config, "async_scheduling": False}, requests, aborts)
    assert on.keys() == {r[1] for r in requests}
    for rid in on:
        assert on[rid] == off[rid], f"request {rid}: overlap on and off differ"
    return on, engine_on, engine_off


@pytest.fixture
def count_pending_inputs(monkeypatch):
    """Counts steps whose input ids were (partly) gathered on the device from the previous step."""
    calls = [0]
    real = device_step._input_ids

    def counting(batch, pending):
        ids = real(batch, pending)
        calls[0] += ids is not None
        return ids

    monkeypatch.setattr(device_step, "_input_ids", counting)
    return calls


def test_overlap_is_exercised_and_changes_nothing(stories, count_pending_inputs):
    """Plain decodes, a stop token and a stop string that finish requests with a step in flight, n=2."""
    common = stories[3]
    requests = [
        (0, "greedy", "Once upon a time", SamplingParams(temperature=0.0, max_tokens=20, logprobs=2)),
        (0, "stop-id", "Once upon a time", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                                          stop_token_ids=[common[6]])),
        (1, "stop-str", "Once upon a time", SamplingParams(temperature=0.0, max_tokens=30, stop=["Lily"])),
        (2, "n2", "The cat", SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=12, logprobs=1)),
    ]
    config = dict(max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_kv_blocks=64, max_model_len=128)
    on, engine_on, engine_off = both_ways(stories, config, requests)
    assert on["stop-id"].completions[0].finish_reason == "stop" and on["stop-str"].completions[0].stop_reason == "Lily"
    gathered = count_pending_inputs[0]
    assert gathered > 10, "overlap on should feed decodes from the device"
    # Off: every step reads its ids back before the next is scheduled, so nothing is ever pending.
    drive(stories, {**config, "async_scheduling": False}, requests)
    assert count_pending_inputs[0] == gathered


def test_stop_finish_discards_the_step_in_flight(stories):
    """A request stopped by a token: with overlap its next decode was already launched (one extra step)
    and discarded; the outputs and the freed pool are the same as without overlap."""
    common = stories[3]
    requests = [(0, "a", "Once upon a time", SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                             stop_token_ids=[common[4]], logprobs=3))]
    config = dict(max_num_batched_tokens=64, max_num_seqs=2, block_size=4, num_kv_blocks=32, max_model_len=128)
    on, engine_on, engine_off = both_ways(stories, config, requests)
    a = on["a"].completions[0]
    assert len(a.token_ids) == common.index(common[4]) + 1 and a.finish_reason == "stop"
    assert engine_on.stats().num_steps == engine_off.stats().num_steps + 1
    # A finish by length is known without the token id: no extra step.
    requests = [(0, "b", "Once upon a time", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))]
    _, engine_on, engine_off = both_ways(stories, config, requests)
    assert engine_on.stats().num_steps == engine_off.stats().num_steps


def test_penalties_abort_and_preemption(stories):
    """Penalties (their histories need every id on the host: those steps are not overlapped), aborts
    mid-stream, and a pool that forces preemption of sequences whose token is still pending."""
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (30, 25, 18, 33)]
    requests = [
        (0, "pen", prompts[0], SamplingParams(temperature=0.7, seed=1, max_tokens=14, repetition_penalty=1.3,
                                              frequency_penalty=0.5, logprobs=1, ignore_eos=True)),
        (0, "abort", prompts[1], SamplingParams(temperature=0.0, max_tokens=30, logprobs=2, ignore_eos=True)),
        (1, "g", prompts[2], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=2)),
        (1, "s", prompts[3], SamplingParams(temperature=1.0, seed=9, max_tokens=16, ignore_eos=True)),
    ]
    config = dict(max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_kv_blocks=18, max_model_len=128)
    on, engine_on, engine_off = both_ways(stories, config, requests, aborts={"abort": 5})
    assert on["abort"].completions[0].finish_reason == "abort" and len(on["abort"].completions[0].token_ids) == 5
    assert engine_on.stats().num_preemptions > 0 and engine_off.stats().num_preemptions > 0


@st.composite
def workloads(draw):
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    system = [rng.randrange(3, 500) for _ in range(draw(st.integers(0, 12)))]
    requests, aborts = [], {}
    for i in range(draw(st.integers(1, 5))):
        prompt = (system if draw(st.booleans()) else []) + [rng.randrange(3, 500) for _ in range(rng.randint(1, 20))]
        if draw(st.booleans()):
            prompt = draw(st.sampled_from(["Once upon a time", "The little dog", "Lily saw a"]))
        sampled = draw(st.booleans())
        kw = dict(max_tokens=draw(st.integers(1, 12)), n=draw(st.sampled_from([1, 1, 2])),
                  ignore_eos=draw(st.booleans()),
                  logprobs=draw(st.sampled_from([None, 0, 2])),
                  prompt_logprobs=draw(st.sampled_from([None, None, 1])),
                  stop=list(draw(st.lists(st.sampled_from(STOP_STRINGS), max_size=2))),
                  stop_token_ids=draw(st.lists(st.integers(3, 500), max_size=2)))
        params = (SamplingParams(temperature=0.8, top_k=draw(st.sampled_from([0, 20])), seed=i, **kw) if sampled
                  else SamplingParams(temperature=0.0, **kw))
        rid = f"r{i}"
        requests.append((draw(st.integers(0, 6)), rid, prompt, params))
        if kw["n"] == 1 and draw(st.integers(0, 3)) == 0:
            aborts[rid] = draw(st.integers(1, 4))
    block_size = draw(st.sampled_from([4, 8]))
    config = dict(max_num_batched_tokens=draw(st.sampled_from([4, 8, 16, 64])), max_num_seqs=4,
                  block_size=block_size, enable_prefix_caching=draw(st.booleans()), max_model_len=64,
                  num_kv_blocks=draw(st.sampled_from([12, 24, 64])) * 4 // block_size)
    return requests, aborts, config


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_overlap_on_equals_off(stories, workload):
    requests, aborts, config = workload
    both_ways(stories, config, requests, aborts)


def test_flag_and_default():
    import argparse

    from detinfer.engine.config import add_dataclass_args, from_args

    parser = add_dataclass_args(argparse.ArgumentParser(), EngineConfig)
    assert from_args(EngineConfig, parser.parse_args([])).async_scheduling is True
    assert from_args(EngineConfig, parser.parse_args(["--no-async-scheduling"])).async_scheduling is False
    assert from_args(EngineConfig, parser.parse_args(["--async-scheduling"])).async_scheduling is True
    with pytest.raises(TypeError, match="async_scheduling must be a bool"):
        EngineConfig(async_scheduling="yes")


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("where", ["read back", "launch"])
def test_an_interrupted_step_aborts_its_requests_and_the_engine_goes_on(stories, monkeypatch, overlap, where):
    """Ctrl-C (or any error) while a step is launched or read back: that step's requests end with "abort",
    the call raises, and the engine stays usable: a later request gets the bits it gets on a fresh engine,
    and every KV block comes back."""
    import detinfer.engine.llm_engine as llm_engine
    from detinfer.engine.testing import signature

    model, model_config, tokenizer, _ = stories
    config = EngineConfig(max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_kv_blocks=64,
                          max_model_len=128, async_scheduling=overlap)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)

    def fresh_c():
        engine = LLMEngine.from_model(model, model_config, config, tokenizer)
        engine.add_request("c", "The dog", params)
        return run_to_end(engine)["c"]

    def run_to_end(engine):
        final = {}
        for _ in range(200):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                final[out.request_id] = out
            engine.scheduler.check_invariants()
        assert not engine.has_unfinished_requests()
        return final

    engine = LLMEngine.from_model(model, model_config, config, tokenizer)
    engine.add_request("a", "Once upon a time", params)
    engine.add_request("b", "The cat", params)
    for _ in range(4):
        engine.step()
    calls = [0]
    if where == "read back":
        real = device_step.LaunchedStep.read

        def interrupted(self):
            calls[0] += 1
            if calls[0] == 1:
                raise KeyboardInterrupt
            return real(self)

        monkeypatch.setattr(device_step.LaunchedStep, "read", interrupted)
    else:
        real = llm_engine.launch_step

        def interrupted(*args):
            calls[0] += 1
            if calls[0] == 1:
                raise KeyboardInterrupt
            return real(*args)

        monkeypatch.setattr(llm_engine, "launch_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    engine.add_request("c", "The dog", params)
    final = run_to_end(engine)
    assert calls[0] > 1, "the engine stepped on after the interrupt"
    for rid in ("a", "b"):
        assert final[rid].finished and final[rid].outputs[0].finish_reason == "abort"
    assert final["c"].outputs[0].finish_reason == "length"
    assert signature(final["c"]) == signature(fresh_c())
    bm = engine.scheduler.block_manager
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks
