"""How `core.EngineCore`'s commands and events cross between a front end (the API server, or
`LLM(engine_process=True)`) and the engine core process.

Transport: one socketpair, length-prefixed frames (8-byte big-endian length, then the body). A body is one
pickled message, one of core.py's dataclasses. Only the two processes of one detinfer instance hold the ends
of the pair, so pickle's trust model fits; its C implementation keeps encoding cheap, and Python floats cross
as their exact 8 bytes, so logprobs arrive bit-identical.

A prompt given as token ids crosses as `array('i')` bytes. Outputs cross as deltas: `LLMEngine.step()`
returns cumulative outputs, so resending them would cost O(length^2); `OutputEncoder` (core) sends what is
new since the last step and `OutputAssembler` (front end) rebuilds the same cumulative `RequestOutput`s.
"""

from __future__ import annotations

import dataclasses
import pickle
import select
import socket
import struct
import time
from array import array
from collections.abc import Callable
from typing import Any

from detinfer.engine.core import AddRequests
from detinfer.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob

HEADER = struct.Struct("!Q")
_INT32 = (-(1 << 31), (1 << 31) - 1)


def pack(message: Any) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


def send(sock: socket.socket, message: Any) -> None:
    sock.sendall(pack(message))


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("the other process closed the connection")
        got += k
    return bytes(buf)


def recv(sock: socket.socket) -> Any:
    """The next message; EOFError when the other end closed (or died)."""
    (length,) = HEADER.unpack(_recv_exactly(sock, HEADER.size))
    return pickle.loads(_recv_exactly(sock, length))


