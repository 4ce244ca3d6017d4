"""The FastAPI app: OpenAI-compatible routes over an `AsyncEngine`.

`create_app` only wires things together; the handlers are module-level functions (here and in
`completions` / `chat`) that read the shared `ServerState` from `request.app.state.server`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from detinfer.server import protocol as P
from detinfer.server import responses as R
from detinfer.server.admin import ADMIN_ROUTES, add_admin_routes
from detinfer.server.async_engine import AsyncEngine
from detinfer.server.chat import chat_completions
from detinfer.server.completions import completions
from detinfer.server.config import ServerConfig
from detinfer.server.context import ServedModel, ServerState
from detinfer.server.handling import check_model, json_response, state_of
from detinfer.server.logprobs import TokenFormatter
from detinfer.server.metrics import HTTPRequestCounter
from detinfer.server.prompts import PromptChecker
from detinfer.server.request_io import HostCheck, check_auth
from detinfer.server.sampling import RequestLimits

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{id}", "/health", "/metrics",
          *ADMIN_ROUTES)
# Tokenizing and chat templates run here, off the event loop; a couple of threads is plenty (the tokenizer
# is fast, and the cheap size bound refuses prompts that could never fit before they reach it).
TOKENIZER_THREADS = 2


async def health(request: Request):
    reason = state_of(request).engine.unavailable_reason()
    if reason is not None:
        raise P.APIError(503, reason)
    return {"status": "ok"}


async def metrics(request: Request):
    return Response(state_of(request).engine.metrics.render(),
                    media_type="text/plain; version=0.0.4; charset=utf-8")


def _card(state: ServerState) -> R.ModelCard:
    return R.ModelCard(id=state.model.name, created=state.created, max_model_len=state.model.max_model_len)


async def list_models(request: Request):
    state = state_of(request)
    check_auth(request, state.config.api_key)
    return json_response(R.ModelList(data=[_card(state)]))


async def get_model(request: Request, model_id: str):
    state = state_of(request)
    check_auth(request, state.config.api_key)
    check_model(state, model_id)
    return json_response(_card(state))


async def _api_error(_request, exc: P.APIError):
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error(_request, exc: StarletteHTTPException):
    return JSONResponse(P.APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)


async def _internal(_request, exc: Exception):
    return JSONResponse(P.APIError(500, f"internal error: {exc!r}").body(), status_code=500)


def create_app(engine: AsyncEngine, config: ServerConfig, model: ServedModel,
               refingerprint: Callable[[str], str] | None = None) -> FastAPI:
    executor = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="detinfer-tokenize")
    formatter = TokenFormatter(model.tokenizer)
    prompts = PromptChecker(model.tokenizer, model.vocab_size, model.max_model_len,
                            formatter.longest_token_bytes(model.vocab_size), executor)
    limits = RequestLimits(config.max_n, config.max_logprobs, config.max_temperature)
    state = ServerState(engine, config, model, formatter, prompts, limits, created=int(time.time()),
                        refingerprint=refingerprint)

    @asynccontextmanager
    async def lifespan(_app):
        engine.start()
        try:
            yield
        finally:
            await engine.shutdown()
            executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="detinfer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.add_middleware(HostCheck, allowed=config.host_allowlist())
    app.add_middleware(HTTPRequestCounter, metrics=engine.metrics, routes=ROUTES)  # outermost: counts 403s too
    app.add_exception_handler(P.APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", get_model, methods=["GET"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    add_admin_routes(app)
    return app
