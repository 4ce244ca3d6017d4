"""What a request's structured output must match: `StructuredOutputs` (pure Python, no torch, no grammar library).

One of: a JSON schema (`json`), any JSON object (`json_object=True`), a regular expression (`regex`), one of a
list of strings (`choice`) or a context-free grammar (`grammar`: Lark, or llama.cpp's GBNF). The engine
turns it into a grammar and masks, at every output position, the tokens that would leave the grammar
(`detinfer.engine.grammar`). Names follow vLLM's `StructuredOutputsParams`.

Frozen and hashable: `kind` and `text` (the constraint as canonical text) key the compile caches, and the
whole object crosses to an engine process inside `SamplingParams`.

`compile_grammar` / `check_structured_outputs` turn a constraint into llguidance's grammar and check it
without a tokenizer (the API server checks requests with it, naming the field). llguidance is imported only
there, so a missing library fails structured requests alone, with an error saying what to install.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# The schema used for json_object: any JSON object (JSON mode, OpenAI's {"type": "json_object"}).
ANY_JSON_OBJECT_SCHEMA = '{"type": "object"}'
MAX_CONSTRAINT_CHARS = 1 << 20  # a schema, regex or grammar larger than 1 MiB of text is refused
INSTALL_HINT = "structured output needs the llguidance package: pip install 'detinfer[structured]'"
# JSON is generated without free whitespace: a grammar that lets any amount of whitespace through lets a model
# pad forever (small models do), and one compact form keeps outputs comparable across runs.
JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one constraint on the output text.

    json: a JSON schema, as a dict or as its JSON text (stored as text; key order is kept, it fixes the
        order properties are generated in).
    json_object: True: any JSON object.
    regex: the whole output matches this regular expression (Rust regex syntax, anchored at both ends).
    choice: the output is exactly one of these strings.
    grammar: a Lark grammar (llguidance's dialect) or a GBNF grammar (llama.cpp's), with a `start` /
        `root` rule.
    """

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        if not isinstance(self.json_object, bool):
            raise TypeError(f"json_object must be a bool, got {self.json_object!r}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))
        given = [k for k in KINDS if (getattr(self, k) if k == "json_object" else getattr(self, k) is not None)]
        if len(given) != 1:
            raise ValueError("structured outputs take exactly one of json, json_object, regex, choice, grammar; "
                             f"got {', '.join(given) if given else 'none'}")
        if len(self.text) > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"{self.kind} is {len(self.text)} characters long; at most {MAX_CONSTRAINT_CHARS}")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of KINDS."""
        return next(k for k in KINDS if (getattr(self, k) if k == "json_object" else getattr(self, k) is not None))

    @property
    def text(self) -> str:
        """The constraint as text (choices as a JSON list): with `kind`, the compile caches' key."""
        kind = self.kind
        if kind == "json_object":
            return ANY_JSON_OBJECT_SCHEMA
        if kind == "choice":
            return json.dumps(list(self.choice), ensure_ascii=False)
        return getattr(self, kind)


def _schema_text(schema: Any) -> str:
    """A JSON schema given as a dict or as JSON text -> its JSON text (a ValueError names what is wrong)."""
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"json must be a JSON schema; its text is not valid JSON: {e}") from None
    else:
        parsed = schema
    if not isinstance(parsed, dict):
        raise ValueError(f"json must be a JSON schema (a JSON object), got {type(parsed).__name__}")
    if isinstance(schema, str):
        return schema
    try:
        return json.dumps(parsed, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"json must be a JSON schema of JSON values: {e}") from None


def _choices(choice: Any) -> tuple[str, ...]:
    if isinstance(choice, (str, bytes)) or not hasattr(choice, "__iter__"):
        raise TypeError(f"choice must be a list of strings, got {type(choice).__name__}")
    choices = tuple(choice)
    if not choices:
        raise ValueError("choice must hold at least one string")
    for i, c in enumerate(choices):
        if not isinstance(c, str) or not c:
            raise ValueError(f"choice[{i}] must be a non-empty string, got {c!r}")
    return choices


class StructuredOutputError(ValueError):
    """A constraint the grammar library refuses; `field` names it (json, regex, choice or grammar)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


# llguidance 1.6 takes one EOS id (`LLTokenizer(eos_token=int)`); GrammarMasks passes every EOS id of the
# model, which 1.7 accepts (checked: 1.6.1 refuses the list, 1.7.0-1.9.1 take it). pyproject pins the same.
MIN_LLGUIDANCE = (1, 7)


def llguidance():
    """The llguidance module, or a ValueError saying how to install it (or a new enough one)."""
    try:
        import llguidance as llg
    except ImportError:
        raise ValueError(INSTALL_HINT) from None
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("llguidance")
    except PackageNotFoundError:  # imported from a path without metadata: trust it
        return llg
    if tuple(int(p) for p in found.split(".")[:2] if p.isdigit()) < MIN_LLGUIDANCE:
        raise ValueError(f"structured output needs llguidance >= {'.'.join(map(str, MIN_LLGUIDANCE))}, found "
                         f"{found}: pip install -U 'detinfer[structured]'")
    return llg


_WHAT = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regular expression",
         "choice": "choice list", "grammar": "grammar"}


@functools.lru_cache(maxsize=256)
def compile_grammar(kind: str, text: str) -> str:
    """llguidance's grammar for one constraint (an LRU cache keyed by its text), checked: a
    StructuredOutputError naming the field when the schema, regex or grammar is invalid."""
    llg = llguidance()
    field = "json" if kind == "json_object" else kind
    try:
        if kind in ("json", "json_object"):
            grammar = llg.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        else:
            grammar = llg.grammar_from(kind, text)  # regex, choice (a JSON list) or grammar (Lark or GBNF)
    except (ValueError, TypeError) as e:
        raise StructuredOutputError(field, str(e).strip()) from None
    error = llg.LLMatcher.validate_grammar(grammar)
    if error:
        raise StructuredOutputError(field, f"invalid {_WHAT[kind]}: {error.strip()}")
    return grammar


def check_structured_outputs(so: StructuredOutputs) -> None:
    """Raise what the engine would for this constraint, without a tokenizer: a ValueError when llguidance is
    missing, a StructuredOutputError naming the field when the constraint is invalid."""
    compile_grammar(so.kind, so.text)
