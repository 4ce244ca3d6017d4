"""A request's structured-output fields -> the engine's `StructuredOutputs` (or a 400 naming the field).

Accepted spellings, at most one per request:
* OpenAI's `response_format`: {"type": "text"} (free text), {"type": "json_object"}, {"type": "json_schema",
  "json_schema": {"name", "schema", "strict", "description"}};
* vLLM's `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`;
* vLLM's `structured_outputs` object with one of json, json_object, regex, choice, grammar.
The constraint is compiled (and cached) here, without the engine, so an invalid schema, regex or grammar, or
a server without llguidance, is a 400 before anything is queued.
"""

from __future__ import annotations

from typing import Any

from detinfer.engine.structured import StructuredOutputError, StructuredOutputs, check_structured_outputs
from detinfer.server.protocol import bad_request

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
