"""LLMEngine / LLM API: input validation (clear errors, no lost state), abort (blocks freed, invariants),
output shapes, n > 1, seeds, stop strings, chat, stats, and the generate CLI."""


import pytest
import torch

from detinfer.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from detinfer.engine.generate_cli import main as generate_main
from detinfer.models import load_model
from detinfer.models.testing import write_tiny_checkpoint

CONFIG = EngineConfig(max_num_batched_tokens=32, max_num_seqs=4, block_size=4, num_kv_blocks=48)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("engine_api") / "llama", "LlamaForCausalLM", seed=8,
                                 hidden_size=64, intermediate_size=96, num_attention_heads=2,
                                 num_key_value_heads=1, head_dim=64, max_position_embeddings=64)


@pytest.fixture(scope="module")
def engine(model_dir):
    return LLMEngine(model_dir, CONFIG, device="cpu")


def drain(engine):
    final, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.scheduler.check_invariants()
        steps += 1
        assert steps < 500
    return final


GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.mark.parametrize("prompt, params, error, match", [
    ("", None, ValueError, "prompt is empty"),
    ([], None, ValueError, "prompt is empty"),
    ([1, 320], None, ValueError, r"prompt_token_ids: token id 320 at position 1 is outside the vocabulary \[0, 320\)"),
    ([1, -2], None, ValueError, "token id -2 at position 1 is outside the vocabulary"),
    ([1, 2.5], None, TypeError, "the token id at position 1 must be an int, got 2.5"),
    ([True], None, TypeError, "the token id at position 0 must be an int, got True"),
    (list(range(3, 68)), None, ValueError, "65 tokens; max_model_len=64 .* at most 63"),
    (list(range(3, 67)), None, ValueError, "64 tokens; max_model_len=64 .* at most 63"),  # no room to answer
    ([5, 6], SamplingParams(logprobs=400), ValueError, "logprobs=400 exceeds the vocabulary size 320"),
    ([5, 6], {"temperature": 0}, TypeError, "params must be a SamplingParams"),
    (12, None, TypeError, "prompt must be a str or a list of token ids"),
])
def test_bad_requests_raise_and_change_nothing(engine, prompt, params, error, match):
    with pytest.raises(error, match=match):
        engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 0
    engine.add_request("bad", [5, 6, 7], GREEDY)  # the id is still free; the engine still works
    assert list(drain(engine)["bad"].outputs[0].token_ids) and engine.stats().kv_blocks_used == 0


def test_request_larger_than_the_kv_pool(model_dir):
    small = LLMEngine(model_dir, CONFIG.replace(num_kv_blocks=8), device="cpu")  # 32 slots
    with pytest.raises(ValueError, match="need 16 KV blocks of 4, but the pool has only 8"):
        small.add_request("big", [5, 6], SamplingParams(max_tokens=60))
    small.add_request("big", [5, 6], SamplingParams(max_tokens=20, temperature=0.0))
    assert len(drain(small)["big"].outputs[0].token_ids) <= 20


def test_bad_request_ids(engine):
    for rid in ("", None, 3):
        with pytest.raises(ValueError, match="request_id must be a non-empty string"):
            engine.add_request(rid, [5, 6], GREEDY)
    engine.add_request("dup", [5, 6], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [7, 8], GREEDY)
    out = drain(engine)["dup"]
    assert out.prompt_token_ids == (5, 6)
    engine.add_request("dup", [7, 8], GREEDY)  # finished ids may be reused
    assert drain(engine)["dup"].prompt_token_ids == (7, 8)


def test_abort_frees_blocks_and_reports(engine):
    bm = engine.scheduler.block_manager
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i in range(6):  # max_num_seqs=4: two of them wait
        engine.add_request(f"a{i}", [10 + i] * (5 + i), params)
    for _ in range(3):
        engine.step()
    assert engine.stats().num_running == 4 and engine.stats().num_waiting == 2
    engine.abort_request("a1")  # running
    engine.abort_request("a5")  # waiting
    engine.abort_request("nope")  # unknown: ignored
    engine.scheduler.check_invariants()
    held = sum(len(s.block_table) for s in engine.scheduler.running)
    assert engine.stats().kv_blocks_used == held
    outs = {o.request_id: o for o in engine.step()}
    assert outs["a1"].finished and outs["a1"].outputs[0].finish_reason == "abort"
    assert outs["a5"].finished and outs["a5"].outputs[0].token_ids == ()
    final = drain(engine)
    assert {k: o.outputs[0].finish_reason for k, o in final.items()} == {
        "a0": "length", "a2": "length", "a3": "length", "a4": "length"}
    assert engine.stats().kv_blocks_used == 0
    bm.check_invariants([])