def drain_until_closed(sock: socket.socket, timeout: float) -> bool:
    """Read and drop whatever the other end still sends until it closes (True) or `timeout` passes (False).
    Used after `Shutdown`: a core blocked writing outputs nobody reads any more can then see the message."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if select.select([sock], [], [], left)[0] and not sock.recv(1 << 20):
            return True
    return False


class FrameReader:
    """Incremental decoder for a non-blocking reader (asyncio): feed bytes, get whole messages."""

    def __init__(self):
        self._buf = bytearray()

    def feed(self, data: bytes) -> list:
        self._buf += data
        out, pos, buf = [], 0, self._buf
        while len(buf) - pos >= HEADER.size:
            (length,) = HEADER.unpack_from(buf, pos)
            end = pos + HEADER.size + length
            if len(buf) < end:
                break
            out.append(pickle.loads(memoryview(buf)[pos + HEADER.size:end]))
            pos = end
        del buf[:pos]
        return out


def encode_prompt(prompt: Any) -> Any:
    """Token ids as array('i') bytes (compact, one memcpy each way); text and anything else as is (the core's
    add_request gives the error for an invalid prompt, exactly as in-process)."""
    if isinstance(prompt, (list, tuple)) and all(type(t) is int and _INT32[0] <= t <= _INT32[1] for t in prompt):
        return array("i", prompt).tobytes()
    return prompt


def decode_prompt(prompt: Any) -> Any:
    return array("i", prompt).tolist() if isinstance(prompt, bytes) else prompt


def _map_prompts(command: Any, fn: Callable[[Any], Any]) -> Any:
    if not isinstance(command, AddRequests):
        return command
    return dataclasses.replace(command, requests=tuple((r, fn(p), sp) for r, p, sp in command.requests))


def encode_prompts(command: Any) -> Any:
    """An `AddRequests` with its prompts encoded for the wire (any other command as is)."""
    return _map_prompts(command, encode_prompt)


def decode_prompts(command: Any) -> Any:
    """The inverse of encode_prompts, in the core."""
    return _map_prompts(command, decode_prompt)


# -- output deltas ----------------------------------------------------------------------------------------
def _lp_tuple(e: TokenLogprob) -> tuple:
    return e.token_id, e.logprob, e.rank, tuple(e.top_logprobs), tuple(e.top_logprobs.values())


def _lp_entry(t: tuple) -> TokenLogprob:
    return TokenLogprob(t[0], t[1], t[2], dict(zip(t[3], t[4])))


class OutputEncoder:
    """Core side: cumulative RequestOutputs -> deltas. A request's first delta carries its prompt; every
    delta says where its new part starts, so the assembler never has to guess."""

    def __init__(self):
        self._sent: dict[str, list] = {}  # request id -> [prompt logprobs sent, {index: [chars, tokens, lps]}]

    def encode(self, out: RequestOutput) -> tuple:
        state = self._sent.get(out.request_id)
        first = None
        if state is None:
            state = self._sent[out.request_id] = [0, {}]
            first = (out.prompt, array("i", out.prompt_token_ids).tobytes())
        plp = None
        if out.prompt_logprobs is not None:
            start = state[0]
            plp = (start, tuple(_lp_tuple(e) for e in out.prompt_logprobs[1 + start:]))
            state[0] = len(out.prompt_logprobs) - 1
        samples = []
        for o in out.outputs:
            chars, toks, lps = state[1].get(o.index, (0, 0, 0))
            new_lps = None if o.logprobs is None else tuple(_lp_tuple(e) for e in o.logprobs[lps:])
            samples.append((o.index, chars, o.text[chars:], toks, array("i", o.token_ids[toks:]).tobytes(),
                            o.cumulative_logprob, lps, new_lps, o.finish_reason, o.stop_reason))
            state[1][o.index] = (len(o.text), len(o.token_ids), 0 if o.logprobs is None else len(o.logprobs))
        if out.finished:
            del self._sent[out.request_id]
        return out.request_id, first, plp, tuple(samples), out.finished, out.error


class _Sample:
    __slots__ = ("text", "tokens", "logprobs")

    def __init__(self):
        self.text, self.tokens, self.logprobs = "", [], []


class OutputAssembler:
    """Front-end side: deltas -> the cumulative RequestOutputs the in-process engine would have returned."""

    def __init__(self):
        self._reqs: dict[str, list] = {}  # request id -> [prompt, prompt ids, prompt logprobs, {index: _Sample}]

    def apply_step(self, deltas: tuple, keep: Callable[[str], bool] = lambda request_id: True) -> list[RequestOutput]:
        """One step's RequestOutputs, for the requests `keep` accepts; the others are forgotten (aborted by the
        front end already, or refused as part of an add)."""
        outs = []
        for delta in deltas:
            if not keep(delta[0]):
                self._reqs.pop(delta[0], None)
            elif (out := self.apply(delta)) is not None:
                outs.append(out)
        return outs

    def apply(self, delta: tuple) -> RequestOutput | None:
        """The request's RequestOutput after this delta; None for a request this side does not track (its
        first delta was never seen because it was forgotten)."""
        request_id, first, plp, samples, finished, error = delta
        req = self._reqs.get(request_id)
        if req is None:
            if first is None:
                return None
            req = self._reqs[request_id] = [first[0], tuple(array("i", first[1])), [], {}]
        prompt_lp = None
        if plp is not None:
            req[2][plp[0]:] = [_lp_entry(t) for t in plp[1]]
            prompt_lp = (None, *req[2])
        outs = []
        for index, chars, text, toks, tok_bytes, cum, lps, new_lps, finish, stop in samples:
            s = req[3].get(index)
            if s is None:
                s = req[3][index] = _Sample()
            s.text = s.text[:chars] + text
            s.tokens[toks:] = array("i", tok_bytes)
            if new_lps is not None:
                s.logprobs[lps:] = [_lp_entry(t) for t in new_lps]
            outs.append(CompletionOutput(index=index, text=s.text, token_ids=tuple(s.tokens), cumulative_logprob=cum,
                                         logprobs=None if new_lps is None else tuple(s.logprobs),
                                         finish_reason=finish, stop_reason=stop))
        if finished:
            del self._reqs[request_id]
        return RequestOutput(request_id, req[0], req[1], prompt_lp, tuple(outs), finished,
                             error if finished else None)
