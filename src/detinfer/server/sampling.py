"""An OpenAI-shaped request's sampling fields -> the engine's `SamplingParams` (a pure function).

Every value is checked here, at the boundary, against the server's limits (`--max-n`, `--max-logprobs`,
`--max-temperature`) and, through `SamplingParams`, against what the engine can hold (int64 counts, float32
temperatures and penalties), so a value that passed validation cannot fail inside an engine step.

Structured output (`structured_outputs`), at most one spelling per request:
* OpenAI's `response_format`: {"type": "text"} (free text), {"type": "json_object"}, {"type": "json_schema",
  "json_schema": {"name", "schema", "strict", "description"}};
* vLLM's `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`;
* vLLM's `structured_outputs` object with one of json, json_object, regex, choice, grammar.
The constraint is compiled (and cached) here, without the engine, so an invalid schema, regex or grammar, or
a server without llguidance, is a 400 before anything is queued.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from detinfer import admission
from detinfer.engine.sampling_params import SamplingParams
from detinfer.engine.structured import StructuredOutputError, StructuredOutputs, check_structured_outputs
from detinfer.server.protocol import APIError, bad_request


@dataclass(frozen=True)
class RequestLimits:
    """The server's per-request limits (from ServerConfig)."""

    max_n: int = 16
    max_logprobs: int = 20
    max_temperature: float = 2.0


def check_limit(value: int | float | None, limit: int | float, param: str) -> None:
    if value is not None and value > limit:
        raise bad_request(f"{param} must be at most {limit}, got {value}", param=param)


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


def _check_vocab(req: Any, vocab_size: int | None) -> None:
    """Token ids in logit_bias and allowed_token_ids must be the model's (a 400 naming the field)."""
    if vocab_size is None:
        return
    for param, ids in (("logit_bias", [int(k) for k in req.logit_bias or {}]),
                       ("allowed_token_ids", req.allowed_token_ids or [])):
        try:
            admission.check_token_ids(param, ids, vocab_size)
        except (TypeError, ValueError) as e:
            raise bad_request(str(e), param=param) from None


def sampling_params(req: Any, limits: RequestLimits, *, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None, vocab_size: int | None = None) -> SamplingParams:
    """`req`: a parsed CompletionRequest or ChatCompletionRequest. Raises APIError(400) naming the field.
    prompt_logprobs: what the route needs (completions' echo with logprobs); the request's own
    `prompt_logprobs` (vLLM's extra) must agree with it when both are given. vocab_size: checks the token
    ids the request names."""
    if req.prompt_logprobs is not None:
        check_limit(req.prompt_logprobs, limits.max_logprobs, "prompt_logprobs")
        if prompt_logprobs is not None and prompt_logprobs != req.prompt_logprobs:
            raise bad_request(f"prompt_logprobs ({req.prompt_logprobs}) must equal logprobs ({prompt_logprobs}) "
                              "when echo is set with logprobs (both fill the echoed prompt's logprobs)",
                              param="prompt_logprobs")
        prompt_logprobs = req.prompt_logprobs
    _check_vocab(req, vocab_size)
    n = req.n or 1
    check_limit(n, limits.max_n, "n")
    temperature = _default(req.temperature, 1.0)
    check_limit(temperature, limits.max_temperature, "temperature")
    stop = [req.stop] if isinstance(req.stop, str) else req.stop or []
    fields = dict(n=n, temperature=temperature, top_p=_default(req.top_p, 1.0), top_k=_default(req.top_k, 0),
                  min_p=_default(req.min_p, 0.0), presence_penalty=_default(req.presence_penalty, 0.0),
                  frequency_penalty=_default(req.frequency_penalty, 0.0),
                  repetition_penalty=_default(req.repetition_penalty, 1.0), seed=req.seed, stop=tuple(stop),
                  stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                  max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                  min_tokens=req.min_tokens or 0, skip_special_tokens=req.skip_special_tokens,
                  include_stop_str_in_output=req.include_stop_str_in_output,
                  logit_bias={int(k): b for k, b in req.logit_bias.items()} if req.logit_bias else None,
                  allowed_token_ids=req.allowed_token_ids, bad_words=tuple(req.bad_words or ()),
                  structured_outputs=structured_outputs(req))
    try:
        return SamplingParams(**fields)
    except (ValueError, TypeError) as e:  # the message starts with the field's name
        param = str(e).split(" ", 1)[0].split("[", 1)[0]
        raise bad_request(str(e), param=param if param in fields else None) from None


def completion_logprobs_count(req: Any, limits: RequestLimits) -> int | None:
    check_limit(req.logprobs, limits.max_logprobs, "logprobs")
    return req.logprobs


def chat_logprobs_count(req: Any, limits: RequestLimits) -> int | None:
    """`logprobs: true` + `top_logprobs: k` -> k alternatives per token (None: no logprobs)."""
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs: true", param="top_logprobs")
    check_limit(req.top_logprobs, limits.max_logprobs, "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"))


def _given(req: Any) -> list[tuple[str, dict[str, str], dict[str, Any]]]:
    """(request field, {StructuredOutputs field: request parameter path}, StructuredOutputs kwargs) of every
    structured-output field the request sets."""
    given = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        given.append(("response_format", {"json": "response_format"}, {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        given.append(("response_format", {"json": "response_format.json_schema.schema"},
                      {"json": fmt.json_schema.schema_}))
    for name, kind in _GUIDED:
        value = getattr(req, name, None)
        if value is not None:
            given.append((name, {kind: name}, {kind: value}))
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        kwargs = {k: v for k, v in (("json", so.json_), ("json_object", so.json_object), ("regex", so.regex),
                                    ("choice", so.choice), ("grammar", so.grammar)) if v is not None}
        given.append(("structured_outputs", {k: f"structured_outputs.{k}" for k in kwargs}, kwargs))
    return given


def structured_outputs(req: Any) -> StructuredOutputs | None:
    """The request's constraint, checked (compiled with llguidance), or None for free text."""
    given = _given(req)
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(g[0] for g in given)
        raise bad_request(f"at most one structured-output field may be given, got {names}", param=given[1][0])
    field, params, kwargs = given[0]
    try:
        so = StructuredOutputs(**kwargs)
    except (ValueError, TypeError) as e:
        raise bad_request(f"{field}: {e}", param=field) from None
    try:
        check_structured_outputs(so)
    except StructuredOutputError as e:
        param = params.get(e.field, field)
        raise bad_request(f"{param}: {str(e).split(': ', 1)[1]}", param=param) from None
    except ValueError as e:  # llguidance is not installed
        raise bad_request(f"{field}: {e}", param=field) from None
    return so


__all__ = ["APIError", "RequestLimits", "chat_logprobs_count", "check_limit", "completion_logprobs_count",
           "sampling_params",
           "structured_outputs"]