def test_outputs_are_cumulative_and_finish(engine):
    engine.add_request("c", [40, 41, 42], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                          logprobs=3))
    seen = []
    while engine.has_unfinished_requests():
        seen += [o for o in engine.step() if o.request_id == "c"]
    assert [len(o.outputs[0].token_ids) for o in seen] == [1, 2, 3, 4]
    assert [o.finished for o in seen] == [False, False, False, True]
    last = seen[-1].outputs[0]
    assert last.finish_reason == "length" and len(last.logprobs) == 4
    for tok, lp in zip(last.token_ids, last.logprobs):
        assert lp.token_id == tok and len(lp.top_logprobs) == 3 and lp.rank >= 1
        assert list(lp.top_logprobs.values()) == sorted(lp.top_logprobs.values(), reverse=True)
        assert (lp.rank == 1) == (tok == next(iter(lp.top_logprobs)))  # greedy picks the top token
    assert last.cumulative_logprob == sum(lp.logprob for lp in last.logprobs)


def test_n_samples_and_seeds_replay(model_dir):
    def once(seed_cfg, params):
        engine = LLMEngine(model_dir, CONFIG.replace(seed=seed_cfg), device="cpu")
        engine.add_request("n", [30, 31, 32, 33, 34, 35], params)
        return drain(engine)["n"]

    params = SamplingParams(n=3, temperature=1.0, max_tokens=5, ignore_eos=True)  # no seed: drawn by engine
    a, b, c = once(1, params), once(1, params), once(2, params)
    assert [o.index for o in a.outputs] == [0, 1, 2]
    assert len({o.token_ids for o in a.outputs}) > 1, "the n samples should draw from distinct streams"
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert [o.token_ids for o in a.outputs] != [o.token_ids for o in c.outputs]


def test_from_model_without_tokenizer(model_dir):
    model, cfg = load_model(model_dir, torch.float32, "cpu", "deterministic")
    engine = LLMEngine.from_model(model, cfg, CONFIG)
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        engine.add_request("t", "hello", GREEDY)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.add_request("t", [5], SamplingParams(stop=["x"]))
    engine.add_request("t", [5, 6], GREEDY)
    out = drain(engine)["t"].outputs[0]
    assert out.text == "" and len(out.token_ids) == 3
    with pytest.raises(ValueError, match="Ops\\('deterministic'\\) but the engine mode is 'fast'"):
        LLMEngine.from_model(model, cfg, CONFIG.replace(mode="fast"))


def test_max_model_len_resolution(model_dir):
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings=64"):
        LLMEngine(model_dir, CONFIG.replace(max_model_len=65), device="cpu")
    engine = LLMEngine(model_dir, CONFIG.replace(num_kv_blocks=None), device="cpu")
    assert engine.config.max_model_len == 64
    assert engine.stats().kv_blocks_total == 4 * 16  # CPU default: max_num_seqs full-length sequences


