"""Tokenizer: a `tokenizers.Tokenizer` (tokenizer.json) plus what tokenizer_config.json says around it.

* `encode(text)` adds the BOS/EOS the config asks for (`add_bos_token` / `add_eos_token`); where the config
  does not say, whatever the tokenizer.json post-processor would add is used, as HF does.
* `apply_chat_template` renders the config's Jinja chat template with HF's conventions (sandboxed,
  trim_blocks + lstrip_blocks, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII,
  loop controls, and the `{% generation %}` block tag rendered as plain content).
* `IncrementalDetokenizer` turns a token stream into text deltas for streaming, with stop strings.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(ValueError):
    """Raised by a chat template's `raise_exception(...)`, or when there is no template to render."""


class Tokenizer:
    def __init__(self, backend: tokenizers.Tokenizer, *,
                 special_tokens: Mapping[str, str | None] | None = None,
                 add_bos_token: bool | None = None, add_eos_token: bool | None = None,
                 chat_template: str | None = None, clean_up_tokenization_spaces: bool = False):
        if not isinstance(backend, tokenizers.Tokenizer):
            raise TypeError(f"backend must be a tokenizers.Tokenizer, got {type(backend).__name__}")
        self.backend = backend
        self.special_tokens = {k: (special_tokens or {}).get(k) for k in SPECIAL_TOKEN_KEYS}
        for key, token in self.special_tokens.items():
            if token is not None and backend.token_to_id(token) is None:
                raise ValueError(f"{key} {token!r} is not in the tokenizer's vocabulary")
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        for flag, key in ((add_bos_token, "bos_token"), (add_eos_token, "eos_token")):
            if flag and self.special_tokens[key] is None:
                raise ValueError(f"add_{key} is set but the tokenizer config names no {key}")
        # What the tokenizer.json post-processor adds around a single sequence, for unspecified flags.
        probe = backend.encode("a", add_special_tokens=False).ids
        with_specials = backend.encode("a", add_special_tokens=True).ids
        start = _find(with_specials, probe)
        pre, post = with_specials[:start], with_specials[start + len(probe):]
        self._prefix = [self.bos_token_id] if add_bos_token else [] if add_bos_token is not None else pre
        self._suffix = [self.eos_token_id] if add_eos_token else [] if add_eos_token is not None else post
        self._template = _compile_chat_template(chat_template) if chat_template else None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """tokenizer.json (required), tokenizer_config.json, special_tokens_map.json, chat_template.jinja."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir} (only fast-tokenizer files are "
                                    "supported)")
        backend = tokenizers.Tokenizer.from_file(str(path))
        cfg = _read_json_if(model_dir / "tokenizer_config.json")
        special_map = _read_json_if(model_dir / "special_tokens_map.json")
        special = {k: _token_content(cfg.get(k, special_map.get(k))) for k in SPECIAL_TOKEN_KEYS}
        template_file = model_dir / "chat_template.jinja"
        template = (template_file.read_text(encoding="utf-8") if template_file.is_file()
                    else _pick_template(cfg.get("chat_template")))
        return cls(backend, special_tokens=special, add_bos_token=cfg.get("add_bos_token"),
                   add_eos_token=cfg.get("add_eos_token"), chat_template=template,
                   clean_up_tokenization_spaces=bool(cfg.get("clean_up_tokenization_spaces", False)))

    # --- vocabulary --------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def _special_id(self, key: str) -> int | None:
        token = self.special_tokens[key]
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    @property
    def add_bos(self) -> bool:
        return bool(self._prefix) and self._prefix[0] == self.bos_token_id

    # --- text <-> ids ------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with add_special_tokens, wrapped in the BOS/EOS the config asks for.
        Text that already holds them (a rendered chat template) should use add_special_tokens=False."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return self._prefix + ids + self._suffix if add_special_tokens else ids

    def decode(self, ids: Sequence[int] | Iterable[int], skip_special_tokens: bool = True) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return clean_up_spaces(text) if self.clean_up_tokenization_spaces else text

    def incremental_detokenizer(self, prompt_ids: Sequence[int] = (), stop: Sequence[str] = (),
                                skip_special_tokens: bool = True, include_stop_str: bool = False,
                                min_tokens: int = 0) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids=prompt_ids, stop=stop,
                                      skip_special_tokens=skip_special_tokens,
                                      include_stop_str=include_stop_str, min_tokens=min_tokens)

    # --- chat --------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = False, **kwargs: Any) -> str | list[int]:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the model's chat template.
        Extra kwargs (tools, documents, date_string, ...) are passed to the template, as in HF. With
        tokenize=True returns ids (special tokens come from the template, none are added)."""
        if self._template is None:
            raise ChatTemplateError("this tokenizer has no chat template (tokenizer_config.json has no "
                                    "'chat_template' and there is no chat_template.jinja)")
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                raise ValueError(f"messages[{i}] must be a dict with a string 'role', got {m!r}")
        # As HF: tools/documents are always defined (None unless given), so `tools is none` tests work.
        context = {**{k: v for k, v in self.special_tokens.items() if v is not None},
                   "tools": None, "documents": None, **kwargs}
        text = self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                     **context)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def clean_up_spaces(text: str) -> str:
    """HF's `clean_up_tokenization_spaces`: drop the space tokenizers of the BERT era put before
    punctuation and English contractions."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in HF; for
    rendering it is transparent."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body)


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's built-in tojson escapes HTML characters and forces ASCII; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    # Templates that print a date call this unless given date_string; pass date_string for reproducibility.
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not parse (line {e.lineno}): {e.message}") from e


def _pick_template(value: Any) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of {"name", "template"} (use "default")."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" in named:
            return named["default"]
        raise ChatTemplateError(f"chat_template list has no 'default' entry (names: {sorted(named)})")
    raise ChatTemplateError(f"chat_template must be a string or a list of named templates, got {type(value)}")


def _token_content(value: Any) -> str | None:
    """Special tokens are saved either as a string or as an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json_if(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _find(haystack: list[int], needle: list[int]) -> int:
    for i in range(len(haystack) - len(needle) + 1):
        if haystack[i:i + len(needle)] == needle:
            return i
    raise ValueError("tokenizer post-processor changes the token ids of the text itself; unsupported")


class IncrementalDetokenizer:
    """Token stream -> text deltas, for streaming and stop strings.

    Decoding one token at a time is wrong for tokenizers whose pieces only make sense together (a multi-byte
    UTF-8 character split over byte tokens; SentencePiece's leading-space handling), so each step decodes a
    short window twice, with and without the new token, and releases the difference once it no longer ends
    in an incomplete character. `prompt_ids` give the window its left context (e.g. the space before the
    first generated word).

    Stop strings: text is released only up to the point where no stop string can begin, so a stop string
    never reaches the client in pieces; once one appears, the output ends before it (or after it, with
    include_stop_str) and `stopped` is set. `finish()` releases what was held back. Stop strings are looked
    for only once more than `min_tokens` tokens were added (SamplingParams.min_tokens, as vLLM counts it).
    """

    # Left context kept from the prompt; enough for any tokenizer's merge/space effects in practice.
    PROMPT_CONTEXT = 6

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), stop: Sequence[str] = (),
                 skip_special_tokens: bool = True, include_stop_str: bool = False, min_tokens: int = 0):
        if isinstance(stop, str):
            stop = [stop]
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        self.tokenizer, self.stop, self.include_stop_str = tokenizer, tuple(stop), include_stop_str
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids)[-self.PROMPT_CONTEXT:]
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.raw_text = ""  # everything decoded from generated tokens so far
        self.released = 0  # characters of raw_text handed out
        self.stopped: str | None = None  # the stop string that ended the output, if any
        self._end: int | None = None  # where the output ends in raw_text once stopped
        self.min_tokens, self.num_added = min_tokens, 0

    @property
    def text(self) -> str:
        """The output text so far (what was released, plus the held-back tail after finish())."""
        return self.raw_text[:self.released]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.backend.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Feed one generated token; returns the newly released text ('' if none can be released yet)."""
        if self.stopped is not None:
            return ""
        self.ids.append(int(token_id))
        self.num_added += 1
        self._advance(final=False)
        return self._release()

    def finish(self) -> str:
        """End of generation: release the held-back tail (nothing more if a stop string ended it).
        An incomplete character left at the very end is released as U+FFFD, as a full decode shows it."""
        if self.stopped is None:
            self._advance(final=True)
        if self.stopped is None:
            self._end = len(self.raw_text)
        return self._release()

    def _advance(self, final: bool) -> None:
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            start = len(self.raw_text)
            self.raw_text += after[len(before):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._check_stop(start)

    def _check_stop(self, new_from: int) -> None:
        if self.num_added <= self.min_tokens:
            return
        hits = []
        for s in self.stop:
            at = self.raw_text.find(s, max(0, new_from - len(s) + 1))
            if at >= 0:
                hits.append((at, -len(s), s))
        if hits:
            at, _, s = min(hits)  # earliest; the longest one if several start there
            self.stopped, self._end = s, at + (len(s) if self.include_stop_str else 0)

    def _release(self) -> str:
        if self._end is not None:
            limit = self._end
        else:  # hold back a tail that could still grow into a stop string
            limit = len(self.raw_text) - _longest_stop_prefix_suffix(self.raw_text, self.stop)
        delta = self.raw_text[self.released:max(limit, self.released)]
        self.released = max(limit, self.released)
        return delta


def _longest_stop_prefix_suffix(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
