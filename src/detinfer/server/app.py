"""FastAPI app: OpenAI-compatible routes over an `AsyncEngine`.

Request bodies are read and parsed here instead of through FastAPI's body injection, so that every failure
(body too large, invalid UTF-8, invalid JSON, NaN/Infinity literals, lone surrogates, wrong types, values
out of range) becomes one OpenAI-shaped 4xx that names the field, and the handlers only see valid input.

A generation request becomes one engine request per prompt (each with the request's `n` samples); choice
`i * n + j` is sample j of prompt i, as in OpenAI's API. Whatever way a handler exits (finished, client
gone, error) its `finally` aborts any engine request still running, so no KV blocks outlive their client.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from detinfer.engine.sampling_params import SamplingParams
from detinfer.server import protocol as P
from detinfer.server.async_engine import (
    AsyncEngine,
    ChoiceTracker,
    ClientDisconnected,
    EngineUnavailableError,
    Generation,
    QueueFullError,
    RequestAborted,
)
from detinfer.server.metrics import HTTPRequestCounter
from detinfer.server.serve import ServerConfig

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{id}", "/health", "/metrics")


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


async def read_json(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise P.APIError(413, f"request body is {declared} bytes; the limit is {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise P.APIError(413, f"request body exceeds the limit of {limit} bytes")
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


class _AbortingStream(StreamingResponse):
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


def _sse(payload: Any) -> bytes:
    data = payload.model_dump_json() if hasattr(payload, "model_dump_json") else _json(payload).decode()
    return f"data: {data}\n\n".encode()


def create_app(engine: AsyncEngine, config: ServerConfig, *, model_name: str, fingerprint: str) -> FastAPI:
    tokenizer = engine.engine.tokenizer
    max_model_len = _max_model_len(engine.engine)
    vocab_size = int(getattr(engine.engine.model_config, "vocab_size", 0)) or tokenizer.vocab_size
    formatter = P.TokenFormatter(tokenizer)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(_app):
        engine.start()
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(title="detinfer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(HTTPRequestCounter, metrics=engine.metrics, routes=ROUTES)

    @app.exception_handler(P.APIError)
    async def _api_error(_request, exc: P.APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        return JSONResponse(P.APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(_request, exc: Exception):
        return JSONResponse(P.APIError(500, f"internal error: {exc!r}").body(), status_code=500)

    def check_auth(request: Request) -> None:
        if config.api_key is not None and request.headers.get("authorization") != f"Bearer {config.api_key}":
            raise P.APIError(401, "missing or wrong API key (Authorization: Bearer <key>)", code="invalid_api_key")

    def check_model(name: str) -> None:
        if name != model_name:
            raise P.APIError(404, f"model {name!r} does not exist; this server serves {model_name!r}",
                             param="model", code="model_not_found")

    def check_limit(value: int | None, limit: int, param: str) -> None:
        if value is not None and value > limit:
            raise P.bad_request(f"{param} must be at most {limit}, got {value}", param=param)

    def check_ids(ids: list[int], param: str) -> list[int]:
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise P.bad_request(f"{param}: token id {bad} is outside the vocabulary [0, {vocab_size})", param=param)
        return ids

    def check_length(ids: list[int], max_tokens: int | None, param: str) -> None:
        if not ids:
            raise P.bad_request(f"{param} encodes to zero tokens", param=param)
        if len(ids) >= max_model_len:
            raise P.bad_request(f"{param} is {len(ids)} tokens; this model's context is {max_model_len} tokens "
                                f"(room is needed for at least one output token)", param=param,
                                code="context_length_exceeded")
        if max_tokens is not None and len(ids) + max_tokens > max_model_len:
            raise P.bad_request(f"this model's context is {max_model_len} tokens, but {len(ids)} prompt tokens "
                                f"+ max_tokens {max_tokens} exceed it", param="max_tokens",
                                code="context_length_exceeded")

    def sampling_params(req: Any, **kw: Any) -> SamplingParams:
        stop = [req.stop] if isinstance(req.stop, str) else req.stop or []
        fields = dict(n=req.n or 1, temperature=_default(req.temperature, 1.0), top_p=_default(req.top_p, 1.0),
                      top_k=_default(req.top_k, 0), min_p=_default(req.min_p, 0.0),
                      presence_penalty=_default(req.presence_penalty, 0.0),
                      frequency_penalty=_default(req.frequency_penalty, 0.0),
                      repetition_penalty=_default(req.repetition_penalty, 1.0), seed=req.seed, stop=tuple(stop),
                      stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos, **kw)
        check_limit(fields["n"], config.max_n, "n")
        try:
            return SamplingParams(**fields)
        except (ValueError, TypeError) as e:  # the message starts with the field's name
            raise P.bad_request(str(e), param=str(e).split(" ", 1)[0]) from None

    async def generate(prompts: list[list[int]], params: SamplingParams, prefix: str) -> Generation:
        gen = Generation(engine, f"{prefix}-{uuid.uuid4().hex}", prompts, params)
        try:
            await gen.start()
        except QueueFullError as e:
            raise P.APIError(429, str(e), code="queue_full") from None
        except EngineUnavailableError as e:
            raise P.APIError(503, str(e)) from None
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
        except RequestAborted as e:
            raise P.APIError(503, f"request aborted: {e}") from None
        except EngineUnavailableError as e:
            raise P.APIError(500, str(e)) from None

    def usage(gen: Generation) -> P.Usage:
        prompt, completion = gen.token_counts()
        return P.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def stream_response(gen: Generation, emit: Callable, final: Callable) -> StreamingResponse:
        async def body():
            choices = ChoiceTracker(gen.params.n)
            try:
                async for i, out in gen.updates():
                    for chunk in emit(choices, i, out):
                        yield _sse(chunk)
            except RequestAborted:  # server shutdown: close every open choice with "abort"
                for chunk in final(choices):
                    yield _sse(chunk)
            except EngineUnavailableError as e:
                yield _sse(P.APIError(500, str(e)).body())
            yield b"data: [DONE]\n\n"

        return _AbortingStream(body(), on_close=gen.abort, media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def count_finishes(choices_finish: list[str | None]) -> None:
        for reason in choices_finish:
            engine.metrics.finished.inc(finish_reason=reason or "abort")

    # ---- routes ----------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not engine.is_healthy:
            raise P.APIError(503, "the engine is not running")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def card() -> P.ModelCard:
        return P.ModelCard(id=model_name, created=started, max_model_len=max_model_len)

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        return Response(P.ModelList(data=[card()]).model_dump_json(), media_type="application/json")

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        check_auth(request)
        check_model(model_id)
        return Response(card().model_dump_json(), media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_auth(request)
        req = P.parse_request(P.CompletionRequest, await read_json(request, config.max_request_bytes))
        check_model(req.model)
        n = req.n or 1
        if req.best_of is not None and req.best_of != n:
            raise P.bad_request("best_of must equal n (every sample is returned)", param="best_of")
        check_limit(req.logprobs, config.max_logprobs, "logprobs")
        prompts = [check_ids(p, "prompt") if isinstance(p, list) else tokenizer.encode(p)
                   for p in P.normalize_prompt(req.prompt)]
        for ids in prompts:
            check_length(ids, req.max_tokens, "prompt")
        echo = bool(req.echo)
        params = sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs,
                                 prompt_logprobs=req.logprobs if echo and req.logprobs is not None else None)
        prompt_text = [tokenizer.decode(p, skip_special_tokens=False) if echo else "" for p in prompts]
        gen = await generate(prompts, params, "cmpl")  # from here on, every exit path must abort it
        created = int(time.time())

        def choice(out: Any, i: int, o: Any, text: str, entries: Any, offsets: dict[int, int], finish):
            c = i * n + o.index
            lp = None
            if req.logprobs is not None:
                if c not in offsets and echo:  # first piece of this choice: the echoed prompt's logprobs
                    # position 0 has no context: OpenAI lists its token with a null logprob
                    head = [e if e is not None else t for e, t in zip(out.prompt_logprobs or (), prompts[i])]
                    entries = head + list(entries or ())
                lp, offsets[c] = formatter.completion_logprobs(entries or (), offsets.get(c, 0))
            offsets.setdefault(c, 0)
            return P.CompletionChoice(index=c, text=text, logprobs=lp, finish_reason=finish)

        def resp(choices, usage=None) -> P.CompletionResponse:
            return P.CompletionResponse(id=gen.request_id, created=created, model=model_name,
                                        system_fingerprint=fingerprint, choices=choices, usage=usage)

        if req.stream:
            offsets: dict[int, int] = {}
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            def emit(choices: ChoiceTracker, i: int, out: Any):
                for c, text, entries, finish in choices.deltas(i, out):
                    o = out.outputs[c - i * n]
                    first = c not in offsets
                    text = (prompt_text[i] if first else "") + text
                    if finish is not None:
                        count_finishes([finish])
                    yield resp([choice(out, i, o, text, entries, offsets, finish)])
                if include_usage and all(x is not None and x.finished for x in gen.latest):
                    yield resp([], usage(gen))

            def final(choices: ChoiceTracker):
                open_ = [c for c in range(len(prompts) * n) if c not in choices.finished]
                count_finishes(["abort"] * len(open_))
                for c in open_:
                    yield resp([P.CompletionChoice(index=c, text="", finish_reason="abort")])

            return stream_response(gen, emit, final)

        latest = await run_to_end(gen, request)
        out_choices, offsets = [], {}
        for i, out in enumerate(latest):
            for o in out.outputs:
                out_choices.append(choice(out, i, o, prompt_text[i] + o.text, o.logprobs, offsets, o.finish_reason))
        count_finishes([c.finish_reason for c in out_choices])
        return Response(resp(out_choices, usage(gen)).model_dump_json(), media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_auth(request)
        req = P.parse_request(P.ChatCompletionRequest, await read_json(request, config.max_request_bytes))
        check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise P.bad_request("top_logprobs requires logprobs: true", param="top_logprobs")
        check_limit(req.top_logprobs, config.max_logprobs, "top_logprobs")
        try:
            ids = tokenizer.apply_chat_template(req.template_messages(), tokenize=True,
                                                add_generation_prompt=req.add_generation_prompt)
        except Exception as e:  # any template failure is caused by the messages it was given
            raise P.bad_request(f"messages: the chat template failed: {e}", param="messages") from None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        check_length(ids, max_tokens, "messages")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling_params(req, max_tokens=max_tokens, logprobs=logprobs)
        gen = await generate([ids], params, "chatcmpl")
        created = int(time.time())

        def chunk(choices) -> P.ChatCompletionChunk:
            return P.ChatCompletionChunk(id=gen.request_id, created=created, model=model_name,
                                         system_fingerprint=fingerprint, choices=choices)

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            started_choices: set[int] = set()

            def emit(choices: ChoiceTracker, i: int, out: Any):
                for c, text, entries, finish in choices.deltas(i, out):
                    if c not in started_choices:  # OpenAI opens each choice with the role
                        started_choices.add(c)
                        yield chunk([P.ChatChunkChoice(index=c, delta=P.DeltaMessage(role="assistant", content=""))])
                    lp = formatter.chat_logprobs(entries) if entries and logprobs is not None else None
                    if text or lp:
                        yield chunk([P.ChatChunkChoice(index=c, delta=P.DeltaMessage(content=text), logprobs=lp)])
                    if finish is not None:
                        count_finishes([finish])
                        yield chunk([P.ChatChunkChoice(index=c, delta=P.DeltaMessage(), finish_reason=finish)])
                if include_usage and gen.latest[0] is not None and gen.latest[0].finished:
                    u = chunk([])
                    u.usage = usage(gen)
                    yield u

            def final(choices: ChoiceTracker):
                open_ = [c for c in range(params.n) if c not in choices.finished]
                count_finishes(["abort"] * len(open_))
                for c in open_:
                    yield chunk([P.ChatChunkChoice(index=c, delta=P.DeltaMessage(), finish_reason="abort")])

            return stream_response(gen, emit, final)

        (out,) = await run_to_end(gen, request)
        choices = [P.ChatChoice(index=o.index, message=P.AssistantMessage(content=o.text),
                                logprobs=formatter.chat_logprobs(o.logprobs) if logprobs is not None else None,
                                finish_reason=o.finish_reason) for o in out.outputs]
        count_finishes([c.finish_reason for c in choices])
        resp = P.ChatCompletionResponse(id=gen.request_id, created=created, model=model_name,
                                        system_fingerprint=fingerprint, choices=choices, usage=usage(gen))
        return Response(resp.model_dump_json(), media_type="application/json")

    return app


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


def _max_model_len(engine: Any) -> int:
    """The engine's resolved context limit (its config's max_model_len), else the model's."""
    cfg = getattr(engine, "config", None)
    limit = getattr(cfg, "max_model_len", None) or getattr(engine, "max_model_len", None)
    return int(limit or engine.model_config.max_position_embeddings)