def test_llm_generate_order_forms_and_chat(model_dir):
    llm = LLM(str(model_dir), max_num_batched_tokens=32, max_num_seqs=4, num_kv_blocks=48, block_size=4)
    prompts = ["Hello world", "Once upon a time there was", "The quick brown fox", "a"]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (5, 1, 3, 2)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 1, 3, 2]
    single = llm.generate("Hello world", params[0], use_tqdm=False)
    ids = llm.generate(list(outs[0].prompt_token_ids), params[0], use_tqdm=False)
    assert single[0].outputs[0].token_ids == ids[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="got 2 sampling params for 4 prompts"):
        llm.generate(prompts, params[:2], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate(["fine", ""], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and llm.engine.stats().kv_blocks_used == 0
    chat = llm.chat([{"role": "user", "content": "Hello world"}], params[0], use_tqdm=False)[0]
    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hello world"}], tokenize=True)
    assert list(chat.prompt_token_ids) == rendered and len(chat.outputs[0].token_ids) == 5
    with pytest.raises(TypeError, match="EngineConfig fields"):
        LLM(str(model_dir), not_a_field=1)


def test_stats_counters(model_dir):
    engine = LLMEngine(model_dir, CONFIG, device="cpu")
    engine.add_request("s1", list(range(10, 30)), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.add_request("s2", list(range(10, 30)), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    drain(engine)
    s = engine.stats()
    assert s.generation_tokens == 6 and s.num_finished_requests == 2
    # s2 arrives with s1 in one step, so both compute their 20 prompt tokens (no hit yet)
    assert s.prompt_tokens == 40 and s.num_steps >= 4 and s.last_step_tokens >= 1
    assert s.kv_blocks_used == 0 and s.kv_blocks_total == 48 and s.kv_cache_usage == 0.0
    engine.add_request("s3", list(range(10, 30)), SamplingParams(temperature=0.0, max_tokens=1))
    drain(engine)
    assert engine.stats().prefix_cache_hit_tokens == 16  # 4 full blocks of the 20-token prompt


def test_stop_strings_cut_the_text(stories_dir):
    llm = LLM(stories_dir, mode="fast", max_num_seqs=4)
    plain = llm.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0]
    text = plain.outputs[0].text
    assert "Lily" in text
    stopped = llm.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=40, stop=["Lily", "zzz"]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.text == text[:text.index("Lily")]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "Lily"
    assert plain.outputs[0].token_ids[:len(stopped.token_ids)] == stopped.token_ids
    eos = llm.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=40,
                                                          stop_token_ids=[plain.outputs[0].token_ids[5]]),
                       use_tqdm=False)[0].outputs[0]
    assert eos.finish_reason == "stop" and len(eos.token_ids) == 6


def test_generate_cli(stories_dir, capsys):
    assert generate_main(["--model", str(stories_dir), "--prompt", "Once upon a time", "--max-tokens", "12",
                          "--mode", "fast", "--show-ids"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith(", there was a little girl named Lily.")
    assert "token ids: [432, 383, 286" in out.out and "finish_reason=length" in out.err
    assert generate_main(["--model", str(stories_dir), "--prompt", "", "--mode", "fast"]) == 2
    assert "prompt is empty" in capsys.readouterr().err


def test_failed_forward_aborts_its_batch_and_engine_recovers(model_dir):
    """A forward pass that raises (e.g. out of memory) must not leak blocks or hang its requests: each request
    whose share of the batch fails again on its own ends with finish_reason "abort" and the error in its
    output, and later requests still run."""
    engine = LLMEngine(model_dir, CONFIG, device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("x", [11, 12, 13], params)
    engine.add_request("y", [14, 15], params)
    real = engine.runner.execute

    def boom(batch, **kw):
        raise RuntimeError("simulated device failure")

    engine.runner.execute = boom
    engine.step()
    engine.runner.execute = real
    engine.scheduler.check_invariants()
    final = drain(engine)
    assert {k: o.outputs[0].finish_reason for k, o in final.items()} == {"x": "abort", "y": "abort"}
    assert all("simulated device failure" in o.error for o in final.values())
    assert engine.stats().kv_blocks_used == 0
    engine.add_request("z", [11, 12, 13], params)
    assert drain(engine)["z"].outputs[0].finish_reason == "length"


def test_get_tokenizer_and_vllm_prompt_dicts(stories_dir):
    llm = LLM(stories_dir, mode="deterministic", device="cpu", max_num_seqs=4, max_model_len=128)
    tok = llm.get_tokenizer()
    assert tok is llm.engine.tokenizer
    ids = tok.encode("Once upon a time")
    assert tok.decode(ids) == "Once upon a time"
    params = SamplingParams(temperature=0.0, max_tokens=6)
    plain = [o.outputs[0].token_ids for o in llm.generate(["Hi", ids], params, use_tqdm=False)]
    single = llm.generate({"prompt": "Hi"}, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in single] == plain[:1]
    mixed = llm.generate([{"prompt_token_ids": ids}, "Hi", {"prompt": "Hi"}, ids], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed] == [plain[1], plain[0], plain[0], plain[1]]
    assert mixed[0].prompt_token_ids == tuple(ids) and mixed[2].prompt == "Hi"
    for bad, error, match in [({"prompt": "Hi", "cache_salt": "x"}, ValueError, r"unsupported key\(s\) 'cache_salt'"),
                              ({}, ValueError, "needs exactly one of"),
                              ({"prompt": "Hi", "prompt_token_ids": [1]}, ValueError, "needs exactly one of"),
                              ({"prompt": 5}, TypeError, '"prompt" must be a str'),
                              ([{"prompt_token_ids": "abc"}], TypeError, '"prompt_token_ids" must be a non-empty')]:
        with pytest.raises(error, match=match):
            llm.generate(bad, params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
