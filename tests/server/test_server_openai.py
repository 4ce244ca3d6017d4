"""The real server driven by the official `openai` client: completions, chat, streaming, logprobs, seed, n,
stop, echo, usage, models, fingerprint; and bit-equality with the offline engine for the same request."""

from __future__ import annotations

import httpx
import pytest

MODEL_NAME = "tiny-llama"  # the --served-model-name the conftest servers use
PROMPT = "Once upon a time there was"
IGNORE_EOS = {"ignore_eos": True}  # the tiny random model may emit EOS at any point; fix output lengths


def _lp(choice) -> list:
    """Comparable form of a completion choice's logprobs (exact floats)."""
    lp = choice.logprobs
    return [lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset]


def test_models_health_and_fingerprint(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    a = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0)
    b = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, temperature=0)
    assert a.system_fingerprint.startswith("fp_") and a.system_fingerprint == b.system_fingerprint


def test_completion_greedy_logprobs_usage(client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                  extra_body=IGNORE_EOS)
    (c,) = r.choices
    assert r.object == "text_completion" and r.model == MODEL_NAME and r.id.startswith("cmpl-")
    assert c.finish_reason == "length" and r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == len(c.logprobs.top_logprobs) == 8
    for chosen, top in zip(c.logprobs.token_logprobs, c.logprobs.top_logprobs):
        assert chosen <= 0 and len(top) <= 3 and max(top.values()) >= chosen  # greedy: top-1 is chosen
        assert chosen == max(top.values())
    again = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                      extra_body=IGNORE_EOS)
    assert again.choices[0].text == c.text and _lp(again.choices[0]) == _lp(c)


def test_http_matches_offline_engine_bitwise(client, tiny_model_dir):
    """Text and every logprob through HTTP equal the in-process engine's for the same request."""
    from detinfer.engine.config import EngineConfig
    from detinfer.engine.drive import drive
    from detinfer.engine.llm_engine import LLMEngine
    from detinfer.engine.sampling_params import SamplingParams

    engine = LLMEngine(tiny_model_dir, EngineConfig(num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64),
                       device="cpu")
    messages = [{"role": "user", "content": "Tell me about Feynman"}]
    chat_ids = engine.tokenizer.apply_chat_template(messages, tokenize=True)
    final = {rid: out.outputs[0] for rid, out in drive(engine, [
        (0, "c", PROMPT, SamplingParams(max_tokens=10, temperature=0, logprobs=2, ignore_eos=True)),
        (0, "s", PROMPT, SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=11, logprobs=0,
                                        ignore_eos=True)),
        (0, "chat", chat_ids, SamplingParams(max_tokens=10, temperature=0, logprobs=2, ignore_eos=True))]).items()}

    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2,
                                  extra_body=IGNORE_EOS).choices[0]
    assert r.text == final["c"].text
    assert r.logprobs.token_logprobs == [e.logprob for e in final["c"].logprobs]
    s = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0.9, top_p=0.95,
                                  seed=11, logprobs=0, extra_body=IGNORE_EOS).choices[0]
    assert s.text == final["s"].text
    assert s.logprobs.token_logprobs == [e.logprob for e in final["s"].logprobs]
    ch = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0,
                                        logprobs=True, top_logprobs=2, extra_body=IGNORE_EOS).choices[0]
    assert ch.message.content == final["chat"].text and ch.message.role == "assistant"
    assert [t.logprob for t in ch.logprobs.content] == [e.logprob for e in final["chat"].logprobs]
    assert [[x.logprob for x in t.top_logprobs] for t in ch.logprobs.content] == \
        [list(e.top_logprobs.values()) for e in final["chat"].logprobs]


def test_seed_reproduces_and_differs(client):
    def sample(seed):
        return client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=1.0,
                                         seed=seed, logprobs=1, extra_body=IGNORE_EOS).choices[0]

    a, b, c = sample(1234), sample(1234), sample(99)
    assert a.text == b.text and _lp(a) == _lp(b)
    assert c.text != a.text  # fixed weights and seeds: a deterministic fact, not a flaky chance


def test_n_samples_are_distinct_and_each_reproducible(client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, n=3, max_tokens=8, temperature=1.0, seed=5,
                                  extra_body=IGNORE_EOS)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.text for c in r.choices}) == 3 and r.usage.completion_tokens == 24
    again = client.completions.create(model=MODEL_NAME, prompt=PROMPT, n=3, max_tokens=8, temperature=1.0,
                                      seed=5, extra_body=IGNORE_EOS)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]


