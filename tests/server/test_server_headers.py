"""Request-header limits over real sockets: an oversized header section or header gets 431 (the server's JSON
error body) and the server goes on serving; a client that stalls while sending its headers is disconnected
after --header-timeout (408 if part of a request arrived), on a fresh or a keep-alive connection; a request
whose answer takes longer than that timeout is unaffected. The limits and the timeout are validated flags."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from detinfer.server.config import ServerConfig

HEADER_TIMEOUT_S = 1.0
# Only a guard against a hang: a stalled client must be gone long before this (the check is the timeout,
# not how fast this machine is).
DISCONNECT_BOUND_S = 20.0
DEFAULTS = ServerConfig()


@pytest.fixture(scope="module")
def srv(start_server):
    return start_server("--header-timeout", str(HEADER_TIMEOUT_S))


def _address(server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _connect(server) -> socket.socket:
    sock = socket.create_connection(_address(server), timeout=DISCONNECT_BOUND_S)
    sock.settimeout(DISCONNECT_BOUND_S)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    out = bytearray()
    while chunk := sock.recv(65536):
        out += chunk
    return bytes(out)


def _status_and_json(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"content-type: application/json" in head.lower(), head
    return status, json.loads(body)


def _exchange(server, request: bytes, piece: int | None = None) -> bytes:
    """Send `request` (in pieces of `piece` bytes if given) and read the answer until the server closes."""
    with _connect(server) as sock:
        try:
            for i in range(0, len(request), piece or len(request)):
                sock.sendall(request[i:i + (piece or len(request))])
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server refused before the end: its answer is still readable
        return _read_until_closed(sock)


def _health(server) -> int:
    return httpx.get(f"{server.url}/health", timeout=60.0).status_code


def _get(extra_headers: bytes) -> bytes:
    return b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + extra_headers + b"\r\n"


def test_a_200kb_header_is_431_and_the_server_keeps_serving(srv):
    r = httpx.get(f"{srv.url}/health", headers={"x-big": "a" * 200_000}, timeout=60.0)
    assert r.status_code == 431, r.text
    assert r.json()["error"]["code"] == "request_header_fields_too_large"
    assert str(DEFAULTS.max_header_bytes) in r.json()["error"]["message"]
    assert _health(srv) == 200
    r = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny-llama", "prompt": "Hello", "max_tokens": 2},
                   timeout=60.0)
    assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text


def test_too_many_header_bytes_in_all_is_431(srv):
    per = DEFAULTS.max_header_field_bytes // 2  # each header well within the one-header limit
    count = DEFAULTS.max_header_bytes // per + 1
    headers = b"".join(b"X-H%d: %s\r\n" % (i, b"b" * per) for i in range(count))
    status, body = _status_and_json(_exchange(srv, _get(headers)))
    assert status == 431 and "exceed the limit" in body["error"]["message"], body
    assert _health(srv) == 200


def test_one_header_over_its_limit_is_431_naming_it_and_one_under_is_served(srv):
    limit = DEFAULTS.max_header_field_bytes
    status, body = _status_and_json(_exchange(srv, _get(b"X-Long: " + b"c" * limit + b"\r\n")))
    assert status == 431 and "X-Long" in body["error"]["message"] and str(limit) in body["error"]["message"]
    ok = _exchange(srv, _get(b"X-Long: " + b"c" * (limit - 100) + b"\r\n"))
    assert ok.startswith(b"HTTP/1.1 200 "), ok[:200]


def test_an_unended_oversized_header_is_refused_before_it_ends(srv):
    # The header never ends: the server must not wait for (and buffer) all of it before answering.
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Endless: " + b"d" * (3 * DEFAULTS.max_header_bytes)
    status, body = _status_and_json(_exchange(srv, request, piece=8192))
    assert status == 431, body
    assert _health(srv) == 200


def test_a_stalled_header_is_disconnected_after_the_timeout(srv):
    with _connect(srv) as sock:
        t0 = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")  # ... and stall
        raw = _read_until_closed(sock)
        elapsed = time.monotonic() - t0
    status, body = _status_and_json(raw)
    assert status == 408 and body["error"]["code"] == "request_timeout", body
    assert HEADER_TIMEOUT_S * 0.9 <= elapsed < DISCONNECT_BOUND_S, elapsed
    assert _health(srv) == 200


def test_a_silent_connection_is_closed_after_the_timeout(srv):
    with _connect(srv) as sock:
        t0 = time.monotonic()
        assert _read_until_closed(sock) == b""  # nothing was asked: closed without an answer
        assert HEADER_TIMEOUT_S * 0.9 <= time.monotonic() - t0 < DISCONNECT_BOUND_S


def test_a_stalled_header_on_a_keep_alive_connection_is_disconnected(srv):
    with _connect(srv) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        first = bytearray()
        while not first.endswith(b"}"):  # /health's JSON body; the connection stays open
            first += sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 "), first
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")  # the next request stalls
        status, body = _status_and_json(_read_until_closed(sock))
    # 408 (not the keep-alive timer's silent close): the header timer ran for this request
    assert status == 408 and body["error"]["code"] == "request_timeout", body


def test_bare_line_breaks_do_not_keep_a_connection_open(srv):
    """The parser skips empty lines between requests; they still count as the next request's start (each
    byte cancels uvicorn's keep-alive timer, so without this a client could trickle CRLFs forever)."""
    with _connect(srv) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        first = bytearray()
        while not first.endswith(b"}"):
            first += sock.recv(65536)
        sock.settimeout(0.2)
        answer, deadline = bytearray(), time.monotonic() + DISCONNECT_BOUND_S
        while time.monotonic() < deadline:
            try:
                sock.sendall(b"\r\n")
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            if not chunk:
                break
            answer += chunk
    status, body = _status_and_json(bytes(answer))
    assert status == 408 and body["error"]["code"] == "request_timeout", body


