"""Per-request sampling parameters (frozen, validated; names and meanings follow vLLM's SamplingParams).

No torch here: the scheduler reads these (stop conditions, n, prompt logprobs) in pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from detinfer.engine.config import MAX_SEED, check_float, check_int
from detinfer.engine.structured import StructuredOutputs

PENALTY_RANGE = 2.0  # presence/frequency penalties live in [-2, 2] (OpenAI's range)
# Bounds of what the sampler can hold: counts, ids and top_k travel as int64; temperature and the
# repetition penalty divide float32 logits, so they must be normal, finite float32 numbers.
INT64_MAX = (1 << 63) - 1
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_MIN_NORMAL = 1.1754943508222875e-38
# Temperatures below this sample greedily. Why: the sampler draws argmax(z / T + g) with Gumbel noise g,
# |g| < 40 for every 52-bit uniform draw, so at T = 1e-5 only tokens whose logits lie within 4e-4 of the
# best can still be drawn (sampling is already greedy but for near-ties), while much smaller T overflow
# z / T in float32 (T < ~1e-37 turns logits into inf and NaN, and the draw into garbage).
MIN_SAMPLING_TEMPERATURE = 1e-5


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
    structured_outputs: a `StructuredOutputs` (JSON schema, JSON object, regex, choice or grammar) the output
        must match; None: free text. See docs/structured-output.md.
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
    structured_outputs: StructuredOutputs | None = None

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
