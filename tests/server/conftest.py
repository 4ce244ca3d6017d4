"""Server test fixtures: a tiny HF-format checkpoint and real `detinfer serve` processes on 127.0.0.1.

Each server runs `python -m detinfer.server.serve` in a subprocess (the same code path as `detinfer serve`)
on a free port, with a small KV pool and batch limits so the CPU run stays quick. Starting one costs a few
seconds (torch import + model load), so the general-purpose server is shared by the whole session; tests
that need other flags (queue bound, shutdown) start their own.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from detinfer.engine.testing import CoreStepGate
from detinfer.server.metrics import parse_metrics

MODEL_NAME = "tiny-llama"
# Small, quick engine: 256-token context (the tiny model's), up to 32 sequences per step.
ENGINE_ARGS = ("--device", "cpu", "--num-kv-blocks", "384", "--block-size", "16", "--max-num-seqs", "32",
               "--max-num-batched-tokens", "512", "--uvicorn-log-level", "warning")
STARTUP_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A `detinfer serve` subprocess; `url` once started. Logs go to a file (no pipe to fill up)."""

    def __init__(self, model_dir: Path, log_dir: Path, *args: str):
        self.model_dir, self.log_path, self.args = model_dir, log_dir / f"server-{_free_port()}.log", args
        # Tests hold the engine core between steps through this (absent file: never held), never by timing.
        self.gate = CoreStepGate(self.log_path.with_suffix(".gate"))
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> ServerProcess:
        for _attempt in range(3):  # the free port may be taken between the probe and the bind: retry
            port = _free_port()
            self.url = f"http://127.0.0.1:{port}"
            cmd = [sys.executable, "-m", "detinfer.server.serve", str(self.model_dir), "--host", "127.0.0.1",
                   "--port", str(port), "--served-model-name", MODEL_NAME, *ENGINE_ARGS, *self.args]
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                             env={**os.environ, **self.gate.env})
            if self._wait_healthy():
                return self
            if "address already in use" not in self.log().lower():
                break
        raise RuntimeError(f"server did not start; log:\n{self.log()}")

    def _wait_healthy(self) -> bool:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.proc.kill()
        self.proc.wait()
        return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{self.url}/metrics", timeout=10.0).text)

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Metrics once nothing is pending, running or waiting (the engine loop has caught up)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["detinfer_requests_pending"] == 0 and m["detinfer_requests_running"] == 0
                    and m["detinfer_requests_waiting"] == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from detinfer.models.testing import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("model") / MODEL_NAME, "LlamaForCausalLM")


@pytest.fixture(scope="session")
def start_server(tiny_model_dir, tmp_path_factory):
    """Factory: start a server with extra flags; every server started is stopped at session end."""
    started: list[ServerProcess] = []
    log_dir = tmp_path_factory.mktemp("server-logs")

    def start(*args: str, model_dir: Path | None = None) -> ServerProcess:
        server = ServerProcess(model_dir or tiny_model_dir, log_dir, *args)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop(timeout=30.0)


@pytest.fixture(scope="session")
def server(start_server) -> ServerProcess:
    """The shared server (deterministic mode, default limits)."""
    return start_server()


@pytest.fixture(scope="session")
def client(server):
    import openai

    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120.0) as c:
        yield c
