"""Limits on a request's header section, enforced in uvicorn's httptools protocol (one small subclass).

uvicorn bounds neither the size of a request's headers under httptools (its parser buffers a header until
the line ends, however long) nor the time a client may take to send them (the keep-alive timer only runs
between requests). So a client could hold a connection open forever by sending a header a byte a minute,
or make the server buffer megabytes of one header line. `guarded_protocol` returns uvicorn's
`HttpToolsProtocol` with three additions:

* header-read timeout: from the moment a connection opens (or the first byte of a later request on a
  keep-alive connection, even a bare CRLF) the request line and headers must be complete within
  `header_timeout` seconds; otherwise the connection is closed (after a 408 if part of a request had
  arrived). Bodies have their own limit (`--body-timeout`, checked where the body is read).
* header size: the request target plus every `name: value` line (with its separator and CRLF) may total at
  most `max_header_bytes`, and one header's name and value at most `max_header_field_bytes`; beyond either
  the request gets 431 with the server's JSON error body, and the connection is closed (what follows the
  oversized header on the wire cannot be trusted to be framed right; the close lingers, see `_send_error`).
* a memory bound while a header is still incomplete: bytes received during a header section are counted
  per read, so httptools never buffers more than the limit plus one read before the 431.

A parser callback refuses a request by raising `_Refused`; httptools turns it into an `HttpParserError`,
which uvicorn answers through `send_400_response`: that method sends our refusal instead.
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from detinfer.server import protocol as P

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}
_CODES = {408: "request_timeout", 431: "request_header_fields_too_large"}
LINGER_S = 2.0  # after a refusal, how long to keep reading (and discarding) before closing
_FIELD_OVERHEAD = 4  # ": " between name and value, CRLF after the value


class _Refused(Exception):
    """Raised in a parser callback to stop parsing a request that gets `status` (the refusal is stored on
    the protocol, since httptools replaces the exception by its own)."""


def error_response(status: int, message: str, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A complete HTTP/1.1 response with the server's JSON error body; the connection closes after it."""
    body = json.dumps(P.APIError(status, message, code=_CODES[status]).body()).encode()
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status])]
    lines += [name + b": " + value + b"\r\n" for name, value in default_headers]
    lines += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
              b"connection: close\r\n", b"\r\n", body]
    return b"".join(lines)


class HeaderGuardedProtocol(HttpToolsProtocol):
    """`HttpToolsProtocol` with the header limits above; `guarded_protocol` sets the three class attributes."""

    max_header_bytes: int
    max_header_field_bytes: int
    header_timeout: float

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._refusal: tuple[int, str] | None = None
        self._request_begun = False  # the parser has seen the start of the current request
        self._start_header_section()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()  # a connection that never sends a request is closed too

    def connection_lost(self, exc) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:
            return  # refused and answered: discard what the client still sends until the connection closes
        counted = self._in_header_section  # a read that began inside a header section counts whole
        if counted:
            self._header_read_bytes += len(data)
            # Any byte starts the next request's clock (also bare CRLFs, which the parser skips silently;
            # uvicorn has just cancelled its keep-alive timer).
            self._arm_header_timer()
        super().data_received(data)
        if (counted and self._in_header_section and self._refusal is None
                and self._header_read_bytes > self.max_header_bytes and not self.transport.is_closing()):
            self._refuse(431, f"the request's headers exceed the limit of {self.max_header_bytes} bytes")

    # -- parser callbacks ------------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._request_begun = True
        self._arm_header_timer()  # (already armed unless the request began in a read that began in a body)

    def on_url(self, url: bytes) -> None:
        self._count_header_bytes(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) + len(value) > self.max_header_field_bytes:
            shown = name[:64].decode("latin-1")
            self._refuse_in_parser(431, f"header {shown!r} is {len(name) + len(value)} bytes; the limit for one "
                                        f"header is {self.max_header_field_bytes}")
        self._count_header_bytes(len(name) + len(value) + _FIELD_OVERHEAD)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        self._in_header_section = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._start_header_section()  # what arrives next is the next request's header section
        self._request_begun = False

    def send_400_response(self, msg: str) -> None:
        if self._refusal is None:
            super().send_400_response(msg)
        else:
            self._send_error(*self._refusal)

    # -- the limits ------------------------------------------------------------------------------------------
    def _start_header_section(self) -> None:
        self._in_header_section = True
        self._header_bytes = 0  # exact: request target plus header lines, as parsed
        self._header_read_bytes = 0  # whole reads received while inside this header section

    def _count_header_bytes(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > self.max_header_bytes:
            self._refuse_in_parser(431, f"the request's headers exceed the limit of {self.max_header_bytes} bytes")

    def _refuse_in_parser(self, status: int, message: str):
        self._refusal = (status, message)
        raise _Refused(message)

    def _refuse(self, status: int, message: str) -> None:
        self._refusal = (status, message)
        self._send_error(status, message)

    def _send_error(self, status: int, message: str) -> None:
        self._disarm_header_timer()
        client = f"{self.client[0]}:{self.client[1]} - " if self.client else ""
        self.logger.warning("%s%d: %s", client, status, message)
        self.transport.write(error_response(status, message, self.server_state.default_headers))
        if self.transport.can_write_eof():
            # Lingering close: closing a socket with unread input makes the kernel send a reset, which can
            # destroy the answer before the client reads it (a client still sending its oversized header).
            # So end our side, discard the client's remaining bytes for a moment, then close.
            self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._header_timed_out)

    def _disarm_header_timer(self) -> None:
        timer, self._header_timer = self._header_timer, None
        if timer is not None:
            timer.cancel()

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        mid_response = self.cycle is not None and not self.cycle.response_complete
        if (self._request_begun or self._header_read_bytes) and not mid_response:
            self._refuse(408, f"the request's headers did not arrive within {self.header_timeout:g} s")
        else:  # nothing sent yet (just close, like an idle keep-alive connection), or a pipelined request
            self.transport.close()  # stalled while an earlier response streams: a 408 would corrupt that stream


def guarded_protocol(max_header_bytes: int, max_header_field_bytes: int, header_timeout: float) -> type:
    """uvicorn's httptools protocol class with these header limits (pass it as uvicorn.Config's `http`)."""
    return type("HeaderGuardedProtocol", (HeaderGuardedProtocol,), {
        "max_header_bytes": max_header_bytes, "max_header_field_bytes": max_header_field_bytes,
        "header_timeout": header_timeout})
