"""What both generation routes do around the engine: read and check the request, start a Generation, wait
for it or stream it, and map the engine front end's exceptions to HTTP answers."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import Request

from detinfer.server import protocol as P
from detinfer.server import responses as R
from detinfer.server.async_engine import (
    ClientDisconnected,
    EngineUnavailableError,
    QueueFullError,
    RequestAborted,
    RequestFailed,
    RequestTooLargeError,
)
from detinfer.server.context import ServerState
from detinfer.server.generation import ChoiceTracker, Generation
from detinfer.server.request_io import AbortingStream, check_auth, read_json, sse

log = logging.getLogger("detinfer.server")
IGNORED_FIELDS_HEADER = "X-Detinfer-Ignored-Fields"
_MAX_HEADER_CHARS = 1024


def ignored_fields_headers(req: Any) -> dict[str, str]:
    """Unknown top-level request fields are accepted (vLLM's behaviour) but reported: a warning in the log
    and the `X-Detinfer-Ignored-Fields` response header listing them (ASCII-escaped, bounded)."""
    fields = req.ignored_fields()
    if not fields:
        return {}
    names = ", ".join(f.encode("ascii", "backslashreplace").decode() for f in fields)
    names = "".join(c if c.isprintable() else "?" for c in names)[:_MAX_HEADER_CHARS]
    log.warning("request fields not supported by this server were ignored: %s", names)
    return {IGNORED_FIELDS_HEADER: names}


def state_of(request: Request) -> ServerState:
    return request.app.state.server


def check_model(state: ServerState, name: str) -> None:
    if name != state.model.name:
        raise P.APIError(404, f"model {name!r} does not exist; this server serves {state.model.name!r}",
                         param="model", code="model_not_found")


async def read_request(request: Request, model_cls: type) -> tuple[ServerState, Any]:
    """(server state, parsed request) for a generation route, in the order its errors are answered: the
    API key, the body (size and time limits), its fields (`model_cls`), then the served model's name."""
    state = state_of(request)
    check_auth(request, state.config.api_key)
    req = P.parse_request(model_cls, await read_json(request, state.config.max_request_bytes,
                                                     state.config.body_timeout))
    check_model(state, req.model)
    return state, req


def _ended_badly(e: Exception) -> P.APIError:
    """The answer for a request the engine ended without its output: failed alone and aborted (500), aborted
    by a shutdown (503), or lost with an engine that failed as a whole (500)."""
    if isinstance(e, RequestFailed):
        return P.APIError(500, f"this request failed in the engine and was aborted (the server keeps serving "
                          f"other requests): {e}", code="request_failed")
    if isinstance(e, RequestAborted):
        return P.APIError(503, f"request aborted: {e}")
    return P.APIError(500, str(e))


async def start_generation(state: ServerState, prompts: list[list[int]], params: Any, prefix: str) -> Generation:
    gen = Generation(state.engine, f"{prefix}-{uuid.uuid4().hex}", prompts, params)
    try:
        await gen.start()
    except QueueFullError as e:
        raise P.APIError(429, str(e), code="queue_full") from None
    except RequestTooLargeError as e:
        raise P.bad_request(str(e), param="prompt") from None
    except EngineUnavailableError as e:
        raise P.APIError(503, str(e)) from None
    except RequestFailed as e:
        raise _ended_badly(e) from None
    except (ValueError, TypeError) as e:  # refused by the engine (the server checks most of it first)
        raise P.bad_request(str(e), param="prompt") from None
    return gen


async def run_to_end(gen: Generation, request: Request) -> list[Any]:
    async def client_gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    try:
        return await gen.run_to_end(client_gone)
    except ClientDisconnected:  # nobody reads this answer; the status is for the logs and metrics
        raise P.APIError(499, "client disconnected", code="client_closed_request") from None
    except (RequestAborted, RequestFailed, EngineUnavailableError) as e:
        raise _ended_badly(e) from None


def usage(gen: Generation) -> R.Usage:
    prompt, completion = gen.token_counts()
    return R.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def count_finishes(state: ServerState, reasons: list[str | None]) -> None:
    for reason in reasons:
        state.engine.metrics.finished.inc(finish_reason=reason or "abort")


def stream_response(gen: Generation, req: Any, emit: Callable, aborted: Callable, usage_chunk: Callable,
                    headers: dict[str, str] | None = None) -> AbortingStream:
    """SSE: for each new part of a choice (`ChoiceTracker.deltas`), `emit(prompt index, output, choice index,
    text, logprob entries, finish_reason, token ids)` yields its chunks (every finish is counted here); once
    every prompt finished, `usage_chunk(usage)` if `req.stream_options` asks for it; if the server shuts down,
    `aborted(choice index)` is the chunk that closes each open choice with "abort"; ends with [DONE] in every
    case."""
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    async def body():
        choices = ChoiceTracker(gen.params.n)
        try:
            async for i, out in gen.updates():
                for c, text, entries, finish, ids in choices.deltas(i, out):
                    if finish is not None:
                        gen.engine.metrics.finished.inc(finish_reason=finish)
                    for chunk in emit(i, out, c, text, entries, finish, ids):
                        yield sse(chunk)
                if include_usage and all(x is not None and x.finished for x in gen.latest):
                    yield sse(usage_chunk(usage(gen)))
        except RequestAborted:  # server shutdown: close every open choice with "abort"
            for c in range(len(gen.prompts) * gen.params.n):
                if c not in choices.finished:
                    gen.engine.metrics.finished.inc(finish_reason="abort")
                    yield sse(aborted(c))
        except (RequestFailed, EngineUnavailableError) as e:
            yield sse(_ended_badly(e).body())
        yield b"data: [DONE]\n\n"

    return AbortingStream(body(), on_close=gen.abort, media_type="text/event-stream",
                          headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})


def json_response(model: Any, headers: dict[str, str] | None = None):
    from fastapi.responses import Response

    return Response(model.model_dump_json(), media_type="application/json", headers=headers)
