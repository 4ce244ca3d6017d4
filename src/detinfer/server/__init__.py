"""OpenAI-compatible HTTP server over the engine (`detinfer serve MODEL_DIR`).

* `serve`: the command line, start-up (bind, load, run uvicorn). `config`: `ServerConfig`.
* `app`: the FastAPI app factory and the small routes; `completions` and `chat`: the generation handlers,
  `handling`: what they share; `context`: the state they read (`ServerState`, `ServedModel`).
* `sampling`: a request's sampling fields -> `SamplingParams`; `prompts`: prompts -> checked token ids.
* `request_io`: reading bodies and the door guards (Content-Type, Host, API key); `http_guard`: the
  request-header limits (size, read timeout) in uvicorn's protocol.
* `async_engine`: the engine front end (admission, per-request asyncio streams) over `engine.core`'s
  `EngineCore` on a thread; `core_engine`: the same front end over an engine core process; `generation`: the
  engine requests behind one HTTP request.
* `protocol`: OpenAI-shaped request/response models and errors; `logprobs`: logprob formatting.
* `fingerprint`: `system_fingerprint`. `metrics`: Prometheus text-format metrics.

Nothing is imported here so that `detinfer serve --help` does not pay for FastAPI, uvicorn or torch.
"""
