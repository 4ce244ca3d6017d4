"""Server pieces without a server: the request -> SamplingParams mapping, the door guards (Content-Type,
Host, API key), the prompt-size bound and off-loop tokenizing, and text offsets."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from starlette.requests import Request

from detinfer.engine.sampling_params import SamplingParams
from detinfer.server import protocol as P
from detinfer.server.config import ServerConfig
from detinfer.server.logprobs import TextOffsets, TokenFormatter
from detinfer.server.prompts import PromptChecker
from detinfer.server.request_io import HostCheck, check_auth, host_name, is_json_content_type
from detinfer.server.sampling import RequestLimits, chat_logprobs_count, sampling_params

LIMITS = RequestLimits(max_n=4, max_logprobs=5, max_temperature=2.0)


def _completion(**kw):
    return P.parse_request(P.CompletionRequest, {"model": "m", "prompt": "hi", **kw})


def _params(**kw) -> SamplingParams:
    req = _completion(**kw)
    return sampling_params(req, LIMITS, max_tokens=req.max_tokens, logprobs=req.logprobs)


def _error(fn, *args, **kw) -> P.APIError:
    with pytest.raises(P.APIError) as info:
        fn(*args, **kw)
    assert info.value.status == 400
    return info.value


# -- request -> SamplingParams ----------------------------------------------------------------------------
def test_mapping_defaults_and_nulls():
    p = _params(temperature=None, top_p=None, n=None, stop=None)
    assert p == SamplingParams(n=1, max_tokens=16, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=None)


def test_mapping_copies_every_field():
    p = _params(n=2, temperature=0.5, top_p=0.9, top_k=7, min_p=0.1, presence_penalty=0.5, frequency_penalty=-0.5,
                repetition_penalty=1.1, seed=9, stop="x", stop_token_ids=[3], ignore_eos=True, max_tokens=5,
                logprobs=2)
    assert p == SamplingParams(n=2, temperature=0.5, top_p=0.9, top_k=7, min_p=0.1, presence_penalty=0.5,
                               frequency_penalty=-0.5, repetition_penalty=1.1, seed=9, stop=("x",),
                               stop_token_ids=(3,), ignore_eos=True, max_tokens=5, logprobs=2)


def test_mapping_copies_the_vllm_extras():
    p = _params(min_tokens=2, skip_special_tokens=False, include_stop_str_in_output=True,
                logit_bias={"7": -100, "3": 2.5}, allowed_token_ids=[3, 7, 9], bad_words=["foo bar"],
                prompt_logprobs=1)
    assert p == SamplingParams(min_tokens=2, skip_special_tokens=False, include_stop_str_in_output=True,
                               logit_bias={3: 2.5, 7: -100.0}, allowed_token_ids=(3, 7, 9), bad_words=("foo bar",),
                               prompt_logprobs=1)


def test_mapping_checks_token_ids_against_the_vocabulary():
    req = _completion(logit_bias={"5": 1}, allowed_token_ids=[4])
    assert sampling_params(req, LIMITS, max_tokens=2, logprobs=None, vocab_size=6).logit_bias == ((5, 1.0),)
    for kw, param in [({"logit_bias": {"6": 1}}, "logit_bias"), ({"allowed_token_ids": [1, 6]}, "allowed_token_ids")]:
        err = _error(sampling_params, _completion(**kw), LIMITS, max_tokens=2, logprobs=None, vocab_size=6)
        assert err.param == param and "outside the vocabulary [0, 6)" in err.message


@pytest.mark.parametrize("kw,param", [
    ({"min_tokens": 17}, "min_tokens"),  # more than max_tokens (16)
    ({"prompt_logprobs": 6}, "prompt_logprobs"),  # above max_logprobs
    ({"n": 5}, "n"),  # above max_n
    ({"temperature": 2.5}, "temperature"),  # above max_temperature (OpenAI's 2)
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),  # zero as float32: would divide by it
    ({"repetition_penalty": 1e300}, "repetition_penalty"),
])
def test_mapping_bounds_name_the_field(kw, param):
    assert _error(_params, **kw).param == param


def test_tiny_temperatures_map_to_greedy_and_the_cap_is_a_flag():
    assert _params(temperature=1e-39).is_greedy
    req = _completion(temperature=3.0)
    assert sampling_params(req, RequestLimits(max_temperature=5.0), max_tokens=1, logprobs=None).temperature == 3.0


def test_values_beyond_int64_are_refused_by_the_schema():
    for field in ("top_k", "n", "max_tokens", "logprobs", "best_of"):
        with pytest.raises(P.APIError) as info:
            _completion(**{field: 1 << 63})
        assert info.value.param == field
    with pytest.raises(P.APIError):
        _completion(stop_token_ids=[1 << 63])
    assert _completion(top_k=(1 << 63) - 1).top_k == (1 << 63) - 1


def test_chat_logprobs_count():
    chat = lambda **kw: P.parse_request(P.ChatCompletionRequest,  # noqa: E731
                                        {"model": "m", "messages": [{"role": "user", "content": "x"}], **kw})
    assert chat_logprobs_count(chat(), LIMITS) is None
    assert chat_logprobs_count(chat(logprobs=True), LIMITS) == 0
    assert chat_logprobs_count(chat(logprobs=True, top_logprobs=3), LIMITS) == 3
    assert _error(chat_logprobs_count, chat(top_logprobs=3), LIMITS).param == "top_logprobs"
    assert _error(chat_logprobs_count, chat(logprobs=True, top_logprobs=6), LIMITS).param == "top_logprobs"


# -- guards -----------------------------------------------------------------------------------------------
def _request(headers: dict[str, str]) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": raw})


@pytest.mark.parametrize("value,ok", [
    ("application/json", True), ("application/json; charset=utf-8", True), ("Application/JSON", True),
    ("application/vnd.api+json", True), (None, False), ("text/plain", False), ("", False),
    ("application/x-www-form-urlencoded", False), ("multipart/form-data; boundary=x", False),
    ("text/plain; a=application/json", False),
])
def test_json_content_type(value, ok):
    assert is_json_content_type(value) is ok


def test_api_key_scheme_is_case_insensitive_and_key_exact():
    check_auth(_request({}), None)
    for header in ("Bearer sesame", "bearer sesame", "BEARER  sesame", "Bearer sesame "):
        check_auth(_request({"Authorization": header}), "sesame")
    for header in ({}, {"Authorization": "Bearer sesam"}, {"Authorization": "Bearer sesame2"},
                   {"Authorization": "Basic sesame"}, {"Authorization": "sesame"}, {"Authorization": "Bearer"}):
        with pytest.raises(P.APIError) as info:
            check_auth(_request(header), "sesame")
        assert info.value.status == 401


def test_api_key_compare_is_constant_time(monkeypatch):
    import hmac

    import detinfer.server.request_io as request_io

    calls, real = [], hmac.compare_digest
    monkeypatch.setattr(request_io.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    check_auth(_request({"Authorization": "Bearer k"}), "k")
    assert calls == [(b"k", b"k")]


@pytest.mark.parametrize("header,name", [("localhost:8000", "localhost"), ("127.0.0.1", "127.0.0.1"),
                                         ("[::1]:80", "::1"), ("Example.COM.:9", "example.com"), ("[::1]", "::1")])
def test_host_name(header, name):
    assert host_name(header) == name


def test_host_allowlist():
    assert ServerConfig().host_allowlist() == {"localhost", "127.0.0.1", "::1"}
    assert "10.0.0.5" in ServerConfig(host="10.0.0.5").host_allowlist()
    assert ServerConfig(host="0.0.0.0", allowed_hosts="a.example, B.example").host_allowlist() == {
        "localhost", "127.0.0.1", "::1", "a.example", "b.example"}
    assert ServerConfig(allowed_hosts="*").host_allowlist() is None
    assert ServerConfig(api_key="k").host_allowlist() is None  # a key protects it instead


def _asgi_status(allowed, host: str | None) -> int:
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    sent = []

    async def send(message):
        sent.append(message)

    headers = [] if host is None else [(b"host", host.encode())]
    asyncio.run(HostCheck(app, allowed)({"type": "http", "headers": headers}, None, send))
    return sent[0]["status"]


def test_host_check_refuses_foreign_hosts():
    allowed = ServerConfig().host_allowlist()
    assert _asgi_status(allowed, "localhost:8000") == 200
    assert _asgi_status(allowed, "[::1]:8000") == 200
    assert _asgi_status(allowed, "attacker.example:8000") == 403  # DNS rebinding: the page's own name
    assert _asgi_status(allowed, None) == 200  # not a browser
    assert _asgi_status(None, "attacker.example") == 200


# -- prompts ----------------------------------------------------------------------------------------------
class _RecordingTokenizer:
    def __init__(self):
        self.threads: list[int] = []

    def encode(self, text):
        self.threads.append(threading.get_ident())
        return [1] * len(text.split())


def test_prompt_size_bound_refuses_before_tokenizing_and_tokenizes_off_the_loop():
    tok = _RecordingTokenizer()
    with ThreadPoolExecutor(1) as pool:
        checker = PromptChecker(tok, vocab_size=100, max_model_len=64, longest_token_bytes=8, executor=pool)
        assert checker.max_prompt_bytes == 64 * 8 * 2

        async def main():
            ids = await checker.encode(["a b c"], "prompt")
            assert ids == [[1, 1, 1]] and tok.threads and tok.threads[0] != threading.get_ident()
            with pytest.raises(P.APIError) as info:
                await checker.encode(["x" * (64 * 8 * 2 + 1)], "prompt")
            assert info.value.code == "context_length_exceeded" and "bytes" in info.value.message
            assert len(tok.threads) == 1  # the oversized prompt never reached the tokenizer
            await checker.encode(["é" * (64 * 8)], "prompt")  # 2 bytes per char: exactly at the bound

        asyncio.run(main())


def test_longest_token_bounds_every_text(tiny_model_dir):
    from detinfer.models.loader import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    fmt = TokenFormatter(tok)
    longest = fmt.longest_token_bytes(tok.vocab_size)
    for text in ["Hello world, " * 20, "東京 🙂 naïve " * 10, "    \n\t" * 30]:
        ids = tok.encode(text, add_special_tokens=False)
        assert len(text.encode()) <= len(ids) * longest


# -- text offsets -----------------------------------------------------------------------------------------
def test_text_offsets_follow_the_detokenized_text(tiny_model_dir):
    """Each token's offset is where its text starts in the returned text, also when a character is split
    over byte tokens and when special tokens are stripped from the text."""
    from detinfer.models.loader import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    fmt = TokenFormatter(tok)
    special = tok.all_special_ids[0]
    ids = tok.encode("Hi 東京 🙂 café", add_special_tokens=False)
    split = [i for i in ids if fmt.token(i)[0].startswith("bytes:")]
    assert split, "the test needs a character split over byte tokens"
    ids = ids[:3] + [special] + ids[3:]
    text = tok.decode(ids)  # special tokens stripped, as the engine's output text
    offsets = TextOffsets(tok)
    got = [offsets.next(t) for t in ids]
    assert got == sorted(got) and got[-1] < len(text)
    for k, t in enumerate(ids):
        piece, _ = fmt.token(t)
        if t != special and not piece.startswith("bytes:"):
            assert text[got[k]:got[k] + len(piece)] == piece, (k, piece, got[k])
    # a continuation byte token starts where its character does
    for k in range(1, len(ids)):
        if fmt.token(ids[k])[0].startswith("bytes:") and fmt.token(ids[k - 1])[0].startswith("bytes:"):
            assert got[k] in (got[k - 1], got[k - 1] + 1)
    with_start = TextOffsets(tok, start=10, context_ids=ids[:2])
    assert with_start.next(ids[2]) == 10


# -- uvicorn ----------------------------------------------------------------------------------------------
def test_uvicorn_uses_the_fast_parser_with_timeouts_and_a_connection_limit():
    from detinfer.server.serve import uvicorn_config

    async def app(scope, receive, send):  # pragma: no cover - never called
        pass

    cfg = uvicorn_config(app, ServerConfig(timeout_keep_alive=3.0, limit_concurrency=77))
    cfg.load()
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    assert issubclass(cfg.http_protocol_class, HttpToolsProtocol)  # with our header limits (http_guard)
    assert cfg.timeout_keep_alive == 3.0 and cfg.limit_concurrency == 77


def test_extras_bring_uvicorn_standard():
    from pathlib import Path

    import tomllib

    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for extra in ("server", "test"):
        assert any(d.startswith("uvicorn[standard]") for d in extras[extra]), extra
