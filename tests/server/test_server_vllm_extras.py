"""vLLM's request extras on the real server: prompt_logprobs (shape, agreement with echo logprobs, the same
bits alone and among concurrent requests), logit_bias (OpenAI's, keys are token-id strings),
allowed_token_ids, min_tokens, include_stop_str_in_output, skip_special_tokens, bad_words."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

MODEL = "tiny-llama"
PROMPT = "Once upon a time there was"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120.0) as c:
        yield c


def complete(http, **kw) -> dict:
    r = http.post(COMPLETIONS, json={"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                     "ignore_eos": True, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_prompt_logprobs_shape_and_echo_agreement(http):
    r = complete(http, prompt_logprobs=2)
    plp = r["choices"][0]["prompt_logprobs"]
    assert len(plp) == r["usage"]["prompt_tokens"] and plp[0] is None
    for row in plp[1:]:
        assert 1 <= len(row) <= 3
        own = next(iter(row.values()))  # the prompt's own token comes first
        assert own["rank"] >= 1 and own["logprob"] <= 0 and isinstance(own["decoded_token"], str)
    echo = complete(http, echo=True, logprobs=2)["choices"][0]["logprobs"]["token_logprobs"]
    assert [next(iter(row.values()))["logprob"] for row in plp[1:]] == echo[1:len(plp)]
    # with echo, prompt_logprobs must agree with logprobs; equal is fine
    assert complete(http, echo=True, logprobs=2, prompt_logprobs=2)["choices"][0]["prompt_logprobs"] == plp


def test_prompt_logprobs_same_bits_alone_and_among_concurrent_requests(http):
    alone = complete(http, prompt_logprobs=3)["choices"][0]["prompt_logprobs"]

    def other(i):
        return complete(http, prompt=f"{i} unrelated words " * (i + 1), max_tokens=8)

    with ThreadPoolExecutor(6) as pool:
        others = [pool.submit(other, i) for i in range(5)]
        mine = pool.submit(complete, http, prompt_logprobs=3)
        [f.result() for f in others]
    assert mine.result()["choices"][0]["prompt_logprobs"] == alone


def test_chat_prompt_logprobs_at_response_level(http):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0,
            "prompt_logprobs": 1}
    r = http.post(CHAT, json=body).json()
    assert r["prompt_logprobs"][0] is None and len(r["prompt_logprobs"]) == r["usage"]["prompt_tokens"]
    with http.stream("POST", CHAT, json={**body, "stream": True}) as s:
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: {")]
    first = json.loads(lines[0][6:])
    assert first["prompt_logprobs"] == r["prompt_logprobs"]


def test_logit_bias_and_allowed_token_ids_force_tokens(http):
    forced = complete(http, logit_bias={"42": 100})
    only = complete(http, allowed_token_ids=[42])
    assert forced["choices"][0]["text"] == only["choices"][0]["text"]
    assert forced["choices"][0]["text"] != complete(http)["choices"][0]["text"]
    lp = complete(http, allowed_token_ids=[42], logprobs=1)["choices"][0]["logprobs"]
    assert len(set(lp["tokens"])) == 1  # every token the same one


def test_min_tokens_holds_back_a_stop_token(http):
    stopped = complete(http, max_tokens=8, allowed_token_ids=[7, 8], logit_bias={"7": 100}, stop_token_ids=[7],
                       ignore_eos=False)
    assert stopped["usage"]["completion_tokens"] == 1 and stopped["choices"][0]["finish_reason"] == "stop"
    held = complete(http, max_tokens=8, allowed_token_ids=[7, 8], logit_bias={"7": 100}, stop_token_ids=[7],
                    min_tokens=4, ignore_eos=False)
    assert held["usage"]["completion_tokens"] == 5 and held["choices"][0]["finish_reason"] == "stop"


def test_include_stop_str_and_skip_special_tokens(http):
    full = complete(http, max_tokens=16)["choices"][0]["text"]
    stop = next(full[i:i + 2] for i in range(2, len(full) - 1) if full[i:i + 2].strip() and full[i:i + 2].isprintable())
    cut = complete(http, max_tokens=16, stop=[stop])["choices"][0]
    kept = complete(http, max_tokens=16, stop=[stop], include_stop_str_in_output=True)["choices"][0]
    assert kept["text"] == cut["text"] + stop and kept["finish_reason"] == "stop"
    # token 1 is a special token (<|im_start|>) of the tiny tokenizer
    shown = complete(http, skip_special_tokens=False, allowed_token_ids=[1])["choices"][0]["text"]
    hidden = complete(http, allowed_token_ids=[1])["choices"][0]["text"]
    assert hidden == "" and shown != ""


def test_bad_words_are_accepted_and_change_nothing_when_absent(http):
    plain = complete(http)["choices"][0]["text"]
    assert complete(http, bad_words=["zzzzzzzz-not-a-word"])["choices"][0]["text"] == plain
