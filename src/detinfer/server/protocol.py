"""OpenAI-shaped request models and errors (the response bodies: server/responses.py).

Requests are validated strictly: a string where a number belongs, a value out of range is a 400 whose body
names the field (`param`), instead of being coerced. OpenAI fields this server cannot honour and that would
change the output (`suffix`, `tools`, `functions`, `audio`, `prediction`, ...) are refused with a 400 naming
the field unless they are no-ops: silently ignoring them would hand a client numbers it did not ask for.
Fields that never change the numbers (`user`, `metadata`, `store`, ...) are accepted and ignored.
Unknown top-level fields (another server's extensions) are accepted and ignored as vLLM does, but never
silently: the server logs a warning and names them in the `X-Detinfer-Ignored-Fields` response header
(`ignored_fields`). Inside nested objects (messages, stream_options) unknown fields are still a 400.

Sampling fields accept `null` as "use the default": several clients send explicit nulls.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_PROMPTS_PER_REQUEST = 64  # a completions `prompt` list is a batch; bound it like any other input
MAX_STOP_SEQUENCES = 16
# JSON integers are unbounded; the engine holds them as int64 (token ids, counts, seeds, top_k). Every integer
# field is bounded by this, so an oversized value is a 400 naming it, never an overflow inside the engine.
INT64_MAX = (1 << 63) - 1


class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error",
                503: "service_unavailable"}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _loc_to_param(loc: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'. Union members appear in pydantic's locations as
    type tags ('stop', 'list[str]', 1); those are dropped: the client only knows field names."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _TYPE_TAGS or any(c in part for c in "[(-"):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out


def validation_error(err: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming its field."""
    first = err.errors(include_url=False)[0]
    param = _loc_to_param(first["loc"]) or None
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        msg = "unrecognized request argument (not supported by this server)"
    elif first["type"] == "missing":
        msg = "this field is required"
    return bad_request(f"{param}: {msg}" if param else msg, param=param)


def parse_request(model_cls: type[BaseModel], data: Any) -> Any:
    if not isinstance(data, dict):
        raise bad_request(f"request body must be a JSON object, got {type(data).__name__}")
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


# ---------------------------------------------------------------------------------------------------
# requests

class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    """OpenAI's response_format.json_schema. `strict` is accepted either way: the grammar makes every output
    match the schema."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema" and only allowed with it')
        return self


class StructuredOutputsField(_Strict):
    """vLLM's `structured_outputs` request object: one of json, json_object, regex, choice, grammar."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


LOGIT_BIAS_RANGE = 100.0  # OpenAI's bound on a logit_bias value
MAX_BAD_WORDS = 64
MAX_TOKEN_ID_LIST = 1 << 16  # allowed_token_ids: a bound on the list a request may carry


class _SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's, plus vLLM's extras).

    Top-level fields it does not know are kept (`model_extra`) and reported, not refused (see the module
    docstring)."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    n: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    seed: int | None = Field(None, ge=0, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (as a string) -> bias in [-100, 100]
    # vLLM's extras
    min_tokens: int | None = Field(None, ge=0, le=INT64_MAX)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = Field(None, min_length=1, max_length=MAX_TOKEN_ID_LIST)
    bad_words: list[str] | None = Field(None, max_length=MAX_BAD_WORDS)
    prompt_logprobs: int | None = Field(None, ge=0, le=INT64_MAX)
    # vLLM's: return the prompt's token ids and each choice's completion token ids (RL rollouts score
    # exactly these tokens; re-tokenizing the text need not give them back)
    return_token_ids: bool = False
    # Structured output (at most one; see server/sampling.py): OpenAI's, vLLM's older guided_* and newer
    # structured_outputs.
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsField | None = None
    # Accepted and ignored: they never change the numbers.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_ids(cls, v):
        if v is not None and any(not 0 <= t <= INT64_MAX for t in v):
            raise ValueError("stop_token_ids must be token ids (non-negative, at most 2**63 - 1)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v):
        for key, bias in (v or {}).items():
            if not (key.isascii() and key.isdigit()) or int(key) > INT64_MAX:
                raise ValueError(f"keys must be token ids written as decimal strings (e.g. \"50256\"), got {key!r}")
            if not -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for token {key}")
        return v

    @field_validator("allowed_token_ids")
    @classmethod
    def _check_allowed_ids(cls, v):
        if v is not None and any(not 0 <= t <= INT64_MAX for t in v):
            raise ValueError("allowed_token_ids must be token ids (non-negative)")
        return v

    @field_validator("bad_words")
    @classmethod
    def _check_bad_words(cls, v):
        if v is not None and any(not w.strip() for w in v):
            raise ValueError("bad_words must be non-blank strings")
        return v

    def ignored_fields(self) -> list[str]:
        """The unknown top-level fields of this request (accepted, not used), sorted."""
        return sorted(self.model_extra or {})


class CompletionRequest(_SamplingRequest):
    prompt: Any
    max_tokens: int | None = Field(16, ge=1, le=INT64_MAX)
    logprobs: int | None = Field(None, ge=0, le=INT64_MAX)
    echo: bool | None = False
    best_of: int | None = Field(None, ge=1, le=INT64_MAX)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v):
        normalize_prompt(v)  # raises ValueError with the reason
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix (insertion) is not supported")
        return v


def normalize_prompt(prompt: Any) -> list[str | list[int]]:
    """A completions `prompt` (str | list[str] | list[int] | list[list[int]]) as a list of prompts."""
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        for p in prompt:
            if not all(_is_int(t) for t in p):
                raise ValueError("a token-id prompt must hold integers only")
        prompts = list(prompt)
    elif isinstance(prompt, list) and not prompt:
        raise ValueError("prompt must not be empty")
    else:
        raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of "
                         "token-id lists")
    if len(prompts) > MAX_PROMPTS_PER_REQUEST:
        raise ValueError(f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request, got {len(prompts)}")
    for p in prompts:
        if len(p) == 0:
            raise ValueError("prompt must not be empty")
    return prompts


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=INT64_MAX)
    tools: list[Any] | None = None
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    # OpenAI fields this server cannot honour: refused when they would do something (see _unsupported).
    functions: list[Any] | None = None
    function_call: Literal["none"] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[Literal["text"]] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None

    @field_validator("tools", "functions", "audio", "prediction", "web_search_options")
    @classmethod
    def _unsupported(cls, v, info):
        if v:
            raise ValueError(f"{info.field_name} is not supported by this server")
        return v

    def template_messages(self) -> list[dict[str, str]]:
        # "developer" is OpenAI's newer name for the system role; chat templates only know "system".
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]
