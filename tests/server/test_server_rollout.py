"""The server as an external trainer's rollout engine (docs/rollout-server.md): `return_token_ids` (alone ==
concurrent, streaming == non-streaming, bitwise) and the admin routes (load weights, reset the prefix cache,
weights fingerprint): access control, a load changes what is sampled and loading the original back restores
it bit for bit, bad tensors get a 400 and change nothing, in-flight requests finish on the old weights, and the
engine thread (--no-engine-process) gives the same bits as the engine process."""

import concurrent.futures
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

MODEL_NAME = "tiny-llama"  # the --served-model-name the conftest servers use

KEY = "rollout-key"
PROMPT = "once upon a time there was a little dog who liked to run in the park " * 2
SAMPLE = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=7, n=2, logprobs=1,
              ignore_eos=True, return_token_ids=True)


def _post(srv, path, body=None, key=KEY, timeout=120.0):
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{srv.url}{path}", json=body, headers=headers, timeout=timeout)


def _complete(srv, key=KEY, **overrides):
    r = _post(srv, "/v1/completions", {**SAMPLE, **overrides}, key=key)
    assert r.status_code == 200, r.text
    return r.json()


def _bits(resp):
    """What must match bitwise: per choice, the completion ids, text and logprobs (floats as JSON repr)."""
    return [(c["index"], c["token_ids"], c["text"], c["logprobs"]["token_logprobs"]) for c in resp["choices"]]


def _stream_lines(srv, path, body, key=None):
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    with httpx.stream("POST", f"{srv.url}{path}", json={**body, "stream": True}, headers=headers,
                      timeout=120.0) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


# -- return_token_ids ------------------------------------------------------------------------------------
def test_completion_token_ids_alone_equal_concurrent_and_streamed(server):
    alone = _complete(server, key=None)
    for c in alone["choices"]:
        assert len(c["token_ids"]) == 12 and len(c["logprobs"]["token_logprobs"]) == 12
    assert alone["usage"]["completion_tokens"] == 24
    prompt_ids = alone["choices"][0]["prompt_token_ids"]
    assert len(prompt_ids) == alone["usage"]["prompt_tokens"]
    by_ids = _complete(server, key=None, prompt=prompt_ids)  # the ids, sent back, are the same prompt
    assert _bits(by_ids) == _bits(alone) and by_ids["choices"][1]["prompt_token_ids"] == prompt_ids

    others = [dict(seed=s, prompt=PROMPT[: 10 + 3 * s], max_tokens=5 + s) for s in range(7)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_complete, server, None, **o) for o in others[:4]]
        mine = pool.submit(_complete, server, None)
        futures += [pool.submit(_complete, server, None, **o) for o in others[4:]]
        concurrent_resp = mine.result()
        for f in futures:
            f.result()
    assert _bits(concurrent_resp) == _bits(alone)

    chunks = _stream_lines(server, "/v1/completions", SAMPLE)
    for c in alone["choices"]:
        mine = [ch for chunk in chunks for ch in chunk["choices"] if ch["index"] == c["index"]]
        assert [t for ch in mine for t in ch["token_ids"]] == c["token_ids"]
        assert "".join(ch["text"] for ch in mine) == c["text"]
        assert [ch["prompt_token_ids"] is not None for ch in mine] == [True] + [False] * (len(mine) - 1)
        assert mine[0]["prompt_token_ids"] == prompt_ids


def test_completion_without_the_flag_has_no_token_ids(server):
    resp = _complete(server, key=None, return_token_ids=False)
    assert all(c["token_ids"] is None and c["prompt_token_ids"] is None for c in resp["choices"])


def test_chat_token_ids_streamed_equal_non_streamed(server):
    body = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "tell me a story"}], max_tokens=10,
                temperature=1.0, seed=3, n=2, ignore_eos=True, return_token_ids=True)
    r = _post(server, "/v1/chat/completions", body, key=None)
    assert r.status_code == 200, r.text
    resp = r.json()
    assert len(resp["prompt_token_ids"]) == resp["usage"]["prompt_tokens"]
    chunks = _stream_lines(server, "/v1/chat/completions", body)
    assert [c["prompt_token_ids"] is not None for c in chunks].count(True) == 1
    assert chunks[0]["prompt_token_ids"] == resp["prompt_token_ids"]
    for c in resp["choices"]:
        assert len(c["token_ids"]) == 10
        streamed = [t for ch in chunks for x in ch["choices"] if x["index"] == c["index"] for t in x["token_ids"] or []]
        assert streamed == c["token_ids"]


# -- admin routes ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def perturbed(tiny_model_dir, tmp_path_factory):
    """The tiny checkpoint's tensors (HF names), each moved by seeded noise: a 'trained' checkpoint."""
    gen = torch.Generator().manual_seed(0)
    tensors = load_file(tiny_model_dir / "model.safetensors")
    out = tmp_path_factory.mktemp("rollout") / "step1.safetensors"
    save_file({k: (v + 0.05 * torch.randn(v.shape, generator=gen, dtype=v.dtype)).contiguous()
               for k, v in tensors.items()}, out)
    return out


@pytest.fixture(scope="module")
def keyed(start_server):
    return start_server("--api-key", KEY)


