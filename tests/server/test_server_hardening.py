"""A bad request fails only itself, over real HTTP: Content-Type and Host guards, values the engine cannot
hold, temperature bounds, early refusal of huge prompts (the event loop stays free), text offsets, all of a
request's prompts admitted together, slow request bodies; and `detinfer serve` start-up: a busy port is a
one-line error, readiness is reported only once the socket answers, `~` and --model are accepted."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

MODEL = "tiny-llama"
JSON = {"content-type": "application/json"}


def _ok(**kw) -> dict:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 3, **kw}


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60.0) as c:
        yield c


def test_non_json_content_type_is_415(http):
    body = b'{"model": "tiny-llama", "prompt": "Hello", "max_tokens": 1}'
    for headers in ({"content-type": "text/plain"}, {}, {"content-type": "application/x-www-form-urlencoded"}):
        r = http.post("/v1/completions", content=body, headers=headers)
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", headers
    assert http.post("/v1/completions", content=body, headers={"content-type": "application/json; charset=utf-8"}
                     ).status_code == 200


def test_foreign_host_header_is_refused_without_api_key(http, server):
    port = server.url.rsplit(":", 1)[1]
    r = http.post("/v1/completions", json=_ok(), headers={"host": f"attacker.example:{port}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    assert http.get("/health", headers={"host": "rebind.example"}).status_code == 403
    assert http.post("/v1/completions", json=_ok(), headers={"host": f"localhost:{port}"}).status_code == 200


def test_values_the_engine_cannot_hold_are_400_and_the_engine_survives(http):
    for kw, param in [({"top_k": 1 << 63}, "top_k"), ({"top_k": 1 << 200}, "top_k"),
                      ({"max_tokens": 1 << 63}, "max_tokens"),
                      ({"stop_token_ids": [1 << 64]}, "stop_token_ids"), ({"temperature": 2.5}, "temperature"),
                      ({"repetition_penalty": 1e-300}, "repetition_penalty"), ({"n": 1 << 70}, "n")]:
        r = http.post("/v1/completions", json={**_ok(temperature=1.0, seed=1), **kw})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (kw, r.text)
    r = http.post("/v1/completions", json=_ok(temperature=1.0, seed=1, top_k=(1 << 63) - 1))
    assert r.status_code == 200, r.text
    assert http.get("/health").status_code == 200


def test_tiny_temperature_is_greedy(http):
    greedy = http.post("/v1/completions", json=_ok(temperature=0, logprobs=2, max_tokens=6)).json()
    for t in (1e-39, 1e-300, 5e-324):
        tiny = http.post("/v1/completions", json=_ok(temperature=t, logprobs=2, max_tokens=6)).json()
        assert tiny["choices"][0]["text"] == greedy["choices"][0]["text"]
        assert tiny["choices"][0]["logprobs"] == greedy["choices"][0]["logprobs"]


def test_huge_prompt_is_refused_early_and_the_loop_stays_free(server):
    big = "word " * 800_000  # 4 MB: far beyond 256 tokens

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60.0) as c:
            async def health_times():
                times = []
                for _ in range(20):
                    t0 = time.monotonic()
                    assert (await c.get("/health")).status_code == 200
                    times.append(time.monotonic() - t0)
                    await asyncio.sleep(0.02)
                return times

            t0 = time.monotonic()
            chat = {"model": MODEL, "messages": [{"role": "user", "content": big}]}
            reqs = [c.post("/v1/completions", json=_ok(prompt=big)), c.post("/v1/chat/completions", json=chat)]
            *answers, times = await asyncio.gather(*reqs, health_times())
            return answers, times, time.monotonic() - t0

    answers, times, elapsed = asyncio.run(main())
    for r in answers:
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded" and "bytes" in err["message"]
    assert max(times) < 1.0, times
    assert elapsed < 10.0


def test_text_offsets_match_the_returned_text(http):
    """The echoed prompt holds characters split over byte tokens; every whole token sits at its offset.
    (The tiny random model's own output is arbitrary bytes, so only the order of its offsets is checked.)"""
    prompt = "Hi 東京 🙂 café"
    r = http.post("/v1/completions", json=_ok(prompt=prompt, echo=True, logprobs=0, temperature=0,
                                              max_tokens=8)).json()
    choice = r["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    offsets = lp["text_offset"]
    assert text.startswith(prompt)
    assert offsets == sorted(offsets) and offsets[0] == 0 and all(o <= len(text) for o in offsets)
    in_prompt = [(tok, off) for tok, off in zip(lp["tokens"], offsets) if off < len(prompt)]
    assert any(tok.startswith("bytes:") for tok, _ in in_prompt)
    for tok, off in in_prompt:
        if not tok.startswith("bytes:"):
            assert text[off:off + len(tok)] == tok, (tok, off, text)


@pytest.fixture(scope="module")
def guarded(start_server):
    return start_server("--api-key", "sesame", "--max-pending-requests", "2", "--body-timeout", "1")


def test_bearer_scheme_is_case_insensitive(guarded):
    for scheme in ("Bearer", "bearer", "BEARER"):
        r = httpx.post(f"{guarded.url}/v1/completions", json=_ok(), headers={"Authorization": f"{scheme} sesame"})
        assert r.status_code == 200, scheme
    r = httpx.post(f"{guarded.url}/v1/completions", json=_ok(), headers={"Authorization": "Bearer sesame!"})
    assert r.status_code == 401
    # with an API key, the Host check is off (the key protects the server)
    r = httpx.post(f"{guarded.url}/v1/completions", json=_ok(),
                   headers={"Authorization": "Bearer sesame", "host": "my-server.example"})
    assert r.status_code == 200


def test_request_that_can_never_fit_is_400_not_429(guarded):
    auth = {"Authorization": "Bearer sesame"}
    r = httpx.post(f"{guarded.url}/v1/completions", json=_ok(prompt=["a", "b", "c"]), headers=auth)
    assert r.status_code == 400 and "--max-pending-requests" in r.json()["error"]["message"]
    r = httpx.post(f"{guarded.url}/v1/completions", json=_ok(prompt=["a", "b"]), headers=auth)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    assert guarded.wait_idle().get('detinfer_requests_rejected_total{reason="queue_full"}', 0) == 0


def test_slow_body_gets_408_and_does_not_stall_others(guarded):
    host, port = guarded.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer sesame\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 200\r\n\r\n")
        t0 = time.monotonic()
        answer = b""
        s.settimeout(0.05)
        while time.monotonic() - t0 < 10 and b"\r\n\r\n" not in answer:
            try:
                s.sendall(b" ")  # one byte at a time
            except OSError:
                pass
            h0 = time.monotonic()
            assert httpx.get(f"{guarded.url}/health", timeout=5).status_code == 200
            assert time.monotonic() - h0 < 1.0
            try:
                answer += s.recv(4096)
            except TimeoutError:
                pass
        assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
        assert time.monotonic() - t0 < 5


# -- start-up ----------------------------------------------------------------------------------------------
def _serve_cmd(model_dir: Path, port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "detinfer.server.serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
            "--device", "cpu", "--num-kv-blocks", "64", "--uvicorn-log-level", "warning", *args]


def test_busy_port_is_a_one_line_error_before_loading(tiny_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        p = subprocess.run(_serve_cmd(tiny_model_dir, port), capture_output=True, text=True, timeout=120,
                           env=dict(os.environ))
    assert p.returncode == 1
    assert "serving on" not in p.stdout
    err = p.stderr.strip()
    assert err.count("\n") == 0 and "already in use" in err and str(port) in err, err


def test_readiness_is_reported_once_the_socket_answers(tiny_model_dir, tmp_path):
    """`serving on URL` appears only when a request to URL already succeeds; the model is given with ~ and
    with --model."""
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / "tiny").symlink_to(tiny_model_dir, target_is_directory=True)
    cmd = _serve_cmd(Path("~/models/tiny"), 0)
    cmd.remove("~/models/tiny")
    cmd += ["--model", "~/models/tiny"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "HOME": str(home)})
    try:
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if "serving on http://" in line or not line:
                break
        assert "serving on http://127.0.0.1:" in line, line
        url = line.rsplit("serving on ", 1)[1].strip()
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200  # no retry needed
    finally:
        proc.terminate()
        proc.wait(30)


def test_model_argument_spellings(tmp_path, monkeypatch):
    from detinfer.server.serve import CLIError, resolve_model_dir

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_model_dir("~/m", None) == (tmp_path / "m", "m")
    assert resolve_model_dir(None, "~/m") == (tmp_path / "m", "m")
    assert resolve_model_dir("~/m", str(tmp_path / "m")) == (tmp_path / "m", "m")
    with pytest.raises(CLIError, match="two different"):
        resolve_model_dir("~/m", "/elsewhere")
    with pytest.raises(CLIError, match="required"):
        resolve_model_dir(None, None)
    with pytest.raises(CLIError, match="does not exist"):
        resolve_model_dir("~/missing/dir", None)
