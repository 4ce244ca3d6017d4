"""`detinfer serve MODEL` (or `--model MODEL`; a directory or a Hugging Face hub id): the OpenAI-compatible
server (FastAPI under uvicorn) over an LLMEngine.

Flags come from two frozen dataclasses, `ServerConfig` and the engine's `EngineConfig` (`--mode`, `--dtype`,
`--max-num-seqs`, ...), so the CLI, the defaults and the validation cannot drift apart.

Start-up order: check the flags, bind the port (a busy port fails at once, not after the model loaded),
load the model, start the engine and the HTTP server, and only then print "serving on http://...". Every
error is one line on stderr (no usage dump) and a non-zero exit.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from detinfer.engine.config import EngineConfig, add_dataclass_args, from_args
from detinfer.server.config import ServerConfig

SHUTDOWN_MARGIN_S = 5.0
LISTEN_BACKLOG = 2048


class CLIError(Exception):
    """A start-up failure reported as one line (exit status `status`)."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise CLIError(f"{message} (see `detinfer serve --help`)", status=2)


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="detinfer serve", allow_abbrev=False,
                            description="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                                        "/v1/models, /health, /metrics).")
    parser.add_argument("model_dir", nargs="?", metavar="MODEL_DIR",
                        help="HF-format model directory (config.json, *.safetensors, tokenizer).")
    parser.add_argument("--model", dest="model_flag", metavar="MODEL_DIR", help="The same, as a flag.")
    add_dataclass_args(parser, ServerConfig)
    add_dataclass_args(parser, EngineConfig)
    return parser