def test_multiple_prompts_and_token_prompts(client):
    single = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=5, temperature=0,
                                        extra_body=IGNORE_EOS).choices[0].text for p in ("Hello world", PROMPT)]
    both = client.completions.create(model=MODEL_NAME, prompt=["Hello world", PROMPT], max_tokens=5,
                                     temperature=0, extra_body=IGNORE_EOS)
    assert [c.index for c in both.choices] == [0, 1] and [c.text for c in both.choices] == single
    assert both.usage.completion_tokens == 10


def test_token_id_prompt_equals_text_prompt(client, tiny_model_dir):
    from detinfer.models.loader import load_tokenizer

    ids = load_tokenizer(tiny_model_dir).encode(PROMPT)
    by_text = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0,
                                        extra_body=IGNORE_EOS)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=5, temperature=0,
                                       extra_body=IGNORE_EOS)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == len(ids)


def test_stop_string_cuts_the_text(client):
    kw = dict(model=MODEL_NAME, prompt="Hello world", max_tokens=16, temperature=0, extra_body=IGNORE_EOS)
    full = client.completions.create(**kw).choices[0].text
    # a stop string from the middle of the greedy output (the random tiny model writes mostly symbols)
    stop = next(full[i:i + 2] for i in range(2, len(full) - 1) if full[i:i + 2].isascii() and full[i:i + 2].isalnum())
    cut = client.completions.create(stop=[stop, "never-there"], **kw).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.index(stop)]


def test_echo_with_logprobs(client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                  logprobs=1, extra_body=IGNORE_EOS)
    c = r.choices[0]
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0,
                                      logprobs=1, extra_body=IGNORE_EOS).choices[0]
    assert c.text == PROMPT + plain.text
    n_prompt = r.usage.prompt_tokens
    assert len(c.logprobs.tokens) == n_prompt + 3 and c.logprobs.token_logprobs[0] is None
    assert all(x is not None for x in c.logprobs.token_logprobs[1:])
    assert c.logprobs.token_logprobs[n_prompt:] == plain.logprobs.token_logprobs


def test_streaming_echo_equals_non_streaming(client):
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=1,
              extra_body=IGNORE_EOS)
    full = client.completions.create(**kw).choices[0]
    chunks = [ch.choices[0] for ch in client.completions.create(stream=True, **kw) if ch.choices]
    assert "".join(c.text for c in chunks) == full.text and full.text.startswith(PROMPT)
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in chunks if c.logprobs for x in getattr(c.logprobs, field)] == \
            getattr(full.logprobs, field), field


def test_streaming_completion_equals_non_streaming(client):
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0.8, seed=3, logprobs=2,
              extra_body=IGNORE_EOS)
    resp = client.completions.create(**kw)
    full = resp.choices[0]
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    lps = [x for ch in chunks if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.token_logprobs]
    assert text == full.text and lps == full.logprobs.token_logprobs
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert {ch.system_fingerprint for ch in chunks} == {resp.system_fingerprint}


def test_streaming_chat_equals_non_streaming(client):
    kw = dict(model=MODEL_NAME, messages=[{"role": "system", "content": "Be terse."},
                                          {"role": "user", "content": "Hello world"}],
              max_tokens=10, temperature=0, logprobs=True, top_logprobs=2, extra_body=IGNORE_EOS)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    lps = [t.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert text == full.choices[0].message.content
    assert lps == [t.logprob for t in full.choices[0].logprobs.content]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason] == ["length"]
    assert {ch.system_fingerprint for ch in chunks} == {full.system_fingerprint}
    assert full.usage.completion_tokens == 10


def test_chat_without_max_tokens_runs_to_eos_or_context(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                       temperature=0)
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length")
    if c.finish_reason == "length":  # only the context limit can stop it then
        assert r.usage.total_tokens == 256


def test_engine_flags_reach_the_engine(server):
    # the conftest server passes --num-kv-blocks 384 (a generated EngineConfig flag)
    assert server.metrics()["detinfer_kv_cache_blocks_total"] == 384
    assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"] == 256


@pytest.mark.parametrize("stream", [False, True])
def test_n_with_chat(client, stream):
    kw = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Tell me"}], n=2, max_tokens=6,
              temperature=1.0, seed=8, extra_body=IGNORE_EOS)
    if not stream:
        r = client.chat.completions.create(**kw)
        assert [c.index for c in r.choices] == [0, 1]
        return
    texts = {0: "", 1: ""}
    for ch in client.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    ref = client.chat.completions.create(**kw)
    assert [texts[0], texts[1]] == [c.message.content for c in ref.choices]
