"""What the engine hands back: per-request outputs (vLLM's shape) and engine statistics.

Outputs are cumulative by default: each `RequestOutput` a step returns holds everything generated so far
for that request, so a caller may keep only the latest one. A request's `SamplingParams.output_kind` may ask
for "delta" outputs instead (each holds what is new since the request's last output: new token ids, text
and logprobs; `cumulative_logprob` stays the running total; prompt logprobs come once, in the first) or
"final_only" (one output, when the request finishes; what `LLM.generate` asks for). Logprobs are the model's raw
distribution (log_softmax of the logits, before the logits processors (logit_bias, allowed_token_ids, bad
words, min_tokens, token_mask), penalties, temperature or top-k/p filtering), as vLLM reports them by
default (`logprobs_mode="raw_logprobs"`). The exception is structured output: its grammar masks the logits
before both sampling and logprobs (as vLLM does), so its logprobs are those of the masked distribution
(docs/structured-output.md). They are plain Python floats carrying the fp32 bits the kernels
produced, so two runs can be compared with `==`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """Logprob information for one position: the token there, its logprob and rank (1 = most likely),
    and the `k` most likely tokens (token id -> logprob, most likely first; ties: lowest id first)."""

    token_id: int
    logprob: float
    rank: int
    top_logprobs: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class CompletionOutput:
    """One sample of a request.

    index: the sample index (0..n-1). text: detokenized output (the stop string excluded unless
    include_stop_str_in_output; special tokens left out unless skip_special_tokens=False). token_ids: every
    generated token (the one that completed a stop string included, as in vLLM). cumulative_logprob: sum
    of the chosen tokens' logprobs, or None when logprobs were not requested. logprobs: one
    `TokenLogprob` per generated token, or None when not requested. finish_reason: "stop" (EOS, a stop
    token or string), "length" (max_tokens / max_model_len), "abort", or None while running.
    stop_reason: the stop string or stop token id that ended it, if any.
    """

    index: int
    text: str
    token_ids: tuple[int, ...]
    cumulative_logprob: float | None
    logprobs: tuple[TokenLogprob, ...] | None
    finish_reason: str | None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    """A request's state after a step.

    prompt: the prompt text (None when the request was given token ids). prompt_logprobs: None unless
    requested; else one entry per prompt token, the first None (position 0 has no context).
    outputs: one `CompletionOutput` per sample, by sample index. finished: every sample is done.
    error: why the engine aborted this request alone (a failure in its own sampling or forward pass; the
    engine kept serving the others), or None.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    error: str | None = None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for monitoring (a server exports these as Prometheus gauges and counters).

    Gauges: num_running, num_waiting, kv_blocks_used (held by unfinished sequences), kv_blocks_cached
    (free blocks that still hold reusable prefix-cache content; evicted on demand), kv_blocks_total,
    last_step_seconds (wall time of the last step, host and device), last_step_tokens (tokens it fed).
    Counters since start: num_steps, prompt_tokens (prompt and recomputed tokens fed through the model;
    prefix-cache hits are not computed and not counted), generation_tokens (tokens sampled),
    prefix_cache_query_tokens / prefix_cache_hit_tokens, num_preemptions, num_finished_requests.
    """

    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_cached: int
    kv_blocks_total: int
    num_steps: int
    prompt_tokens: int
    generation_tokens: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int
    num_finished_requests: int
    last_step_seconds: float
    last_step_tokens: int

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the KV pool held by running sequences, in [0, 1]."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0
