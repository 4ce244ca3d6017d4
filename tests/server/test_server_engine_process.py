"""The server's engine core in its own process (the default) against the engine thread (--no-engine-process):
the same requests, sent concurrently, get bit-identical text and logprobs from the shared server, a server with
the engine thread and a freshly started server; a killed core fails in-flight requests with clear errors
(no hang); with restarts off /health turns 503 and new requests get 503 for good; with restarts on a fresh core
is started (503 "restarting" meanwhile) and gives bit-identical answers, until the restart budget is spent; a
killed API process leaves no core behind; a start-up error in the core reads exactly as in-process."""

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
    """The current core's pid: the last one the server logged (at start-up, or after a restart)."""
    found = re.findall(r"engine process pid (\d+)", server.log())
    assert found, server.log()
    return int(found[-1])


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


LONG = dict(model=MODEL, prompt="once upon a time", max_tokens=200, ignore_eos=True, temperature=0.0)


def _kill_core_under_load(srv) -> dict[str, object]:
    """Kill -9 the core while a plain and a streamed request run (the core held between steps, so both have
    started and provably not finished, on any machine); their answers."""
    pid = _core_pid(srv)
    long = LONG
    results: dict[str, object] = {}

    def blocking() -> None:
        results["plain"] = httpx.post(f"{srv.url}/v1/completions", json=long, timeout=120.0)

    def streaming() -> None:
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=dict(long, stream=True), timeout=120.0) as r:
            results["lines"] = [line for line in r.iter_lines() if line]

    srv.gate.hold_after(0)  # the core is idle: it holds before the first step with these requests
    threads = [threading.Thread(target=blocking), threading.Thread(target=streaming)]
    for t in threads:
        t.start()
    steps, _ = srv.gate.wait_held(unfinished=2)
    srv.gate.allow_more(2)  # prompts in, first tokens out
    srv.gate.wait_held(steps=steps + 2, unfinished=2)
    os.kill(pid, signal.SIGKILL)
    srv.gate.release()  # a restarted core runs freely
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    plain = results["plain"]
    assert plain.status_code == 500 and "killed by signal SIGKILL" in plain.json()["error"]["message"]
    lines = results["lines"]
    assert lines[-1] == "data: [DONE]" and "engine core process" in lines[-2] and '"error"' in lines[-2]
    return results


def _unavailable(srv) -> tuple[str, str]:
    """(/health's 503 message, a new request's 503 message)."""
    health = httpx.get(f"{srv.url}/health", timeout=10.0)
    again = httpx.post(f"{srv.url}/v1/completions", json=dict(LONG, max_tokens=2), timeout=10.0)
    assert health.status_code == 503 and again.status_code == 503, (health.text, again.text)
    return health.json()["error"]["message"], again.json()["error"]["message"]


def _wait_healthy(srv, timeout: float = 90.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(f"{srv.url}/health", timeout=10.0).status_code == 200:
            return True
        time.sleep(0.2)
    return False


def test_killed_core_fails_requests_clearly_and_a_fresh_server_agrees(start_server, reference):
    srv = start_server("--max-core-restarts", "0")
    assert _run_all(srv.url) == reference  # a freshly started server (and core) gives the same bits
    results = _kill_core_under_load(srv)
    assert "restarts are off" in results["plain"].json()["error"]["message"]
    time.sleep(1.0)  # restarts are off: it stays down
    for message in _unavailable(srv):
        assert "stopped unexpectedly" in message and "restarts are off" in message, message
    assert "restarting the engine core" not in srv.log()
    assert srv.stop(timeout=30) == 0


def test_killed_core_is_restarted_bit_identically_until_the_budget_is_spent(start_server, reference):
    srv = start_server("--max-core-restarts", "1")
    first_pid = _core_pid(srv)
    results = _kill_core_under_load(srv)
    assert "restarting the engine core" in results["plain"].json()["error"]["message"]
    for message in _unavailable(srv):  # the new core is still starting (spawn, imports, model load)
        assert message.startswith("engine core restarting after the engine core process"), message
        assert "killed by signal SIGKILL" in message
    assert _wait_healthy(srv), srv.log()
    assert _core_pid(srv) != first_pid and "restarting the engine core (restart 1 of at most 1" in srv.log()
    assert _run_all(srv.url) == reference  # issue 16: after a core restart, bit-identical text and logprobs
    _kill_core_under_load(srv)  # the budget (1) is spent: it stays down and says why
    time.sleep(1.0)
    for message in _unavailable(srv):
        assert "already restarted 1 time(s)" in message and "--max-core-restarts 1" in message, message
    assert srv.stop(timeout=30) == 0


def test_a_core_that_cannot_start_again_is_not_restarted_forever(start_server, tiny_model_dir, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    srv = start_server("--max-core-restarts", "2", model_dir=model)
    weights = next(model.glob("*.safetensors"))
    weights.unlink()  # a new file, not the one the running core may have mapped (truncating it: SIGBUS)
    weights.write_bytes(b"not a safetensors file")  # every restart now fails
    _kill_core_under_load(srv)
    deadline = time.monotonic() + 90
    while "already restarted 2 time(s)" not in httpx.get(f"{srv.url}/health", timeout=10.0).text:
        assert time.monotonic() < deadline, srv.log()
        time.sleep(0.2)
    for message in _unavailable(srv):
        assert message.startswith("the engine core is down after a failed engine core restart"), message
    assert srv.log().count("restarting the engine core failed") == 2
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
