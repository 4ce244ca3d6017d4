"""Admin routes for an external trainer driving the server as its rollout engine (docs/rollout-server.md):

    POST /admin/load_weights        {"path": ...}  new weights from safetensors, in place
    POST /admin/reset_prefix_cache                 drop every cached prefix KV block
    GET  /admin/weights_fingerprint                what the server samples from now

Access: with --api-key they require `Authorization: Bearer <key>` (401 otherwise). Without an API key they are
refused (403) unless --enable-admin-endpoints was given (local use: anyone who can reach the port can then
replace the weights). Each operation runs in the engine (engine/admin.py) once the requests already in flight
finished; requests sent after it wait for it (so they sample from the new weights).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from detinfer.server import protocol as P
from detinfer.server.async_engine import EngineUnavailableError, RequestFailed
from detinfer.server.handling import state_of
from detinfer.server.request_io import check_auth, read_json

ADMIN_ROUTES = ("/admin/load_weights", "/admin/reset_prefix_cache", "/admin/weights_fingerprint")


def _check_admin(request: Request):
    state = state_of(request)
    if state.config.api_key is None and not state.config.enable_admin_endpoints:
        raise P.APIError(403, "admin endpoints are off: start the server with --api-key (they then require it) or, "
                         "for local use only, --enable-admin-endpoints", code="admin_disabled")
    check_auth(request, state.config.api_key)
    return state


async def _run(state, op: str, arg: Any = None) -> dict[str, Any]:
    try:
        return await state.engine.admin(op, arg)
    except (ValueError, TypeError) as e:
        raise P.bad_request(str(e), param="path" if op == "load_weights" else None) from None
    except EngineUnavailableError as e:
        raise P.APIError(503, str(e)) from None
    except RequestFailed as e:
        raise P.APIError(500, f"{op} failed in the engine: {e}", code="admin_failed") from None


def _refingerprint(state, weights_sha256: str) -> str:
    """The system_fingerprint responses carry from now on: after a load it hashes the loaded tensors."""
    if state.refingerprint is not None:
        fingerprint = state.refingerprint(f"tensors:{weights_sha256}")
        state.model = dataclasses.replace(state.model, fingerprint=fingerprint)
    return state.model.fingerprint


async def load_weights(request: Request):
    state = _check_admin(request)
    body = await read_json(request, state.config.max_request_bytes, state.config.body_timeout)
    if not isinstance(body, dict) or set(body) != {"path"}:
        raise P.bad_request('the body must be {"path": "<checkpoint directory or .safetensors file>"}', param="path")
    result = await _run(state, "load_weights", body["path"])
    result["system_fingerprint"] = _refingerprint(state, result["weights_sha256"])
    return JSONResponse(result)


async def reset_prefix_cache(request: Request):
    state = _check_admin(request)
    return JSONResponse(await _run(state, "reset_prefix_cache"))


async def weights_fingerprint(request: Request):
    state = _check_admin(request)
    result = await _run(state, "weights_fingerprint")
    result["system_fingerprint"] = state.model.fingerprint
    return JSONResponse(result)


def add_admin_routes(app) -> None:
    app.add_api_route("/admin/load_weights", load_weights, methods=["POST"])
    app.add_api_route("/admin/reset_prefix_cache", reset_prefix_cache, methods=["POST"])
    app.add_api_route("/admin/weights_fingerprint", weights_fingerprint, methods=["GET"])
