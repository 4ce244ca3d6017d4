"""Reading requests and guarding the door: Host header, API key, Content-Type, the body itself.

Request bodies are read and parsed here instead of through FastAPI's body injection, so that every failure
(wrong content type, body too large or too slow, invalid UTF-8, invalid JSON, NaN/Infinity literals, lone
surrogates) becomes one OpenAI-shaped 4xx, and the handlers only see valid input.

Why the Content-Type and Host checks: a web page in a browser may POST to any address with a "simple"
request (text/plain, no CORS preflight), and through DNS rebinding may even read the answer. Insisting on
a JSON content type forces a preflight (which this server never approves); without an API key, insisting
that the Host header names this machine defeats rebinding (the page's Host is the attacker's name).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from detinfer.server import protocol as P


def _json(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _first_bad_string(data: Any) -> str | None:
    """Path of the first string holding a lone surrogate (valid JSON escapes, but not encodable text)."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, x = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(x, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in x.items())
            stack.extend((path or "body", k) for k in x)
        elif isinstance(x, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(x))
    return None


def is_json_content_type(value: str | None) -> bool:
    """application/json or application/<something>+json, parameters (charset) allowed."""
    if not value:
        return False
    media = value.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def read_json(request: Request, limit: int, timeout: float) -> Any:
    """The body as JSON (after the Content-Type check); 413 past `limit` bytes, 408 past `timeout` s."""
    content_type = request.headers.get("content-type")
    if not is_json_content_type(content_type):
        raise P.APIError(415, f"Content-Type must be application/json, got {content_type or 'none'}",
                         code="unsupported_media_type")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise P.APIError(413, f"request body is {declared} bytes; the limit is {limit}")
    body = bytearray()

    async def read() -> None:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise P.APIError(413, f"request body exceeds the limit of {limit} bytes")

    try:
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise P.APIError(408, f"the request body did not arrive within {timeout:g} s",
                         code="request_timeout") from None
    try:
        text = bytes(body).decode("utf-8")
    except UnicodeDecodeError as e:
        raise P.bad_request(f"request body is not valid UTF-8 (byte {e.start})") from None
    if not text.strip():
        raise P.bad_request("request body is empty; expected a JSON object")
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise P.bad_request(f"invalid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    except (ValueError, RecursionError) as e:
        raise P.bad_request(f"invalid JSON: {e}") from None
    bad = _first_bad_string(data)
    if bad is not None:
        raise P.bad_request(f"{bad}: string is not valid Unicode (lone surrogate)", param=bad)
    return data


def check_auth(request: Request, api_key: str | None) -> None:
    """`Authorization: Bearer <key>` (scheme case-insensitive, key compared in constant time)."""
    if api_key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
    ok = scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), api_key.encode())
    if not ok:
        raise P.APIError(401, "missing or wrong API key (Authorization: Bearer <key>)", code="invalid_api_key")


def host_name(host_header: str) -> str:
    """'Example.com:8000' -> 'example.com'; '[::1]:8000' -> '::1'."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


class HostCheck:
    """ASGI middleware: refuse (403) requests whose Host header is not in `allowed` (None: allow any).
    Requests without a Host header are not from a browser and pass."""

    def __init__(self, app, allowed: frozenset[str] | None):
        self.app, self.allowed = app, allowed

    async def __call__(self, scope, receive, send):
        if self.allowed is not None and scope["type"] == "http":
            raw = dict(scope.get("headers") or ()).get(b"host")
            host = host_name(raw.decode("latin-1")) if raw is not None else None
            if host is not None and host not in self.allowed:
                err = P.APIError(403, f"Host {host!r} is not allowed: without --api-key this server only answers "
                                 "requests addressed to this machine (localhost, 127.0.0.1, [::1], --host); "
                                 "add the name with --allowed-hosts", code="host_not_allowed")
                body = _json(err.body())
                await send({"type": "http.response.start", "status": 403,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


class AbortingStream(StreamingResponse):
    """A streaming response that runs `on_close` however it ends. Starlette cancels the response when
    the client disconnects; the body generator may then be suspended at a `yield` and only finalized at
    garbage collection, so its own `finally` is not a reliable place to free the engine request."""

    def __init__(self, content: Any, *, on_close: Callable[[], None], **kwargs: Any):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse(payload: Any) -> bytes:
    data = payload.model_dump_json() if hasattr(payload, "model_dump_json") else _json(payload).decode()
    return f"data: {data}\n\n".encode()
