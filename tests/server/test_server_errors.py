"""Malformed and out-of-range requests over raw HTTP: each gets a 4xx with an OpenAI-style error body that
names the field, and the server keeps serving afterwards."""

from __future__ import annotations

import json

import httpx
import pytest

MODEL = "tiny-llama"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


def _ok(**kw) -> dict:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **kw}


def _chat(**kw) -> dict:
    return {"model": MODEL, "messages": MSG, "max_tokens": 2, **kw}


# (path, raw body bytes or JSON-able object, expected status, expected `param` (None: not checked))
CASES = [
    (COMPLETIONS, b"{not json", 400, None),
    (COMPLETIONS, b"", 400, None),
    (COMPLETIONS, b"[1, 2]", 400, None),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "\xff\xfe"}', 400, None),  # invalid UTF-8
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "a\\ud800b"}', 400, "prompt"),  # lone surrogate
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "a", "temperature": NaN}', 400, None),
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": "a", "top_p": Infinity}', 400, None),
    (COMPLETIONS, b"[" * 100_000 + b"]" * 100_000, 400, None),  # nesting deeper than any parser stack
    (COMPLETIONS, {"prompt": "x"}, 400, "model"),
    (COMPLETIONS, _ok(model="gpt-4"), 404, "model"),
    (COMPLETIONS, _ok(model=3), 400, "model"),
    (COMPLETIONS, _ok(prompt=""), 400, "prompt"),
    (COMPLETIONS, _ok(prompt=[]), 400, "prompt"),
    (COMPLETIONS, _ok(prompt=None), 400, "prompt"),
    (COMPLETIONS, _ok(prompt=[1, 10**9]), 400, "prompt"),  # token id outside the vocabulary
    (COMPLETIONS, _ok(prompt=[-1]), 400, "prompt"),
    (COMPLETIONS, _ok(prompt="word " * 300), 400, "prompt"),  # longer than the 256-token context
    (COMPLETIONS, _ok(max_tokens=250, prompt="word " * 20), 400, "max_tokens"),  # prompt + max_tokens > ctx
    (COMPLETIONS, _ok(max_tokens=-5), 400, "max_tokens"),
    (COMPLETIONS, _ok(max_tokens="5"), 400, "max_tokens"),
    (COMPLETIONS, _ok(max_tokens=2.5), 400, "max_tokens"),
    (COMPLETIONS, _ok(temperature=-1), 400, "temperature"),
    (COMPLETIONS, _ok(temperature=[1]), 400, "temperature"),
    (COMPLETIONS, _ok(top_p=0), 400, "top_p"),
    (COMPLETIONS, _ok(top_p=1.01), 400, "top_p"),
    (COMPLETIONS, _ok(top_k=-3), 400, "top_k"),
    (COMPLETIONS, _ok(n=0), 400, "n"),
    (COMPLETIONS, _ok(n=1000), 400, "n"),  # above --max-n
    (COMPLETIONS, _ok(n=2, best_of=3), 400, "best_of"),
    (COMPLETIONS, _ok(logprobs=1000), 400, "logprobs"),  # above --max-logprobs
    (COMPLETIONS, _ok(seed="abc"), 400, "seed"),
    (COMPLETIONS, _ok(seed=2**64), 400, "seed"),
    (COMPLETIONS, _ok(stop=[1, 2]), 400, "stop"),
    (COMPLETIONS, _ok(stream=1), 400, "stream"),
    (COMPLETIONS, _ok(logit_bias={"one": 5}), 400, "logit_bias"),  # keys are token ids
    (COMPLETIONS, _ok(logit_bias={"1": 101}), 400, "logit_bias"),  # OpenAI's range is [-100, 100]
    (COMPLETIONS, _ok(logit_bias={"100000": 1}), 400, "logit_bias"),  # outside the vocabulary
    (COMPLETIONS, _ok(allowed_token_ids=[1, 100000]), 400, "allowed_token_ids"),
    (COMPLETIONS, _ok(allowed_token_ids=[]), 400, "allowed_token_ids"),
    (COMPLETIONS, _ok(min_tokens=5), 400, "min_tokens"),  # more than max_tokens
    (COMPLETIONS, _ok(bad_words=[""]), 400, "bad_words"),
    (COMPLETIONS, _ok(prompt_logprobs=1000), 400, "prompt_logprobs"),  # above --max-logprobs
    (COMPLETIONS, _ok(echo=True, logprobs=1, prompt_logprobs=2), 400, "prompt_logprobs"),
    (COMPLETIONS, _ok(suffix="s"), 400, "suffix"),
    (COMPLETIONS, _ok(stream_options={"include_usage": True, "knob": 1}), 400, "stream_options.knob"),
    (CHAT, {"model": MODEL}, 400, "messages"),
    (CHAT, _chat(messages=[]), 400, "messages"),
    (CHAT, _chat(messages=[{"role": "user"}, {"content": "x"}]), 400, "messages[1].role"),
    (CHAT, _chat(messages=[{"role": "user", "content": {"text": "x"}}]), 400, "messages[0].content"),
    (CHAT, _chat(messages=[{"role": "tool", "content": "x"}]), 400, "messages"),  # the template refuses it
    (CHAT, _chat(messages=[{"role": "user", "content": "word " * 300}]), 400, "messages"),
    (CHAT, _chat(top_logprobs=2), 400, "top_logprobs"),  # without logprobs: true
    (CHAT, _chat(logprobs=True, top_logprobs=1000), 400, "top_logprobs"),
    (CHAT, _chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    (CHAT, _chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    (CHAT, _chat(functions=[{"name": "f"}]), 400, "functions"),
    (CHAT, _chat(audio={"voice": "alloy", "format": "wav"}), 400, "audio"),
    (CHAT, _chat(modalities=["text", "audio"]), 400, "modalities[1]"),
    (CHAT, _chat(model="nope"), 404, "model"),
]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60.0) as c:
        yield c


