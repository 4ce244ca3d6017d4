"""The engine core in its own process: `start_core()` spawns it, `run_core()` is its whole life.

The process owns the `LLMEngine` (scheduler, model runner, sampler, detokenizers) and runs `core.EngineCore`
over it, its commands and events crossing a socketpair (`core_wire`). It never waits for the front end
between steps, and the two processes never share a GIL, so HTTP parsing, JSON and streaming in the API
process cannot delay a step.

Detokenization stays here, next to the scheduler: stop strings decide when a sequence finishes, so moving
them out would have the core either run past a stop string or wait a round trip per token. The text a client
gets is therefore made by the same code, in the same order, as in-process; what crosses is only its new part.

Lifetime: the front end owns the core. The core exits when told (`Shutdown`), when its socket reaches EOF
(the front end exited or was killed: no orphan), or after a step that failed as a whole (`Failed` first).
It ignores SIGINT: Ctrl-C in a terminal reaches the whole process group, and the front end drains in-flight
requests before it stops the core.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing
import os
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from detinfer.engine import core_wire as wire
from detinfer.engine.core import EngineCore, EngineCoreError, Ready, Shutdown, StartupError, StepDone, exception_of

SOCKET_BUFFER_BYTES = 4 << 20  # a few steps' outputs fit even while the front end is busy
STOP_TIMEOUT_S = 10.0
STEP_GATE_ENV = "DETINFER_TEST_STEP_GATE"  # test-only, see StepGate


@dataclass(frozen=True)
class CoreSpec:
    """What the core builds its engine from (pickled to the spawned process)."""

    model_dir: str
    config: Any  # EngineConfig
    device: str | None = None
    attention_backend: str = "auto"
    torch_threads: int | None = None  # the front end's intra-op thread count (CPU runs), kept by the core


def engine_info(engine) -> dict[str, Any]:
    """The facts a front end needs without the engine: resolved config, vocabulary size, device (and, on CUDA,
    its name and compute capability, so the front end never has to touch the GPU), dtype."""
    import torch

    dev = engine.device
    name, capability = dev.type, None
    if dev.type == "cuda":
        name, capability = torch.cuda.get_device_name(dev), tuple(torch.cuda.get_device_capability(dev))
    return {"config": engine.config, "vocab_size": engine.model_config.vocab_size, "device": str(dev),
            "device_name": name, "capability": capability, "dtype": str(engine.dtype).removeprefix("torch.")}


def run_core(sock: socket.socket, spec: CoreSpec) -> None:
    """The spawned process's entry point."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        import torch

        from detinfer.engine.llm_engine import LLMEngine

        if spec.torch_threads is not None:
            torch.set_num_threads(spec.torch_threads)
        engine = LLMEngine(spec.model_dir, spec.config, device=spec.device, attention_backend=spec.attention_backend)
    except BaseException as e:  # noqa: BLE001 -- every start-up failure goes back with its message
        wire.send(sock, StartupError(type(e).__name__, str(e) or repr(e)))
        sys.exit(1)
    wire.send(sock, Ready(engine_info(engine)))
    gate_path = os.environ.get(STEP_GATE_ENV)
    try:
        serve_core(engine, sock, StepGate(gate_path) if gate_path else None)
    except (EOFError, ConnectionError):
        pass  # the front end is gone: nothing left to serve
    except EngineCoreError:
        sys.exit(1)


class StepGate:
    """Test-only: lets tests hold the core between steps, so that they never race generation speed.

    Active only when STEP_GATE_ENV names a file. While the file holds an integer N, the core runs at most N
    steps in all (counted from its start), then waits, still serving commands, until N grows or the file is
    removed. Each time it starts waiting it writes "<steps done> <unfinished requests>" to "<file>.held", so
    a test knows the core is held with requests provably unfinished. A step with only aborted requests left
    still runs (it generates nothing, it delivers their final outputs).
    """

    def __init__(self, path: str):
        self.path, self.held_path = path, path + ".held"
        self._reported: tuple[int, int] | None = None

    def __call__(self, steps_done: int, engine) -> bool:
        try:
            with open(self.path) as f:
                limit = int(f.read().strip() or "-1")
        except (FileNotFoundError, ValueError):
            limit = -1
        if limit < 0 or steps_done < limit:
            self._reported = None
            return True
        state = (steps_done, engine.get_num_unfinished_requests())
        if state != self._reported:  # written once per held state (atomically: tests poll it)
            with open(self.held_path + ".tmp", "w") as f:
                f.write(f"{state[0]} {state[1]}")
            os.replace(self.held_path + ".tmp", self.held_path)
            self._reported = state
        # A step with only aborted requests left generates nothing; it delivers their final outputs.
        return not engine.scheduler.has_unfinished()


