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
            long = [asyncio.ensure_future(http.post("/v1/completions", json=LONG)) for _ in range(2)]
            while server.metrics()["detinfer_requests_pending"] < 2:
                await asyncio.sleep(0.02)
            extra = await asyncio.gather(*(http.post("/v1/completions", json={**LONG, "max_tokens": 2})
                                           for _ in range(6)))
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
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60.0) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                    first_chunk.set()
    except httpx.HTTPError as e:  # recorded: a clean shutdown must not produce one
        events.append(e)
    finally:
        first_chunk.set()


def test_graceful_shutdown_finishes_or_aborts_cleanly(start_server, tmp_path):
    # A model with a long context, so that the long requests cannot finish within the grace period (2000
    # tokens: >= 8 s at the ~4 ms/step this tiny model decodes on an idle 2-core CPU), while the short one
    # (12 tokens, ~0.1 s alone) finishes well within it even on a loaded machine (a 2 s grace and 40 tokens
    # failed there).
    from detinfer.models.testing import write_tiny_checkpoint

    model_dir = write_tiny_checkpoint(tmp_path / "long-context", "LlamaForCausalLM", max_position_embeddings=2048)
    server = start_server("--timeout-graceful-shutdown", "5.0", model_dir=model_dir)
    long = {**LONG, "max_tokens": 2000}
    long_events, short_events, started = [], [], threading.Event()
    t_long = threading.Thread(target=_stream, args=(server.url, long, long_events, started))
    t_long.start()
    assert started.wait(30)
    nonstream = {}

    def post_long():
        try:
            r = httpx.post(f"{server.url}/v1/completions", json=long, timeout=60.0)
            nonstream.update(status=r.status_code, body=r.json())
        except httpx.HTTPError as e:
            nonstream.update(error=e)

    t_non = threading.Thread(target=post_long)
    t_non.start()
    while server.metrics()["detinfer_requests_pending"] < 2:
        time.sleep(0.01)
    short_started = threading.Event()
    t_short = threading.Thread(target=_stream, args=(server.url, {**LONG, "max_tokens": 12}, short_events,
                                                     short_started))
    t_short.start()
    assert short_started.wait(30)  # its first chunk: it is running; SIGTERM now
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    for t in (t_long, t_short, t_non):
        t.join(30)
    code = server.proc.wait(30)
    elapsed = time.monotonic() - t0

    # the short stream finished normally within the grace period
    assert short_events[-1] == "[DONE]" and short_events[-2]["choices"][0]["finish_reason"] == "length"
    # the long stream was cut at the end of the grace period, cleanly: a final "abort" chunk, then [DONE]
    assert long_events[-1] == "[DONE]", long_events[-3:]
    assert long_events[-2]["choices"][0]["finish_reason"] == "abort"
    assert all(not isinstance(e, Exception) for e in long_events + short_events)
    # the non-streaming one got an OpenAI-style 503 rather than a dropped connection
    assert nonstream.get("status") == 503 and nonstream["body"]["error"]["type"] == "service_unavailable"
    assert code == 0 and elapsed < 20, (code, elapsed, server.log()[-2000:])
    log = server.log()
    assert "draining: 3 request(s) in flight" in log and "aborting 2 request(s)" in log, log
    assert "Traceback" not in log
    # the engine core process (the default) was stopped with the server: no orphan
    core_pid = int(re.search(r"engine process pid (\d+)", log).group(1))
    assert not Path(f"/proc/{core_pid}").exists() or "\nState:\tZ" in Path(f"/proc/{core_pid}/status").read_text()