@pytest.mark.parametrize("path,body,status,param", CASES, ids=[f"{i}" for i in range(len(CASES))])
def test_bad_request_gets_openai_error(http, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err


def test_unknown_route_and_method_are_openai_errors(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = http.get(COMPLETIONS)
    assert r.status_code == 405 and "error" in r.json()
    r = http.get("/v1/models/other-model")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_oversized_body_is_413(http):
    r = http.post(COMPLETIONS, content=b'{"model": "x", "prompt": "' + b"a" * (5 << 20) + b'"}',
                  headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["message"]


def test_server_keeps_serving_after_bad_requests(http, server):
    for path, body, _, _ in CASES[:10]:
        http.post(path, content=body if isinstance(body, bytes) else json.dumps(body).encode(),
                  headers={"content-type": "application/json"})
    r = http.post(COMPLETIONS, json=_ok(temperature=0))
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert http.get("/health").status_code == 200
    m = server.wait_idle()
    assert m['detinfer_http_requests_total{path="/v1/completions",status="400"}'] >= 10
    assert m["detinfer_kv_cache_blocks_used"] == 0 and m["detinfer_engine_alive"] == 1


def test_unknown_fields_are_ignored_and_named_in_a_header(http):
    r = http.post(COMPLETIONS, json=_ok(temperature=0, unknown_knob=True, use_beam_search=False))
    assert r.status_code == 200, r.text
    assert r.headers["X-Detinfer-Ignored-Fields"] == "unknown_knob, use_beam_search"
    plain = http.post(COMPLETIONS, json=_ok(temperature=0))
    assert "X-Detinfer-Ignored-Fields" not in plain.headers
    assert plain.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]
    with http.stream("POST", CHAT, json=_chat(stream=True, knob="\u00e9")) as s:
        assert s.status_code == 200 and s.headers["X-Detinfer-Ignored-Fields"] == "knob"
        s.read()