def serve_core(engine, sock: socket.socket, gate: StepGate | None = None) -> None:
    """Run an EngineCore over `engine` whose commands and events cross `sock` (core_wire's framing)."""
    encoder = wire.OutputEncoder()

    def take(timeout: float | None) -> list:
        commands = []
        while select.select([sock], [], [], 0 if commands else timeout)[0]:
            commands.append(wire.decode_prompts(wire.recv(sock)))
        return commands

    def emit(event) -> None:
        if isinstance(event, StepDone):  # deltas: resending cumulative outputs would cost O(length^2)
            event = dataclasses.replace(event, outputs=tuple(map(encoder.encode, event.outputs)))
        wire.send(sock, event)

    EngineCore(engine, take, emit, gate).run()


class CoreProcess:
    """The front end's handle on a started core: its socket, its process, its facts (`info`)."""

    def __init__(self, process, sock: socket.socket, info: dict[str, Any], spec: CoreSpec | None = None):
        self.process, self.sock, self.info = process, sock, info
        self.spec = spec  # what it was started from (resolved): a restart starts the same core again
        self._closed = False
        atexit.register(self.close)  # runs before multiprocessing's own exit hook joins the child

    @property
    def pid(self) -> int:
        return self.process.pid

    def exit_description(self) -> str:
        """'exit code N' / 'killed by signal SIGKILL' once the process is gone (waits briefly for it)."""
        self.process.join(0.5)
        code = self.process.exitcode
        if code is None:
            return "still running"
        if code < 0:
            try:
                return f"killed by signal {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    def close(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the core (idempotent): ask, then SIGTERM, then SIGKILL; never leaves it running."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        try:
            self.sock.setblocking(True)
            wire.send(self.sock, Shutdown())
            wire.drain_until_closed(self.sock, timeout)  # the core exits, closing its end
        except OSError:
            pass
        self.sock.close()
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def start_core(spec: CoreSpec, *, timeout: float | None = None, cancel: threading.Event | None = None) -> CoreProcess:
    """Spawn the core and wait until its engine is built. A start-up failure in the core (bad model path,
    out of memory) is raised here with its own message and type (ValueError, OSError, RuntimeError, ...).
    Setting `cancel` (from another thread) stops the wait within ~0.2 s: the half-started core is killed and
    EngineCoreError raised (a server shutting down while it restarts a core does not wait for a model load)."""
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked CUDA or thread state
    ours, theirs = socket.socketpair()
    for s in (ours, theirs):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    torch = sys.modules.get("torch")
    if spec.torch_threads is None and torch is not None:
        # The caller's torch thread count (torch imported): the core runs the same CPU policy as the in-process
        # engine would have in the caller's process.
        spec = dataclasses.replace(spec, torch_threads=torch.get_num_threads())
    process = ctx.Process(target=run_core, args=(theirs, spec), name="detinfer-engine-core")
    try:
        process.start()
        theirs.close()
        msg = _wait_ready(process, ours, timeout, cancel)
    except BaseException:
        ours.close()
        if process.pid is not None:
            process.kill()
            process.join()
        raise
    if isinstance(msg, StartupError):
        ours.close()
        process.join(STOP_TIMEOUT_S)
        raise exception_of((msg.kind, msg.message))
    return CoreProcess(process, ours, msg.info, spec)


def _wait_ready(process, sock: socket.socket, timeout: float | None, cancel: threading.Event | None):
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if cancel is not None and cancel.is_set():
            raise EngineCoreError("engine core start-up cancelled")
        if select.select([sock], [], [], 0.2)[0]:
            try:
                return wire.recv(sock)
            except EOFError:
                process.join(STOP_TIMEOUT_S)
                raise EngineCoreError(f"the engine core process exited during start-up (exit code "
                                      f"{process.exitcode}); see its log above") from None
        if not process.is_alive():
            raise EngineCoreError(f"the engine core process exited during start-up (exit code {process.exitcode})")
        if deadline is not None and time.monotonic() > deadline:
            raise EngineCoreError(f"the engine core process did not start within {timeout} s")
