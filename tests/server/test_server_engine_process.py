"""The server's engine core in its own process (the default) against the engine thread (--no-engine-process):
the same requests, sent concurrently, get bit-identical text and logprobs from the shared server, a server with
the engine thread and a freshly started server; a killed core fails in-flight requests with clear errors
(no hang), /health turns 503 and new requests get 503; a killed API process leaves no core behind;
a start-up error in the core reads exactly as in-process."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

MODEL = "tiny-llama"
WORDS = "once upon a time there was a little model that computed the same answer every time".split()


def _bodies() -> list[tuple[str, dict]]:
    """(route, body): completions and chats, streamed or not, greedy and seeded, logprobs, n, stop strings."""
    out = []
    for i in range(12):
        prompt = " ".join(WORDS[(i * 5 + k) % len(WORDS)] for k in range(3 + i))
        common = dict(model=MODEL, max_tokens=6 + 2 * i, temperature=[0.0, 0.8, 1.0][i % 3], seed=i,
                      stream=i % 2 == 1, ignore_eos=i % 4 != 3)
        if i % 4 == 3:
            common["stop"] = ["e", " the"]
        if i % 3 == 2:
            out.append(("/v1/chat/completions", dict(common, messages=[{"role": "user", "content": prompt}],
                                                     logprobs=True, top_logprobs=2, n=1 + i % 2)))
        else:
            out.append(("/v1/completions", dict(common, prompt=prompt, logprobs=2, n=1 + i % 2)))
    return out


def _merge(route: str, chunks: list[dict]) -> dict:
    """Per choice: the whole text, every logprob, the finish reason (stream chunk boundaries may differ)."""
    merged: dict[int, dict] = {}
    for chunk in chunks:
        assert "error" not in chunk, chunk
        for c in chunk["choices"]:
            m = merged.setdefault(c["index"], {"text": "", "logprobs": [], "finish": None})
            if route == "/v1/completions":
                m["text"] += c["text"]
                lp = c.get("logprobs") or {}
                m["logprobs"] += list(zip(lp.get("token_logprobs", []), lp.get("top_logprobs", [])))
            else:
                m["text"] += (c.get("delta") or c.get("message") or {}).get("content") or ""
                m["logprobs"] += [(t["logprob"], [x["logprob"] for x in t["top_logprobs"]])
                                  for t in (c.get("logprobs") or {}).get("content") or []]
            m["finish"] = c.get("finish_reason") or m["finish"]
    return merged


async def _one(http: httpx.AsyncClient, route: str, body: dict) -> dict:
    if not body["stream"]:
        r = await http.post(route, json=body)
        assert r.status_code == 200, r.text
        return _merge(route, [r.json()])
    chunks = []
    async with http.stream("POST", route, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    return _merge(route, chunks)


def _run_all(url: str) -> list[dict]:
    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120.0) as http:
            return await asyncio.gather(*(_one(http, route, body) for route, body in _bodies()))

    return asyncio.run(run())


def _core_pid(server) -> int:
    found = re.search(r"engine process pid (\d+)", server.log())
    assert found, server.log()
    return int(found.group(1))


def _alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def _wait_dead(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive(pid)


@pytest.fixture(scope="module")
def reference(server) -> list[dict]:
    """The shared (engine process) server's answers, all requests at once."""
    return _run_all(server.url)


def test_engine_thread_server_gives_bit_identical_answers(start_server, reference):
    thread_server = start_server("--no-engine-process")
    assert "engine thread" in thread_server.log()
    assert _run_all(thread_server.url) == reference
    assert any(c["finish"] == "stop" for r in reference for c in r.values())  # stop strings were exercised
    thread_server.stop()


def test_killed_core_fails_requests_clearly_and_a_fresh_server_agrees(start_server, reference):
    srv = start_server()
    assert _run_all(srv.url) == reference  # a freshly started server (and core) gives the same bits
    pid = _core_pid(srv)
    long = dict(model=MODEL, prompt="once upon a time", max_tokens=200, ignore_eos=True, temperature=0.0)
    results: dict[str, object] = {}

    def blocking() -> None:
        results["plain"] = httpx.post(f"{srv.url}/v1/completions", json=long, timeout=60.0)

    def streaming() -> None:
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=dict(long, stream=True), timeout=60.0) as r:
            results["lines"] = [line for line in r.iter_lines() if line]

    threads = [threading.Thread(target=blocking), threading.Thread(target=streaming)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while srv.metrics()["detinfer_requests_running"] < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    assert time.monotonic() - t0 < 10
    plain = results["plain"]
    assert plain.status_code == 500 and "killed by signal SIGKILL" in plain.json()["error"]["message"]
    lines = results["lines"]
    assert lines[-1] == "data: [DONE]" and "engine core process" in lines[-2] and '"error"' in lines[-2]
    health = httpx.get(f"{srv.url}/health", timeout=10.0)
    assert health.status_code == 503
    again = httpx.post(f"{srv.url}/v1/completions", json=dict(long, max_tokens=2), timeout=10.0)
    assert again.status_code == 503 and "stopped unexpectedly" in again.json()["error"]["message"]
    assert srv.stop(timeout=30) == 0


def test_a_killed_server_leaves_no_core(start_server):
    """(SIGTERM stopping the core: tests/server/test_server_lifecycle.py's graceful shutdown.)"""
    srv = start_server()
    pid = _core_pid(srv)
    assert _alive(pid)
    srv.proc.kill()  # no chance to clean up: the core sees its socket close and exits on its own
    srv.proc.wait()
    assert _wait_dead(pid, 30)


def test_start_up_error_in_the_core_reads_as_in_process(tiny_model_dir, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_model_dir, bad)
    next(bad.glob("*.safetensors")).write_bytes(b"not a safetensors file")
    errors = []
    for flag in ("--engine-process", "--no-engine-process"):
        p = subprocess.run([sys.executable, "-m", "detinfer.server.serve", str(bad), "--port", "0", "--device", "cpu",
                            flag], capture_output=True, text=True, timeout=120, env=dict(os.environ))
        assert p.returncode == 1, p.stderr
        errors.append([line for line in p.stderr.splitlines() if line.startswith("detinfer serve: error:")])
    assert errors[0] == errors[1] and len(errors[0]) == 1 and "cannot load the model" in errors[0][0]
