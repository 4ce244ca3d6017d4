"""OpenAI-compatible HTTP server over the engine (`detinfer serve MODEL_DIR`).

* `serve`: the command line (`ServerConfig` + `EngineConfig` flags), the system fingerprint, uvicorn.
* `app`: the FastAPI app factory and the routes.
* `async_engine`: the engine loop thread and the per-request asyncio streams.
* `protocol`: OpenAI-shaped request/response models, errors and logprob formatting.
* `metrics`: Prometheus text-format metrics.

Nothing is imported here so that `detinfer serve --help` does not pay for FastAPI, uvicorn or torch.
"""
