"""Fuzzing the running server with generated requests (Hypothesis over the request schemas, mixing valid
values, edge values and wrong types) plus hand-picked hostile cases. For every one of them: never a 5xx,
never a hung request (each has a timeout), a stream always ends with [DONE]; meanwhile /health stays fast,
and a reference request, repeated before, during and after, returns bit-identical text and logprobs.

Bounded in time: a fixed number of examples (derandomized, so CI runs the same ones), small outputs.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MODEL = "tiny-llama"
REQUEST_TIMEOUT_S = 60.0  # a request slower than this counts as hung
HEALTH_LIMIT_S = 2.0
REFERENCE = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.7, "seed": 3,
             "logprobs": 2, "ignore_eos": True}

BIG_INTS = [1 << 31, (1 << 63) - 1, 1 << 63, 1 << 64, 10 ** 30, -(1 << 63) - 1]
ODD_FLOATS = [0.0, -0.0, 5e-324, 1e-320, 1e-39, 1e-6, 1.5, 2.0, 2.0000001, 1e38, 1e39, 1e308, -1e308]
WRONG_TYPES = st.sampled_from([None, True, "1", "", [], {}, [1], {"a": 1}, "ünï", "\u0000"])


HOSTILE = st.one_of(st.sampled_from(BIG_INTS), st.sampled_from(ODD_FLOATS), WRONG_TYPES, st.integers(-5, 40))

# Valid values of each field (small outputs keep the run short); any field may instead get a hostile value.
SAMPLING = {
    "n": st.sampled_from([1, 2, 3]),
    "max_tokens": st.sampled_from([1, 2, 4, 8]),
    "temperature": st.one_of(st.floats(0, 2, allow_nan=False), st.sampled_from([0.0, 1e-39, 5e-324])),
    "top_p": st.floats(0, 1, allow_nan=False, exclude_min=True),
    "top_k": st.sampled_from([-1, 0, 1, 5, 1000, (1 << 63) - 1]),
    "min_p": st.floats(0, 1, allow_nan=False),
    "presence_penalty": st.floats(-2, 2, allow_nan=False),
    "frequency_penalty": st.floats(-2, 2, allow_nan=False),
    "repetition_penalty": st.floats(0.1, 3, allow_nan=False),
    "seed": st.integers(0, (1 << 63) - 1),
    "stop": st.one_of(st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=3), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 600), max_size=3),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "user": st.text(max_size=8),
    "min_tokens": st.sampled_from([0, 1, 4]),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "logit_bias": st.dictionaries(st.integers(0, 300).map(str), st.floats(-100, 100), max_size=3),
    "allowed_token_ids": st.lists(st.integers(0, 300), min_size=1, max_size=5),
    "bad_words": st.lists(st.text(min_size=1, max_size=4), max_size=2),
    "prompt_logprobs": st.sampled_from([0, 1, 3]),
}
COMPLETION_ONLY = {
    "logprobs": st.sampled_from([0, 1, 5, 20]),
    "echo": st.booleans(),
}
CHAT_ONLY = {
    "logprobs": st.booleans(),
    "max_completion_tokens": st.sampled_from([1, 4]),
    "add_generation_prompt": st.booleans(),
    "response_format": st.just({"type": "text"}),
}
TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=40)
TOKENS = st.lists(st.integers(0, 300), min_size=1, max_size=12)
PROMPT = st.one_of(TEXT, TOKENS, st.lists(TEXT, min_size=1, max_size=3), st.lists(TOKENS, min_size=1, max_size=3))
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": TEXT})
MESSAGES = st.lists(MESSAGE, min_size=1, max_size=3)
# Hostile values for the fields that need more than numbers to break.
HOSTILE_BY_FIELD = {
    "prompt": st.one_of(st.lists(st.sampled_from([-1, 511, 512, 1 << 63, 1 << 70]), min_size=1, max_size=3),
                        st.just("word " * 300), st.just([]), st.just([[]])),
    "messages": st.one_of(st.just([]), st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["tool", "robot", 3, "assistant"])},
        optional={"content": st.one_of(TEXT, WRONG_TYPES), "name": TEXT}), max_size=3)),
    "model": st.one_of(WRONG_TYPES, st.just("gpt-4")),
    "logit_bias": st.dictionaries(st.text(max_size=3), st.floats(-5, 5), min_size=1, max_size=2),
    "top_logprobs": st.sampled_from([0, 2, 20, 21]),
    "best_of": st.sampled_from([1, 2]),
    "suffix": st.text(max_size=3),
    "tools": st.just([{"type": "function", "function": {"name": "f"}}]),
}


@st.composite
def request_bodies(draw, path: str, fields: dict, prompt_key: str, prompt):
    # an explicit small max_tokens: chat's default runs to the end of the context, too slow for many examples
    body = {"model": MODEL, prompt_key: draw(prompt), "max_tokens": draw(SAMPLING["max_tokens"])}
    for key in draw(st.sets(st.sampled_from(sorted(fields)), max_size=6)):
        body[key] = draw(fields[key])
    for key in draw(st.sets(st.sampled_from(sorted({*fields, *HOSTILE_BY_FIELD, prompt_key})), max_size=2)):
        body[key] = draw(HOSTILE_BY_FIELD.get(key, HOSTILE) if draw(st.booleans()) else HOSTILE)
    if body.get("stream") is not True:
        body.pop("stream_options", None)  # valid only with stream (a 400 either way, but keep 200s common)
    return path, body


REQUESTS = st.one_of(
    request_bodies("/v1/completions", {**SAMPLING, **COMPLETION_ONLY}, "prompt", PROMPT),
    request_bodies("/v1/chat/completions", {**SAMPLING, **CHAT_ONLY}, "messages", MESSAGES),
)
CONTENT_TYPES = st.sampled_from(["application/json"] * 8 + ["text/plain", None, "application/json; charset=utf-8"])


STATUSES: Counter = Counter()  # of the generated requests: the fuzzing must reach the engine, not only 400s


def _send(http: httpx.Client, path: str, body: bytes, content_type: str | None) -> int:
    """Send one request; fail on a 5xx, a hang, or a stream that does not end cleanly."""
    headers = {"content-type": content_type} if content_type else {}
    with http.stream("POST", path, content=body, headers=headers, timeout=REQUEST_TIMEOUT_S) as r:
        raw = r.read()
    assert r.status_code < 500, (path, body[:300], r.status_code, raw[:500])
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", raw[-300:]
        for e in events[:-1]:
            assert '"server_error"' not in e, e
    return r.status_code


class Watcher:
    """Background thread: /health latency and the reference request, over and over, while fuzzing runs."""

    def __init__(self, url: str):
        self.url, self.stop, self.health, self.refs, self.errors = url, threading.Event(), [], [], []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT_S) as c:
            while not self.stop.is_set():
                try:
                    t0 = time.monotonic()
                    assert c.get("/health").status_code == 200
                    self.health.append(time.monotonic() - t0)
                    self.refs.append(reference(c))
                except Exception as e:  # reported by the test
                    self.errors.append(repr(e))
                self.stop.wait(0.1)


def reference(c: httpx.Client):
    r = c.post("/v1/completions", json=REFERENCE)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], json.dumps(choice["logprobs"], sort_keys=True)


@pytest.fixture(scope="module")
def fuzz_env(server):
    with httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as http:
        before = reference(http)
        watcher = Watcher(server.url)
        watcher.thread.start()
        yield http, watcher
        watcher.stop.set()
        watcher.thread.join(REQUEST_TIMEOUT_S)
        assert not watcher.errors, watcher.errors[:3]
        assert watcher.refs and all(ref == before for ref in watcher.refs)  # during
        assert max(watcher.health) < HEALTH_LIMIT_S, max(watcher.health)
        assert reference(http) == before  # after
        if STATUSES:  # the generated requests ran: some were served (not only refused), some refused
            assert STATUSES[200] >= 3 and STATUSES[400] >= 10, STATUSES
        m = server.wait_idle()
        assert m["detinfer_engine_alive"] == 1 and m["detinfer_kv_cache_blocks_used"] == 0


HAND_PICKED = [
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": 1 << 63, "temperature": 1}, "application/json"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": (1 << 63) - 1, "temperature": 1, "max_tokens": 2},
     "application/json"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 1e-39, "logprobs": 1}, "application/json"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 5e-324, "top_p": 0.5}, "application/json"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a"] * 9, "max_tokens": 1}, "application/json"),
    ("/v1/completions", {"model": MODEL, "prompt": "é" * (2 << 20)}, "application/json"),
    ("/v1/completions", {"model": MODEL, "prompt": "x"}, "text/plain"),
    ("/v1/completions", {"model": MODEL, "prompt": "x"}, None),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "repetition_penalty": 1e-300, "temperature": 1},
     "application/json"),
    ("/v1/completions", {"model": MODEL, "prompt": [0, 1, 2], "echo": True, "logprobs": 20, "max_tokens": 2},
     "application/json"),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi 東京 🙂", "echo": True, "logprobs": 1, "stream": True,
                         "max_tokens": 3}, "application/json"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x" * (3 << 20)}]},
     "application/json"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 3,
                              "stream": True, "logprobs": True, "top_logprobs": 20, "max_tokens": 3},
     "application/json"),
]


@pytest.mark.parametrize("path,body,content_type", HAND_PICKED, ids=[str(i) for i in range(len(HAND_PICKED))])
def test_hand_picked_hostile_requests(fuzz_env, path, body, content_type):
    http, _ = fuzz_env
    _send(http, path, json.dumps(body).encode(), content_type)


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(request=REQUESTS, content_type=CONTENT_TYPES,
       raw=st.one_of(st.none(), st.none(), st.none(), st.binary(max_size=40)))
def test_generated_requests_never_get_5xx(fuzz_env, request, content_type, raw):
    http, _ = fuzz_env
    path, body = request
    data = raw if raw is not None else json.dumps(body).encode()
    STATUSES[_send(http, path, data, content_type)] += 1