def test_admin_routes_need_the_key_or_the_local_flag(server, keyed):
    for path in ("/admin/reset_prefix_cache", "/admin/load_weights"):
        r = _post(server, path, {"path": "x"}, key=None)
        assert r.status_code == 403 and "--enable-admin-endpoints" in r.json()["error"]["message"]
        assert _post(keyed, path, {"path": "x"}, key=None).status_code == 401
        assert _post(keyed, path, {"path": "x"}, key="wrong").status_code == 401
    assert httpx.get(f"{keyed.url}/admin/weights_fingerprint", timeout=30).status_code == 401


def _fingerprint(srv, key=KEY):
    r = httpx.get(f"{srv.url}/admin/weights_fingerprint", headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_load_weights_changes_sampling_and_loading_back_restores_it(keyed, perturbed, tiny_model_dir):
    before, fp0 = _complete(keyed), _fingerprint(keyed)
    r = _post(keyed, "/admin/load_weights", {"path": str(perturbed)})
    assert r.status_code == 200, r.text
    loaded = r.json()
    assert loaded["weights_sha256"] != fp0["weights_sha256"] and loaded["prefix_cache_blocks_dropped"] > 0
    assert _fingerprint(keyed)["weights_sha256"] == loaded["weights_sha256"]
    after = _complete(keyed)
    assert after["system_fingerprint"] == loaded["system_fingerprint"] != before["system_fingerprint"]
    assert _bits(after) != _bits(before)
    assert _bits(_complete(keyed)) == _bits(after)  # reproducible on the new weights
    r = _post(keyed, "/admin/load_weights", {"path": str(tiny_model_dir)})  # a checkpoint directory
    assert r.status_code == 200 and r.json()["weights_sha256"] == fp0["weights_sha256"]
    assert _bits(_complete(keyed)) == _bits(before)  # the original weights give the original bits back


def test_reset_prefix_cache_empties_it(keyed):
    _complete(keyed)
    first = _post(keyed, "/admin/reset_prefix_cache")
    assert first.status_code == 200 and first.json()["prefix_cache_blocks_dropped"] > 0
    assert _post(keyed, "/admin/reset_prefix_cache").json() == {"prefix_cache_blocks_dropped": 0}


@pytest.mark.parametrize("mutate", ["shape", "unknown_name", "body"])
def test_bad_weights_get_400_and_the_server_keeps_serving(keyed, tiny_model_dir, tmp_path, mutate):
    before, fp0 = _complete(keyed), _fingerprint(keyed)
    tensors = load_file(tiny_model_dir / "model.safetensors")
    name = sorted(tensors)[0]
    if mutate == "shape":
        tensors[name] = torch.zeros(3, 5)
    else:
        tensors["model.layers.0.mystery.weight"] = torch.zeros(2)
        name = "model.layers.0.mystery.weight"
    path = tmp_path / "bad.safetensors"
    save_file(tensors, path)
    body = {"path": str(path)} if mutate != "body" else {"checkpoint": str(path)}
    r = _post(keyed, "/admin/load_weights", body)
    assert r.status_code == 400
    assert (name if mutate != "body" else '"path"') in r.json()["error"]["message"]
    assert _fingerprint(keyed) == fp0
    assert _bits(_complete(keyed)) == _bits(before)


def test_in_flight_request_finishes_on_the_old_weights(keyed, perturbed, tiny_model_dir):
    long = dict(max_tokens=40, n=1)
    old = _complete(keyed, **long)
    keyed.gate.hold_after(0)  # hold the core: the request below is provably unfinished when the load arrives
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            running = pool.submit(_complete, keyed, KEY, **long)
            keyed.gate.wait_held(unfinished=1)
            load = pool.submit(_post, keyed, "/admin/load_weights", {"path": str(perturbed)})
            time.sleep(0.5)  # let the load reach the core (were it later, the request would only finish sooner)
            assert not load.done()  # it waits for the request in flight
            keyed.gate.release()
            assert _bits(running.result()) == _bits(old)
            assert load.result().status_code == 200
        assert _bits(_complete(keyed, **long)) != _bits(old)  # sent after the load: the new weights
    finally:
        keyed.gate.release()
        assert _post(keyed, "/admin/load_weights", {"path": str(tiny_model_dir)}).status_code == 200


def test_engine_thread_loads_weights_with_the_same_bits(start_server, keyed, perturbed, tiny_model_dir):
    local = start_server("--no-engine-process", "--enable-admin-endpoints")
    base = _complete(local, key=None)
    assert _bits(base) == _bits(_complete(keyed))
    for srv, key in ((local, None), (keyed, KEY)):
        assert _post(srv, "/admin/load_weights", {"path": str(perturbed)}, key=key).status_code == 200
    try:
        assert _bits(_complete(local, key=None)) == _bits(_complete(keyed)) != _bits(base)
        assert _post(local, "/admin/reset_prefix_cache", key=None).json()["prefix_cache_blocks_dropped"] > 0
    finally:
        assert _post(keyed, "/admin/load_weights", {"path": str(tiny_model_dir)}).status_code == 200


def test_example_rollout_trainer_runs_on_stories260k(stories_dir):
    """examples/rollout_trainer.py end to end (it asserts each step: changed samples, restored bits)."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    done = subprocess.run([sys.executable, str(root / "examples" / "rollout_trainer.py"), str(stories_dir)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "came back bit for bit" in done.stdout
