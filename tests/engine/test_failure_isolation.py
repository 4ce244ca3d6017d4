"""A failure caused by one request (in its sampling or its forward pass) aborts that request alone: the engine
keeps serving, and every other request's tokens and logprobs are bit-identical to a run without the bad one.
Also: values that do not fit the engine's tensors are refused by SamplingParams, and tiny temperatures are
greedy instead of overflowing."""

import pytest
import torch
from test_engine_api import drain

import detinfer.engine.device_step as device_step
from detinfer.engine import EngineConfig, LLMEngine, SamplingParams
from detinfer.engine.sampler import sample
from detinfer.models.testing import write_tiny_checkpoint

CONFIG = EngineConfig(max_num_batched_tokens=64, max_num_seqs=8, block_size=4, num_kv_blocks=96)
BAD_SEED = 4242  # marks the request whose path the tests make fail


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = write_tiny_checkpoint(tmp_path_factory.mktemp("isolation") / "llama", "LlamaForCausalLM", seed=5,
                                      hidden_size=64, intermediate_size=96, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=64, max_position_embeddings=96)
    return LLMEngine(model_dir, CONFIG, device="cpu")


GOOD = {
    "greedy": ([5, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True)),
    "sampled": ([11, 12, 13], SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=5, logprobs=2,
                                             ignore_eos=True, n=2)),
    "prompt_lp": ([3, 4, 5, 6, 7, 8, 9, 10], SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1,
                                                            logprobs=0, ignore_eos=True)),
}
BAD = ([5, 6, 7, 8, 9, 10], SamplingParams(temperature=1.0, seed=BAD_SEED, max_tokens=5, ignore_eos=True))


def _run(engine, requests):
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    return drain(engine)


def _bits(out):
    """Everything a client sees, as exact values (floats compared by their bits through ==)."""
    return ([(o.token_ids, o.text, o.finish_reason, o.cumulative_logprob,
              [(e.token_id, e.logprob, e.rank, tuple(e.top_logprobs.items())) for e in o.logprobs or ()])
             for o in out.outputs],
            [None if e is None else (e.token_id, e.logprob) for e in out.prompt_logprobs or ()])


def _fail_sampling_of_bad(monkeypatch, after_calls: int = 0):
    calls = [0]
    real = device_step.sample

    def flaky(logits, params, seeds, *args, **kw):
        if any(s == BAD_SEED for s in seeds):
            calls[0] += 1
            if calls[0] > after_calls:
                raise RuntimeError("injected sampling failure")
        return real(logits, params, seeds, *args, **kw)

    monkeypatch.setattr(device_step, "sample", flaky)


def _fail_forward_of_bad(monkeypatch, engine, after_calls: int = 0):
    calls = [0]
    real = engine.runner.execute

    def flaky(batch, **kw):
        if any(item.seq.request_id == "bad" for item in batch.scheduled):
            calls[0] += 1
            if calls[0] > after_calls:
                raise RuntimeError("injected forward failure")
        return real(batch, **kw)

    monkeypatch.setattr(engine.runner, "execute", flaky)


@pytest.mark.parametrize("where,after", [("sampling", 2), ("forward", 0)])
def test_failure_in_one_request_aborts_only_it(engine, monkeypatch, where, after):
    clean = _run(engine, GOOD)
    if where == "sampling":
        _fail_sampling_of_bad(monkeypatch, after)
    else:
        _fail_forward_of_bad(monkeypatch, engine, after)
    mixed = _run(engine, {**GOOD, "bad": BAD})
    assert mixed["bad"].error is not None and "injected" in mixed["bad"].error
    assert all(o.finish_reason == "abort" for o in mixed["bad"].outputs)
    for rid in GOOD:
        assert mixed[rid].error is None
        assert _bits(mixed[rid]) == _bits(clean[rid]), rid
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks
    monkeypatch.undo()
    again = _run(engine, GOOD)  # the engine keeps serving, with the same bits
    assert all(_bits(again[rid]) == _bits(clean[rid]) for rid in GOOD)


def test_a_lone_failing_request_is_aborted_and_the_engine_goes_on(engine, monkeypatch):
    _fail_sampling_of_bad(monkeypatch)
    out = _run(engine, {"bad": BAD})
    assert "injected sampling failure" in out["bad"].error
    monkeypatch.undo()
    assert _run(engine, {"ok": GOOD["greedy"]})["ok"].error is None


@pytest.mark.parametrize("field,value", [
    ("top_k", 1 << 63), ("max_tokens", 1 << 63), ("n", 1 << 64), ("logprobs", 1 << 63),
    ("stop_token_ids", (1 << 63,)), ("temperature", 1e39), ("repetition_penalty", 1e-45),
    ("repetition_penalty", 1e39),
])
def test_values_the_engine_cannot_hold_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_largest_accepted_top_k_runs(engine):
    big = SamplingParams(temperature=1.0, top_k=(1 << 63) - 1, seed=3, max_tokens=3)
    same = SamplingParams(temperature=1.0, top_k=0, seed=3, max_tokens=3)
    a = _run(engine, {"a": ([5, 6], big)})["a"]
    b = _run(engine, {"b": ([5, 6], same)})["b"]
    assert a.error is None and a.outputs[0].token_ids == b.outputs[0].token_ids  # top_k >= vocab: off


@pytest.mark.parametrize("temperature", [1e-6, 1e-30, 1e-39, 1e-45, 5e-324])
def test_tiny_temperature_is_greedy(temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 8
    p = SamplingParams(temperature=temperature, seed=1)
    assert p.is_greedy
    for extra in ({}, {"top_k": 5}, {"top_p": 0.5}):
        params = [SamplingParams(temperature=temperature, seed=1, **extra)] * 6
        drawn = sample(logits, params, [1] * 6, list(range(6)))
        assert torch.equal(drawn, torch.argmax(logits, dim=-1))
    assert not SamplingParams(temperature=1e-5, seed=1).is_greedy  # the threshold itself samples


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["sampling", "forward"])
def test_failure_isolation_on_gpu_is_bit_exact(tmp_path, monkeypatch, where):
    """The same on CUDA in bf16 (Triton kernels): the survivors' bits equal a run without the bad request."""
    model_dir = write_tiny_checkpoint(tmp_path / "qwen3", "Qwen3ForCausalLM", seed=6, max_position_embeddings=96)
    engine = LLMEngine(model_dir, EngineConfig(max_num_batched_tokens=64, max_num_seqs=8, block_size=16,
                                               num_kv_blocks=64, dtype="bfloat16"), device="cuda")
    clean = _run(engine, GOOD)
    if where == "sampling":
        _fail_sampling_of_bad(monkeypatch, 2)
    else:
        _fail_forward_of_bad(monkeypatch, engine, 1)
    mixed = _run(engine, {**GOOD, "bad": BAD})
    assert "injected" in mixed["bad"].error
    for rid in GOOD:
        assert _bits(mixed[rid]) == _bits(clean[rid]), rid
