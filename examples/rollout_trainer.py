"""A tiny external "trainer" that uses `detinfer serve` as its rollout engine (docs/rollout-server.md).

It starts a server (engine in its own process, admin routes behind an API key), then:
1. samples seeded rollouts with logprobs and token ids (`return_token_ids`), twice: same bits;
2. "trains": perturbs every weight with seeded noise and saves a safetensors file (HF tensor names);
3. POSTs /admin/load_weights and checks /admin/weights_fingerprint: the fingerprint changed;
4. samples again: the completions changed, and repeat sampling is still bit-identical;
5. loads the original checkpoint back: the first rollouts come back bit for bit.

    python examples/rollout_trainer.py MODEL_DIR        # e.g. a stories260k or smollm2-135m directory

Everything is seeded, so two runs print the same thing. CPU is fine for a tiny model (add --device cuda for GPU).
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file, save_file


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, port: int, key: str, device: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "detinfer.server.serve", str(model_dir), "--port", str(port), "--api-key", key,
           "--served-model-name", "policy", "--device", device, "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start within 300 s")


class Rollouts:
    """The trainer's view of the server: seeded samples with token ids and logprobs; the admin routes."""

    def __init__(self, url: str, key: str):
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=300)

    def sample(self, prompts: list[str], seed: int) -> list[dict]:
        r = self.http.post("/v1/completions", json={
            "model": "policy", "prompt": prompts, "n": 2, "max_tokens": 24, "temperature": 1.0, "seed": seed,
            "logprobs": 0, "return_token_ids": True})
        r.raise_for_status()
        return [{"prompt_token_ids": c["prompt_token_ids"], "token_ids": c["token_ids"], "text": c["text"],
                 "logprobs": c["logprobs"]["token_logprobs"]} for c in r.json()["choices"]]

    def load_weights(self, path: Path) -> dict:
        r = self.http.post("/admin/load_weights", json={"path": str(path)})
        if r.status_code != 200:
            raise SystemExit(f"load_weights failed: {r.status_code} {r.text}")
        return r.json()

    def fingerprint(self) -> str:
        return self.http.get("/admin/weights_fingerprint").json()["weights_sha256"]


def perturbed_checkpoint(model_dir: Path, out: Path, step: int, scale: float = 0.05) -> Path:
    """A stand-in for an optimizer step: every tensor moved by noise seeded with the step number."""
    gen = torch.Generator().manual_seed(step)
    tensors = load_file(model_dir / "model.safetensors")
    path = out / f"step{step}.safetensors"
    save_file({name: (t.float() + scale * torch.randn(t.shape, generator=gen)).to(t.dtype).contiguous()
               for name, t in tensors.items()}, path)
    return path


def show(label: str, rollouts: list[dict]) -> None:
    first = rollouts[0]
    print(f"{label}: {first['text']!r} ids {first['token_ids'][:8]}... "
          f"logprob sum {sum(first['logprobs']):.6f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if not (args.model_dir / "model.safetensors").is_file():
        raise SystemExit(f"{args.model_dir}: expected a model directory with model.safetensors")
    key, port = secrets.token_hex(16), free_port()
    server = start_server(args.model_dir, port, key, args.device)
    try:
        client = Rollouts(f"http://127.0.0.1:{port}", key)
        prompts = ["Once upon a time", "The little dog"]
        fp0, before = client.fingerprint(), client.sample(prompts, seed=1)
        show("step 0", before)
        assert client.sample(prompts, seed=1) == before, "same seed, same weights: same bits"
        with tempfile.TemporaryDirectory() as tmp:
            loaded = client.load_weights(perturbed_checkpoint(args.model_dir, Path(tmp), step=1))
        print(f"loaded step 1: weights {loaded['weights_sha256'][:16]} (was {fp0[:16]}), "
              f"{loaded['prefix_cache_blocks_dropped']} prefix-cache blocks dropped")
        assert client.fingerprint() == loaded["weights_sha256"] != fp0
        after = client.sample(prompts, seed=1)
        show("step 1", after)
        assert after != before, "new weights, new samples"
        assert client.sample(prompts, seed=1) == after
        client.load_weights(args.model_dir)  # the original checkpoint directory
        assert client.fingerprint() == fp0 and client.sample(prompts, seed=1) == before
        print("original weights loaded back: the step-0 rollouts came back bit for bit")
    finally:
        server.terminate()
        server.wait(60)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
