"""`detinfer repro --url` against a real `detinfer serve` subprocess (tiny model), and client errors."""

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from detinfer.repro.client import (
    ServerError,
    api_base,
    completion_from_response,
    decode_units,
    run_server,
    token_unit,
)
from detinfer.repro.experiment import ReproConfig

PROMPT = "Tell me about Richard Feynman"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url(tiny_chat_model, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("repro-server") / "server.log"
    # Without TRITON_INTERPRET the server's CPU attention is the pure-torch reference (also batch-invariant),
    # which keeps this test quick; the harness, not the kernels, is under test here.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "detinfer.server.serve", str(tiny_chat_model), "--host", "127.0.0.1", "--port",
           str(port), "--served-model-name", "tiny", "--device", "cpu", "--num-kv-blocks", "128",
           "--max-num-seqs", "16", "--max-num-batched-tokens", "256", "--uvicorn-log-level", "warning"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start:\n{log.read_text(errors='replace')}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("chat", [True, False])
def test_server_runs_reproduce(server_url, tiny_chat_model, chat):
    cfg = ReproConfig(n=6, max_tokens=8, chat=chat, max_background=3, background_max_tokens=8,
                      background_prompt_words=10, step_seconds=0.01, run_gap=2)
    comps, stats = run_server(server_url, PROMPT, cfg, progress=False)
    assert stats["model"] == "tiny" and stats["background requests"] > 0
    assert stats["background failures"] == 0
    assert [c.run for c in comps] == list(range(6))
    first = comps[0]
    assert 1 <= len(first.tokens) == len(first.logprobs) == len(first.top_logprobs) <= 8
    assert all(len(top) == 2 for top in first.top_logprobs)
    for c in comps:  # one completion, bit for bit, under load
        assert (c.tokens, c.text) == (first.tokens, first.text)
        assert [repr(x) for x in c.logprobs] == [repr(x) for x in first.logprobs]
    # partial-UTF-8 tokens rebuilt exactly (a stop token ends the tokens but not the text)
    shown = first.tokens[:-1] if first.finish_reason == "stop" else first.tokens
    assert decode_units(shown) == first.text
    # the server's answer is the offline engine's, token for token (same model, same chat template)
    from detinfer.engine.config import EngineConfig
    from detinfer.engine.llm_engine import LLMEngine
    from detinfer.engine.sampling_params import SamplingParams
    from detinfer.repro.api import prompt_ids_for

    engine = LLMEngine(tiny_chat_model, EngineConfig(num_kv_blocks=64, max_num_seqs=4), "cpu")
    engine.add_request("x", prompt_ids_for(engine.tokenizer, PROMPT, chat) if chat else PROMPT,
                       SamplingParams(temperature=0.0, max_tokens=8))
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[0].outputs[0].text == first.text


def test_repro_cli_against_server(server_url, tmp_path, capsys):
    from detinfer.repro.cli import main

    out = tmp_path / "r"
    rc = main(["--url", server_url, "--prompt", PROMPT, "--n", "4", "--max-tokens", "6", "--max-background", "2",
               "--background-max-tokens", "6", "--step-seconds", "0.01", "--out", str(out), "--no-progress",
               "--check"])
    assert rc == 0, capsys.readouterr()
    (section,) = json.loads((out / "report.json").read_text(encoding="utf-8"))["sections"]
    assert section["label"] == server_url and len(section["completions"]) == 4
    assert section["summary"]["num_unique"] == 1 and section["summary"]["unit"] == "token"


def test_unreachable_server_is_a_clear_error():
    port = _free_port()  # nothing listens there
    with pytest.raises(ServerError, match="cannot reach"):
        run_server(f"http://127.0.0.1:{port}", "x", ReproConfig(n=1, request_timeout=5.0), progress=False)


def test_client_helpers():
    assert api_base("http://h:1") == api_base("http://h:1/") == api_base("http://h:1/v1/") == "http://h:1/v1"
    with pytest.raises(ValueError, match="http"):
        api_base("h:1")
    with pytest.raises(ServerError, match="unexpected response shape"):
        completion_from_response(0, {"choices": []}, chat=True, meta={})
    assert token_unit("\ufffd", [0xE2, 0x80]) == "bytes:\\xe2\\x80"
    assert token_unit("é", [0xC3, 0xA9]) == "é"
    assert decode_units(["caf", "bytes:\\xc3", "bytes:\\xa9", "!"]) == "café!"
    assert decode_units(["bytes: literally"]) == "bytes: literally"
    # a server without logprobs: compared on text
    c = completion_from_response(3, {"choices": [{"text": "hi", "finish_reason": "length"}]}, chat=False, meta={})
    assert (c.run, c.text, c.tokens, c.logprobs, c.finish_reason) == (3, "hi", None, None, "length")
