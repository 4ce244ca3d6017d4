"""One request inside `LLMEngine`: its sequences (one per sample), their incremental detokenizers, the logprob
sums, and how its `RequestOutput`s are built.

Outputs follow `SamplingParams.output_kind`: "cumulative" (everything so far, every time), "delta" (what is new
since the last output: `reported` remembers, per sample, how many tokens, text characters and logprobs went
out) or "final_only" (the engine asks for an output only when the request has finished). The engine keeps the
table of live requests; a state only reports, it never removes itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from detinfer.engine.outputs import CompletionOutput, RequestOutput
from detinfer.engine.sampling_params import SamplingParams
from detinfer.engine.sequence import Sequence


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    seqs: list[Sequence]
    detokenizers: list  # one IncrementalDetokenizer per sample, or None without a tokenizer
    cumulative_logprobs: list[float] = field(default_factory=list)
    error: str | None = None  # set when the engine aborted this request alone (LLMEngine._isolate_failure)
    # output_kind "delta": per sample, (output tokens, text characters, logprobs) already reported
    reported: list[tuple[int, int, int]] | None = None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def text_stop(self, seq: Sequence, token: int, grammar_complete: set[int]) -> str | bool | None:
        """The scheduler's `TextStop` for one of this request's sequences: feed the token to the sequence's
        detokenizer and report the stop string it completes, or True when it completed the sequence's grammar
        (docs/structured-output.md). The scheduler asks only for tokens that do not end their sequence by
        themselves (a stop token's text is never shown) and only for sequences not finished before the token
        came back."""
        detok = self.detokenizers[seq.sample_index]
        stop = None
        if detok is not None:
            detok.add(token)
            stop = detok.stopped
        return stop or seq.seq_id in grammar_complete

    def finish_text(self, seq: Sequence) -> None:
        """Release the text a finished sequence's detokenizer held back (a possible stop string's start)."""
        detok = self.detokenizers[seq.sample_index]
        if detok is not None:
            detok.finish()

    def output(self) -> RequestOutput:
        """This request's output now (module doc: cumulative or delta; a delta output advances `reported`)."""
        wants = self.params.logprobs is not None
        delta = self.params.output_kind == "delta"
        first = self.reported is None
        if delta and first:
            self.reported = [(0, 0, 0)] * len(self.seqs)
        outs = []
        for seq, detok in zip(self.seqs, self.detokenizers):
            i = seq.sample_index
            tokens, chars, lps = self.reported[i] if delta else (0, 0, 0)
            text = "" if detok is None else detok.text
            ids = seq.token_ids[seq.num_prompt_tokens + tokens:seq.num_known_tokens]
            if delta:
                self.reported[i] = (tokens + len(ids), len(text), len(seq.output_logprobs))
            outs.append(CompletionOutput(index=i, text=text[chars:], token_ids=tuple(ids),
                                         cumulative_logprob=self.cumulative_logprobs[i] if wants else None,
                                         logprobs=tuple(seq.output_logprobs[lps:]) if wants else None,
                                         finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        prompt_lp = None
        if self.params.prompt_logprobs is not None and (first or not delta):
            prompt_lp = (None, *self.seqs[0].prompt_logprobs)
        finished = self.finished
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, prompt_lp, tuple(outs), finished,
                             self.error if finished else None)
