"""Per-request sampling parameters (frozen, validated; names and meanings follow vLLM's SamplingParams).

No torch here: the scheduler reads these (stop conditions, n, prompt logprobs) in pure Python.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from detinfer.engine.config import FLOAT32_MAX, FLOAT32_MIN_NORMAL, INT64_MAX, MAX_SEED, check_float, check_int
from detinfer.engine.structured import StructuredOutputs

PENALTY_RANGE = 2.0  # presence/frequency penalties live in [-2, 2] (OpenAI's range)
# Bounds of what the sampler can hold (INT64_MAX, FLOAT32_MAX, FLOAT32_MIN_NORMAL from engine.config): counts,
# ids and top_k travel as int64; temperature and the repetition penalty divide float32 logits, so they must
# be normal, finite float32 numbers.
# Temperatures below this sample greedily. Why: the sampler draws argmax(z / T + g) with Gumbel noise g,
# |g| < 40 for every 52-bit uniform draw, so at T = 1e-5 only tokens whose logits lie within 4e-4 of the
# best can still be drawn (sampling is already greedy but for near-ties), while much smaller T overflow
# z / T in float32 (T < ~1e-37 turns logits into inf and NaN, and the draw into garbage).
MIN_SAMPLING_TEMPERATURE = 1e-5
LOGIT_BIAS_RANGE = 100.0  # logit_bias values live in [-100, 100] (OpenAI's range)
OUTPUT_KINDS = ("cumulative", "delta", "final_only")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's outputs.

    n: number of independent samples (each its own sequence, sharing the prompt's KV blocks).
    max_tokens: most output tokens per sample; None: until max_model_len.
    temperature: 0 means greedy (argmax, ties to the lowest token id); > 0 samples from softmax(z / T);
        below MIN_SAMPLING_TEMPERATURE (1e-5) is greedy too (see its comment).
    top_k: keep the k most likely tokens (ties at the k-th value kept); 0 or -1: off.
    top_p: keep the smallest set of most likely tokens with total probability >= top_p; 1: off.
    min_p: keep tokens with probability >= min_p * (probability of the most likely token); 0: off.
    repetition_penalty: > 1 discourages tokens seen in the prompt or output (divides positive logits,
        multiplies negative ones); 1: off.
    presence_penalty, frequency_penalty: subtract `presence * (count > 0) + frequency * count`, count =
        occurrences in the output so far; 0: off.
    seed: the random stream's seed. The draw for output position t of sample i is a pure function of
        (seed, t, i) and the logits row. None with temperature > 0: the engine draws a seed once when the
        request is added and reports it, so the request can be replayed.
    stop: strings that end generation when they appear in the output text (checked by the engine, which
        owns the tokenizer). stop_token_ids: token ids that end generation.
    ignore_eos: keep generating past the model's EOS tokens.
    logprobs: None: no logprobs; k >= 0: the sampled token's logprob plus the top-k alternatives.
    prompt_logprobs: like logprobs, for every prompt token (from position 1; position 0 has no context).
        Logprobs (both kinds) are those of the model's raw distribution, before any of the processing
        below, penalties, temperature or top-k/p (vLLM's default `logprobs_mode`, "raw_logprobs").
    min_tokens: no EOS or stop token id can be drawn (they are masked), and no stop string ends the output,
        before this many tokens were generated; 0: off.
    skip_special_tokens: leave special tokens out of the output text (the token ids keep them).
    include_stop_str_in_output: keep the stop string that ended the output at the end of its text.
    logit_bias: {token id: bias}, each bias in [-100, 100], added to the token's logit before anything else
        (sampled and greedy rows alike). Stored as (token id, bias) pairs sorted by id, so the params stay
        hashable.
    allowed_token_ids: only these tokens can be drawn (all others are masked); None: all.
    bad_words: strings that must not be generated. The engine tokenizes each (as written and with a leading
        space) into `bad_words_token_ids`: the last token of a banned sequence is masked whenever the tokens
        generated just before it are the rest of that sequence, so a one-token word is never drawn.
    bad_words_token_ids: banned token sequences (what `bad_words` becomes; may also be given directly,
        e.g. for an engine without a tokenizer).
    token_mask: the extension point for per-request constraints (e.g. a grammar): a callable
        `token_mask(output_token_ids: tuple[int, ...])` returning the token ids allowed next (a sequence of
        ints or a [vocab] bool tensor), or None for no constraint. It must be a pure function of the ids
        generated so far (and picklable, for `engine_process=True`), so the request stays reproducible and
        batch-invariant. See `engine.logits_processors`.
    structured_outputs: a `StructuredOutputs` (JSON schema, JSON object, regex, choice or grammar) the output
        must match; None: free text. Unlike the processors above, its mask also shapes the logprobs
        (they are those of the grammar-masked distribution, as in vLLM). See docs/structured-output.md.
    output_kind: what `LLMEngine.step()` returns for this request (vLLM's RequestOutputKind): "cumulative"
        (every step it progressed: everything generated so far), "delta" (every step it progressed: only
        what is new since its last output; cumulative_logprob stays the running total, prompt logprobs come
        in the first output), "final_only" (one output, when it finishes: what an offline caller needs, and
        the host then builds no per-step copies of growing outputs). Changes what is reported, never a token.
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = field(default=())
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=())
    token_mask: Callable[[tuple[int, ...]], Any] | None = None
    structured_outputs: StructuredOutputs | None = None
    output_kind: str = "cumulative"

    def __post_init__(self):
        check_int("n", self.n, minimum=1, maximum=INT64_MAX)
        check_int("max_tokens", self.max_tokens, minimum=1, maximum=INT64_MAX, optional=True)
        check_float("temperature", self.temperature, minimum=0.0, maximum=FLOAT32_MAX)
        check_int("top_k", self.top_k, minimum=-1, maximum=INT64_MAX)
        check_float("top_p", self.top_p, minimum=0.0, maximum=1.0, min_exclusive=True)
        check_float("min_p", self.min_p, minimum=0.0, maximum=1.0)
        check_float("repetition_penalty", self.repetition_penalty, minimum=FLOAT32_MIN_NORMAL, maximum=FLOAT32_MAX)
        check_float("presence_penalty", self.presence_penalty, minimum=-PENALTY_RANGE, maximum=PENALTY_RANGE)
        check_float("frequency_penalty", self.frequency_penalty, minimum=-PENALTY_RANGE,
                    maximum=PENALTY_RANGE)
        check_int("seed", self.seed, minimum=0, maximum=MAX_SEED, optional=True)
        # Lists and single strings are accepted for convenience and stored as tuples (hashable, frozen).
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        try:
            stop = tuple(stop)
        except TypeError:
            raise TypeError(f"stop must be a string or a sequence of strings, got {self.stop!r}") from None
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain non-empty strings only, got {s!r}")
        object.__setattr__(self, "stop", stop)
        try:
            stop_ids = tuple(self.stop_token_ids)
        except TypeError:
            raise TypeError(f"stop_token_ids must be a sequence of ints, "
                            f"got {self.stop_token_ids!r}") from None
        for i, t in enumerate(stop_ids):
            check_int(f"stop_token_ids[{i}]", t, minimum=0, maximum=INT64_MAX)
        object.__setattr__(self, "stop_token_ids", stop_ids)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        check_int("logprobs", self.logprobs, minimum=0, maximum=INT64_MAX, optional=True)
        check_int("prompt_logprobs", self.prompt_logprobs, minimum=0, maximum=INT64_MAX, optional=True)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise TypeError(f"structured_outputs must be a StructuredOutputs or None, "
                            f"got {type(self.structured_outputs).__name__}")
        if self.output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {', '.join(map(repr, OUTPUT_KINDS))}, "
                             f"got {self.output_kind!r}")
        self._check_processors()

    def _check_processors(self) -> None:
        """The logits processors' fields (see the class docstring), normalised to hashable tuples."""
        check_int("min_tokens", self.min_tokens, minimum=0, maximum=INT64_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name in ("skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.logit_bias is not None:
            items = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
            try:
                pairs = sorted((t, b) for t, b in items)
            except (TypeError, ValueError):
                raise TypeError(f"logit_bias must be a dict {{token id: bias}}, got {self.logit_bias!r:.80}") from None
            for t, b in pairs:
                check_int("logit_bias token id", t, minimum=0, maximum=INT64_MAX)
                check_float(f"logit_bias[{t}]", b, minimum=-LOGIT_BIAS_RANGE, maximum=LOGIT_BIAS_RANGE)
            if len({t for t, _ in pairs}) != len(pairs):
                raise ValueError("logit_bias names a token id twice")
            object.__setattr__(self, "logit_bias", tuple((t, float(b)) for t, b in pairs) or None)
        if self.allowed_token_ids is not None:
            allowed = _int_tuple("allowed_token_ids", self.allowed_token_ids)
            if not allowed:
                raise ValueError("allowed_token_ids must not be empty (None allows every token)")
            object.__setattr__(self, "allowed_token_ids", allowed)
        words = (self.bad_words,) if isinstance(self.bad_words, str) else self.bad_words
        try:
            words = tuple(words)
        except TypeError:
            raise TypeError(f"bad_words must be a list of strings, got {self.bad_words!r}") from None
        for w in words:
            if not isinstance(w, str) or not w.strip():
                raise ValueError(f"bad_words must contain non-blank strings only, got {w!r}")
        object.__setattr__(self, "bad_words", words)
        try:
            seqs = tuple(_int_tuple(f"bad_words_token_ids[{i}]", s) for i, s in enumerate(self.bad_words_token_ids))
        except TypeError:
            raise TypeError(f"bad_words_token_ids must be a list of token-id lists, "
                            f"got {self.bad_words_token_ids!r:.80}") from None
        if any(not s for s in seqs):
            raise ValueError("bad_words_token_ids must not contain an empty sequence")
        object.__setattr__(self, "bad_words_token_ids", seqs)
        if self.token_mask is not None and not callable(self.token_mask):
            raise TypeError(f"token_mask must be a callable or None, got {type(self.token_mask).__name__}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def has_processors(self) -> bool:
        """Some logits processor (engine.logits_processors) changes this request's rows."""
        return (self.min_tokens > 0 or self.logit_bias is not None or self.allowed_token_ids is not None
                or bool(self.bad_words_token_ids) or self.token_mask is not None)

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with nothing changing its logits: its token is the argmax of the raw logits row."""
        return self.is_greedy and not self.has_processors and not self.has_penalties

    @property
    def needs_history(self) -> bool:
        """The sampler needs this request's generated token ids on the host (penalties, bad words, a
        token mask), so the engine resolves them before the next step instead of overlapping it."""
        return self.has_penalties or bool(self.bad_words_token_ids) or self.token_mask is not None


def _int_tuple(name: str, values: Any) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{name} must be a list of token ids, got {values!r:.80}")
    out = tuple(values)
    for i, t in enumerate(out):
        check_int(f"{name}[{i}]", t, minimum=0, maximum=INT64_MAX)
    return out
