"""`ServerConfig`: how the HTTP server listens and what it admits (one frozen dataclass; the CLI flags of
`detinfer serve` are generated from its fields, so flags, defaults and validation cannot drift apart)."""

from __future__ import annotations

from dataclasses import dataclass, field

from detinfer.engine.config import check_float, check_int

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# Host names a browser can only reach on this machine; always allowed by the Host-header check.
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
WILDCARD_ADDRESSES = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP server listens and what it admits. Validated on construction."""

    host: str = field(default="127.0.0.1", metadata={"help": "Address to bind (0.0.0.0: every interface)."})
    port: int = field(default=8000, metadata={"help": "TCP port to listen on (0: any free port)."})
    served_model_name: str | None = field(default=None, metadata={
        "help": "Model name clients send in `model`; default: the model directory's name."})
    api_key: str | None = field(default=None, metadata={
        "help": "If set, require `Authorization: Bearer <key>` on /v1 routes."})
    enable_admin_endpoints: bool = field(default=False, metadata={
        "help": "Serve the /admin routes (load weights, reset the prefix cache, weights fingerprint; "
                "docs/rollout-server.md) without an API key: local use only. With --api-key they are on and "
                "require the key."})
    allowed_hosts: str | None = field(default=None, metadata={
        "help": "Without --api-key, requests must name this machine in their Host header (localhost, "
                "127.0.0.1, [::1] or --host), so a web page cannot reach the server through DNS rebinding. "
                "Comma-separated extra host names to accept; '*' accepts any."})
    max_pending_requests: int = field(default=1024, metadata={
        "help": "Most generation requests in flight (queued or running; one per prompt); beyond it requests "
                "get HTTP 429, and a request with more prompts than this gets 400."})
    max_n: int = field(default=16, metadata={"help": "Largest `n` (samples per prompt) a request may ask for."})
    max_logprobs: int = field(default=20, metadata={
        "help": "Largest `logprobs` / `top_logprobs` a request may ask for."})
    max_temperature: float = field(default=2.0, metadata={
        "help": "Largest `temperature` a request may ask for (OpenAI's limit is 2)."})
    max_request_bytes: int = field(default=4 << 20, metadata={"help": "Largest request body, in bytes (413)."})
    body_timeout: float = field(default=30.0, metadata={
        "help": "Seconds a client may take to send a request body (408 after that)."})
    header_timeout: float = field(default=30.0, metadata={
        "help": "Seconds a client may take to send a request's line and headers, counted from when the connection "
                "opens (or from a later request's first byte); then the connection is closed (408 if part of a "
                "request arrived)."})
    max_header_bytes: int = field(default=64 << 10, metadata={
        "help": "Largest request header section (request target plus all header lines), in bytes (431)."})
    max_header_field_bytes: int = field(default=16 << 10, metadata={
        "help": "Largest single header (name plus value), in bytes (431)."})
    timeout_keep_alive: float = field(default=5.0, metadata={
        "help": "Seconds an idle keep-alive connection stays open."})
    limit_concurrency: int = field(default=4096, metadata={
        "help": "Most open connections and in-flight HTTP requests; beyond it new requests get HTTP 503."})
    timeout_graceful_shutdown: float = field(default=30.0, metadata={
        "help": "On SIGINT/SIGTERM, seconds to let in-flight requests finish before aborting them."})
    uvicorn_log_level: str = field(default="info", metadata={"help": "uvicorn's log level.",
                                                             "choices": LOG_LEVELS})
    device: str | None = field(default=None, metadata={
        "help": "Torch device for the engine (cuda, cuda:1, cpu); default: cuda if available, else cpu."})
    engine_process: bool = field(default=True, metadata={
        "help": "Run the engine core (scheduler, model, sampler, detokenizer) in its own process, so HTTP work and "
                "engine steps never wait for each other's GIL. --no-engine-process steps the engine on a thread of "
                "the server process instead (debugging, profiling in one process); outputs are bit-identical."})
    max_core_restarts: int = field(default=3, metadata={
        "help": "With the engine core in its own process: how many times within 10 minutes the server starts a fresh "
                "core (same model and flags) after the core died (crash, kill); requests in flight fail, new ones get "
                "503 until it is ready. Beyond it the server stays down (503). 0: never restart."})
    gil_switch_interval_ms: float = field(default=20.0, metadata={
        "help": "Python's thread switch interval in ms (sys.setswitchinterval). With --no-engine-process the "
                "engine thread and the HTTP event loop share the GIL: a longer interval lets one engine step issue its "
                "kernels without being preempted by per-token streaming work. Measured on an H100 (8B model, 64 "
                "streams, engine thread): 5 ms (Python's default) 2120 output tok/s, 20 ms 2235, 50 ms 2252."})

    def __post_init__(self):
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be a non-empty string, got {self.host!r}")
        check_int("port", self.port, minimum=0, maximum=65535)
        for name in ("served_model_name", "api_key", "device", "allowed_hosts"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string or None, got {value!r}")
        check_int("max_pending_requests", self.max_pending_requests, minimum=1)
        check_int("max_n", self.max_n, minimum=1)
        check_int("max_logprobs", self.max_logprobs, minimum=0)
        # The sampler divides float32 logits by the temperature: it must stay a finite float32.
        check_float("max_temperature", self.max_temperature, minimum=0.0, maximum=1e4)
        check_int("max_request_bytes", self.max_request_bytes, minimum=1024)
        check_float("body_timeout", self.body_timeout, minimum=0.0, min_exclusive=True)
        check_float("header_timeout", self.header_timeout, minimum=0.0, min_exclusive=True)
        check_int("max_header_bytes", self.max_header_bytes, minimum=1024)
        check_int("max_header_field_bytes", self.max_header_field_bytes, minimum=256)
        if self.max_header_field_bytes > self.max_header_bytes:
            raise ValueError(f"max_header_field_bytes ({self.max_header_field_bytes}) must not exceed "
                             f"max_header_bytes ({self.max_header_bytes}): one header is part of the header section")
        check_float("timeout_keep_alive", self.timeout_keep_alive, minimum=0.0, min_exclusive=True)
        check_int("limit_concurrency", self.limit_concurrency, minimum=1)
        check_float("timeout_graceful_shutdown", self.timeout_graceful_shutdown, minimum=0.0)
        for name in ("engine_process", "enable_admin_endpoints"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        check_int("max_core_restarts", self.max_core_restarts, minimum=0)
        check_float("gil_switch_interval_ms", self.gil_switch_interval_ms, minimum=0.0, min_exclusive=True)
        if self.uvicorn_log_level not in LOG_LEVELS:
            raise ValueError(f"uvicorn_log_level must be one of {LOG_LEVELS}, got {self.uvicorn_log_level!r}")

    def host_allowlist(self) -> frozenset[str] | None:
        """Host names (lower case, no port, IPv6 without brackets) the Host-header check accepts; None:
        any (an API key is set, or --allowed-hosts '*')."""
        extra = [h.strip().lower().strip("[]") for h in (self.allowed_hosts or "").split(",") if h.strip()]
        if self.api_key is not None or "*" in extra:
            return None
        bind = self.host.lower().strip("[]")
        return frozenset([*LOCAL_HOSTS, *extra, *([] if bind in WILDCARD_ADDRESSES else [bind])])
