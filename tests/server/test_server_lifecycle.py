"""Servers with their own flags: the admission bound (429 instead of an unbounded queue), the API key, the
fingerprint of another mode, and graceful shutdown (in-flight requests finish within the grace period or end
cleanly with "abort")."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import time
from pathlib import Path

import httpx

MODEL = "tiny-llama"
LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 240, "temperature": 0, "ignore_eos": True}


def test_queue_bound_returns_429_and_api_key_is_required(start_server, server):
    shared = server  # the session's deterministic-mode server, same model
    server = start_server("--max-pending-requests", "2", "--api-key", "sesame", "--mode", "fast")
    auth = {"Authorization": "Bearer sesame"}
    r = httpx.post(f"{server.url}/v1/completions", json={**LONG, "max_tokens": 1})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200  # probes need no key

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=auth, timeout=120.0) as http:
            # The core is held (no step runs), so the two long requests provably stay pending while the
            # others arrive, however fast this machine generates; released once those have their answers.
            server.gate.hold_after(0)
            try:
                long = [asyncio.ensure_future(http.post("/v1/completions", json=LONG)) for _ in range(2)]
                while server.metrics()["detinfer_requests_pending"] < 2:
                    await asyncio.sleep(0.02)
                extra = await asyncio.gather(*(http.post("/v1/completions", json={**LONG, "max_tokens": 2})
                                               for _ in range(6)))
            finally:
                server.gate.release()
            return await asyncio.gather(*long), extra

    long, extra = asyncio.run(main())
    assert [r.status_code for r in long] == [200, 200]
    assert [r.status_code for r in extra] == [429] * 6
    for r in extra:
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "queue_full" and err["message"]
    m = server.wait_idle()
    assert m['detinfer_requests_rejected_total{reason="queue_full"}'] == 6
    ok = httpx.post(f"{server.url}/v1/completions", json={**LONG, "max_tokens": 2}, headers=auth)
    assert ok.status_code == 200  # capacity is back once the long ones finished
    # same weights, other mode: the answers are not comparable, and the fingerprint says so
    ref = httpx.post(f"{shared.url}/v1/completions", json={**LONG, "max_tokens": 2})
    assert ok.json()["system_fingerprint"] != ref.json()["system_fingerprint"]


def _stream(url: str, body: dict, events: list, first_chunk: threading.Event) -> None:
    """Collect a stream's data events (parsed) until the server closes it."""
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120.0) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                    first_chunk.set()
    except httpx.HTTPError as e:  # recorded: a clean shutdown must not produce one
        events.append(e)
    finally:
        first_chunk.set()


def _until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_graceful_shutdown_finishes_or_aborts_cleanly(start_server):
    # The engine core is held between steps (the gate of tests/server/conftest.py) and let through one step
    # at a time, so which request can finish within the grace period is decided by steps, not by this
    # machine's speed: once all three requests stream tokens, SIGTERM; then the core runs only until the
    # short request (12 tokens) has finished and is held again, so the long ones (240) provably cannot
    # finish and are aborted when the grace period ends. The grace period only has to cover ~12 steps.
    server = start_server("--timeout-graceful-shutdown", "10.0")
    gate = server.gate
    gate.hold_after(0)  # no step runs at start-up: the core is held from its first step on
    long_events, short_events, long_started, short_started = [], [], threading.Event(), threading.Event()
    nonstream = {}

    def post_long():
        try:
            r = httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=120.0)
            nonstream.update(status=r.status_code, body=r.json())
        except httpx.HTTPError as e:
            nonstream.update(error=e)

    threads = [threading.Thread(target=_stream, args=(server.url, LONG, long_events, long_started)),
               threading.Thread(target=post_long),
               threading.Thread(target=_stream, args=(server.url, {**LONG, "max_tokens": 12}, short_events,
                                                      short_started))]
    for t in threads:
        t.start()
    steps, unfinished = gate.wait_held(steps=0, unfinished=3)  # all three reached the core, no token yet
    while not (short_started.is_set() and long_started.is_set()):
        gate.allow_more(1)
        steps, unfinished = gate.wait_held(steps=steps + 1)
        assert unfinished == 3 and steps < 12, (steps, unfinished)  # the short one has not finished
        _until(lambda: short_started.is_set() and long_started.is_set(), 2.0)  # the step's chunks, if any
    server.proc.send_signal(signal.SIGTERM)
    assert _until(lambda: "draining: 3 request(s) in flight" in server.log(), 60.0), server.log()
    while unfinished == 3:  # one step at a time until the short request has finished in the core
        gate.allow_more(1)
        steps, unfinished = gate.wait_held(steps=steps + 1)
    assert unfinished == 2 and steps < 60, (steps, unfinished)  # the long ones are held, far from 240 tokens
    for t in threads:
        t.join(120)
    code = server.proc.wait(60)

    # the short stream finished normally within the grace period
    assert short_events[-1] == "[DONE]" and short_events[-2]["choices"][0]["finish_reason"] == "length"
    # the long stream was cut at the end of the grace period, cleanly: a final "abort" chunk, then [DONE]
    assert long_events[-1] == "[DONE]", long_events[-3:]
    assert long_events[-2]["choices"][0]["finish_reason"] == "abort"
    assert all(not isinstance(e, Exception) for e in long_events + short_events)
    # the non-streaming one got an OpenAI-style 503 rather than a dropped connection
    assert nonstream.get("status") == 503 and nonstream["body"]["error"]["type"] == "service_unavailable"
    assert code == 0, (code, server.log()[-2000:])
    log = server.log()
    assert "aborting 2 request(s)" in log, log
    assert "Traceback" not in log
    # the engine core process (the default) was stopped with the server: no orphan
    core_pid = int(re.search(r"engine process pid (\d+)", log).group(1))
    assert not Path(f"/proc/{core_pid}").exists() or "\nState:\tZ" in Path(f"/proc/{core_pid}/status").read_text()