def resolve_model_dir(positional: str | None, flag: str | None) -> tuple[Path, str]:
    """(local model directory, default served name) from either spelling: a directory (`~` expanded) or a
    Hugging Face hub id (see detinfer.models.hub); both spellings must agree if both are given."""
    from detinfer.models.hub import resolve_model_path

    if positional is None and flag is None:
        raise CLIError("a model directory is required: detinfer serve MODEL_DIR (or --model MODEL_DIR)", 2)
    given = {os.path.expanduser(p) for p in (positional, flag) if p is not None}
    if len(given) > 1:
        raise CLIError(f"two different models given: {positional!r} and --model {flag!r}", 2)
    model = given.pop()
    try:
        model_dir = resolve_model_path(model)
    except (FileNotFoundError, ValueError, TypeError) as e:
        raise CLIError(str(e), 2) from None
    if not (model_dir / "config.json").is_file():
        raise CLIError(f"{model_dir} is not a model directory (no config.json)", 2)
    name = model_dir.resolve().name if Path(model).is_dir() else model  # a hub id names itself
    return model_dir, name


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port; CLIError naming the problem if it cannot be had."""
    try:
        family, type_, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                           flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise CLIError(f"cannot listen on {host}:{port}: cannot resolve the host ({e.strerror})") from None
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(LISTEN_BACKLOG)  # listening now: nobody else can take the port while the model loads
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise CLIError(f"cannot listen on {host}:{port}: the address is already in use (is another server "
                           "running there? pick another --port)") from None
        raise CLIError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except CLIError as e:
        print(f"detinfer serve: error: {e}", file=sys.stderr, flush=True)
        return e.status


def _main(argv: list[str] | None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        server_config = from_args(ServerConfig, ns)
        engine_config = from_args(EngineConfig, ns)
    except (ValueError, TypeError) as e:
        raise CLIError(str(e), 2) from None
    model_dir, default_name = resolve_model_dir(ns.model_dir, ns.model_flag)
    sock = bind_socket(server_config.host, server_config.port)
    port = sock.getsockname()[1]
    name = server_config.served_model_name or default_name
    try:
        return _serve(model_dir, name, server_config, engine_config, sock, _url(server_config.host, port))
    finally:
        sock.close()


def _load_engine(model_dir: Path, engine_config: EngineConfig, server_config: ServerConfig):
    """(engine front end's argument, facts): the started core process or the in-process engine, and the facts
    the server needs (`ServedModel.from_facts`). Load errors raised in the core keep their message."""
    from detinfer.engine.core_process import CoreSpec, EngineCoreError, engine_info, start_core
    from detinfer.engine.llm_engine import LLMEngine

    try:
        if server_config.engine_process:
            core = start_core(CoreSpec(str(model_dir), engine_config, server_config.device))
            return core, core.info
        engine = LLMEngine(model_dir, engine_config, device=server_config.device)
        return engine, engine_info(engine)
    except (ValueError, TypeError, OSError, KeyError, RuntimeError, EngineCoreError) as e:
        # Load errors (a malformed checkpoint, out of memory, ...) already say what is wrong and where.
        raise CLIError(f"cannot load the model in {model_dir}: {e}") from None


def uvicorn_config(app, server_config: ServerConfig):
    """uvicorn's settings: its httptools parser with our header limits (`http_guard`; the `server` extra brings
    httptools), its fast loop when installed (uvloop), keep-alive timeout, connection limit, and a shutdown
    timeout longer than our drain."""
    import uvicorn

    try:
        from detinfer.server.http_guard import guarded_protocol
    except ImportError as e:  # httptools missing: uvicorn's h11 fallback has no header timeout
        raise CLIError(f"the server needs httptools ({e}); install it with pip install 'detinfer[server]'") from None
    http = guarded_protocol(server_config.max_header_bytes, server_config.max_header_field_bytes,
                            server_config.header_timeout)
    # uvicorn cancels whatever still runs after its own timeout; ours (the drain) must fire first so that
    # aborted streams still get their final "abort" chunk and [DONE] out before the sockets close.
    return uvicorn.Config(app, log_level=server_config.uvicorn_log_level, http=http, loop="auto",
                          timeout_graceful_shutdown=server_config.timeout_graceful_shutdown + SHUTDOWN_MARGIN_S,
                          timeout_keep_alive=server_config.timeout_keep_alive,
                          limit_concurrency=server_config.limit_concurrency)


def _serve(model_dir: Path, name: str, server_config: ServerConfig, engine_config: EngineConfig,
           sock: socket.socket, url: str) -> int:
    sys.setswitchinterval(server_config.gil_switch_interval_ms / 1000.0)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    engine, info = _load_engine(model_dir, engine_config, server_config)
    try:
        return _serve_engine(engine, info, model_dir, name, server_config, sock, url)
    finally:
        if server_config.engine_process:
            engine.close()  # idempotent: normally the app's shutdown stopped it already


def _serve_engine(engine, info: dict, model_dir: Path, name: str, server_config: ServerConfig,
                  sock: socket.socket, url: str) -> int:
    from detinfer.models.loader import load_tokenizer
    from detinfer.server.app import create_app
    from detinfer.server.async_engine import AsyncEngine
    from detinfer.server.context import ServedModel
    from detinfer.server.core_engine import CoreAsyncEngine
    from detinfer.server.fingerprint import DeviceInfo, model_files_digest, system_fingerprint

    resolved, device, dtype = info["config"], info["device"], info["dtype"]  # max_model_len resolved
    hardware = DeviceInfo(device.split(":")[0], info["device_name"], info["capability"])  # the core's GPU facts

    def refingerprint(weights_digest: str) -> str:  # an admin weight load changes only the weights' digest
        return system_fingerprint(weights_digest=weights_digest, dtype=dtype, mode=resolved.mode,
                                  block_size=resolved.block_size, device=hardware)

    fingerprint = refingerprint(model_files_digest(model_dir))
    if server_config.engine_process:
        from detinfer.engine.core_process import start_core

        async_engine = CoreAsyncEngine(engine, max_pending_requests=server_config.max_pending_requests,
                                       restart=lambda cancel: start_core(engine.spec, cancel=cancel),
                                       max_restarts=server_config.max_core_restarts)
    else:
        async_engine = AsyncEngine(engine, max_pending_requests=server_config.max_pending_requests)
    tokenizer = load_tokenizer(model_dir) if server_config.engine_process else engine.tokenizer
    served = ServedModel(name, tokenizer, info["vocab_size"], resolved.max_model_len, fingerprint)
    app = create_app(async_engine, server_config, served, refingerprint)
    grace = server_config.timeout_graceful_shutdown
    uv_config = uvicorn_config(app, server_config)

    def ready() -> None:
        where = f"engine process pid {engine.pid}" if server_config.engine_process else "engine thread"
        print(f"detinfer serve: model {name!r} ({resolved.mode}, {dtype}, {device}, max_model_len "
              f"{resolved.max_model_len}, {where}), fingerprint {fingerprint}: serving on {url}", flush=True)

    server = _draining_server_class()(uv_config, on_exit=lambda: async_engine.request_drain(grace), on_ready=ready)
    # uvicorn re-raises the signal that stopped it once it is done; exit 0 then instead of dying by it.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit_cleanly)
    try:
        server.run(sockets=[sock])
    finally:
        live = getattr(async_engine, "core", None)  # after a restart: not the core `_serve` started
        if live is not None and live is not engine:
            live.close()  # idempotent: normally the app's shutdown stopped it already
    return 0


def _exit_cleanly(_sig, _frame):
    raise SystemExit(0)


def _draining_server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn.Server that tells the engine to drain when a shutdown signal arrives, and reports
        readiness once the engine runs and the socket accepts connections."""

        def __init__(self, config, on_exit, on_ready):
            super().__init__(config)
            self._on_exit, self._on_ready = on_exit, on_ready

        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if not self.should_exit:
                self._on_ready()

        def handle_exit(self, sig, frame):
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if first:
                self._on_exit()

    return DrainingServer


if __name__ == "__main__":
    sys.exit(main())