def test_an_answer_slower_than_the_header_timeout_is_unaffected(srv):
    srv.gate.hold_after(0)  # the engine core holds before its next step: the answer waits
    try:
        with httpx.Client(base_url=srv.url, timeout=60.0) as c:
            result = {}
            body = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 2}
            t = threading.Thread(target=lambda: result.update(r=c.post("/v1/completions", json=body)))
            t.start()
            srv.gate.wait_held(unfinished=1)
            time.sleep(3 * HEADER_TIMEOUT_S)  # the request is in; its headers were complete long ago
            srv.gate.release()
            t.join(60.0)
        assert result["r"].status_code == 200, result["r"].text
    finally:
        srv.gate.release()


# -- flags ------------------------------------------------------------------------------------------------
def test_header_flags_are_parsed_and_validated():
    from detinfer.engine.config import from_args
    from detinfer.server.serve import build_parser

    ns = build_parser().parse_args(["m", "--header-timeout", "2.5", "--max-header-bytes", "4096",
                                    "--max-header-field-bytes", "1024"])
    cfg = from_args(ServerConfig, ns)
    assert (cfg.header_timeout, cfg.max_header_bytes, cfg.max_header_field_bytes) == (2.5, 4096, 1024)
    assert (DEFAULTS.header_timeout, DEFAULTS.max_header_bytes, DEFAULTS.max_header_field_bytes) == (
        30.0, 64 << 10, 16 << 10)
    for kw, words in [({"header_timeout": 0}, "header_timeout"), ({"header_timeout": float("inf")}, "finite"),
                      ({"max_header_bytes": 100}, "max_header_bytes"),
                      ({"max_header_field_bytes": 10}, "max_header_field_bytes"),
                      ({"max_header_bytes": 2048, "max_header_field_bytes": 4096}, "must not exceed")]:
        with pytest.raises(ValueError, match=words):
            ServerConfig(**kw)


def test_uvicorn_runs_the_guarded_httptools_protocol():
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from detinfer.server.serve import uvicorn_config

    async def app(scope, receive, send):  # pragma: no cover - never called
        pass

    cfg = uvicorn_config(app, ServerConfig(header_timeout=7.0, max_header_bytes=9000, max_header_field_bytes=3000))
    cfg.load()
    cls = cfg.http_protocol_class
    assert issubclass(cls, HttpToolsProtocol)
    assert (cls.header_timeout, cls.max_header_bytes, cls.max_header_field_bytes) == (7.0, 9000, 3000)
