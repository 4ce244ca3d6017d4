"""Grammar-constrained decoding (structured output) with llguidance, as a per-row token mask.

Each sequence with `SamplingParams.structured_outputs` gets its own grammar matcher, advanced by that
sequence's own output tokens and nothing else. Before a step samples, `GrammarMasks.mask_logits` sets the
logits of every token the matcher forbids to -inf, on that sequence's row only. The allowed set is a pure
function of (the constraint, the sequence's output so far), and the masking is elementwise on its row, so
structured requests keep determinism and batch invariance: a request's tokens and logprobs are the same
alone or next to any other requests.

The mask is applied to the logits themselves, before both sampling (greedy or drawn) and logprobs, as vLLM
does (its grammar bitmask is applied to the logits before its sampler, which computes logprobs from them):
a structured request's logprobs are those of the masked distribution, renormalised over the allowed tokens,
and forbidden tokens have logprob -inf.

A sequence ends ("stop") once its grammar can take no more tokens (`is_stopped`: only EOS would be allowed),
without spending a step on the EOS. While the grammar accepts but could go on (a regex `a+`), EOS is
allowed and the model chooses.

llguidance is an optional dependency (`pip install 'detinfer[structured]'`); without it only structured
requests fail, with an error saying what to install.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from typing import Any

import numpy as np
import torch

from detinfer.cache.paged_kv import upload
from detinfer.engine.structured import StructuredOutputError, StructuredOutputs, compile_grammar, llguidance

TEMPLATE_CACHE_SIZE = 64  # compiled grammars kept per engine, least recently used dropped first


class GrammarRefused(RuntimeError):
    """A sequence's grammar refused a token (its matcher is then in an error state, for good)."""


class GrammarMasks:
    """The grammar matchers of one engine's structured sequences, keyed by seq_id, and their logits masks."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Seq[int]):
        llg = llguidance()
        if tokenizer is None or not hasattr(tokenizer, "backend"):
            raise ValueError("structured output needs the model's tokenizer; this engine has none")
        try:
            # The model's vocab_size may exceed the tokenizer's (padded embedding rows): those ids are never
            # allowed. Special tokens never match text; only EOS ends a grammar.
            self._tokenizer = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                              eos_token=list(eos_token_ids) or None)
        except Exception as e:  # the library's own error types
            raise ValueError(f"structured output: llguidance cannot use this model's tokenizer: {e}") from None
        self.vocab_size = vocab_size
        self._executor = llg.LLExecutor()
        self._templates: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._matchers: dict[int, Any] = {}
        self._consumed: dict[int, int] = {}  # seq_id -> output tokens its matcher has taken

    def _template(self, so: StructuredOutputs):
        """A fresh matcher of the constraint, copied from a cached one (building it is the costly part)."""
        key = (so.kind, so.text)
        template = self._templates.get(key)
        if template is None:
            grammar = compile_grammar(*key)
            template = llguidance().LLMatcher(self._tokenizer, grammar, log_level=0)
            if template.is_error():
                raise StructuredOutputError("json" if so.kind == "json_object" else so.kind,
                                            template.get_error().strip())
            self._templates[key] = template
            if len(self._templates) > TEMPLATE_CACHE_SIZE:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(key)
        return template

    def check(self, so: StructuredOutputs) -> None:
        """Compile the constraint for this tokenizer (cached): raises what `add` would."""
        self._template(so)

    def add(self, seq_ids: Seq[int], so: StructuredOutputs) -> None:
        template = self._template(so)
        for sid in seq_ids:
            self._matchers[sid] = template.deep_copy()
            self._consumed[sid] = 0

    def release(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)
        self._consumed.pop(seq_id, None)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def consume(self, seq_id: int, output_position: int, token: int) -> bool:
        """Feed the token sampled at `output_position` (once; repeats are ignored). Returns whether the
        grammar is now complete: it takes no token but EOS, so the sequence should stop."""
        matcher = self._matchers[seq_id]
        if output_position == self._consumed[seq_id]:
            if not matcher.consume_token(token):
                raise GrammarRefused(f"sequence {seq_id}: the grammar refused token {token} at output position "
                                     f"{output_position}: {matcher.get_error()}")
            self._consumed[seq_id] += 1
        elif output_position > self._consumed[seq_id]:
            raise GrammarRefused(f"sequence {seq_id}: output position {output_position} reached the grammar before "
                               f"position {self._consumed[seq_id]}")
        return matcher.is_stopped()

    def consume_step(self, batch, tokens: Seq[int | None]) -> tuple[list[bool], list[tuple[str, str]]]:
        """Feed every structured sequence's sampled token of a read-back step to its matcher. Returns, per
        batch entry, whether its token completed the grammar (the sequence stops: finish_reason "stop", no
        stop_reason), and (request_id, error) of each request whose token the grammar refused (possible only
        when other masks left no allowed token): the engine aborts those requests alone."""
        complete = [False] * len(tokens)
        refused: list[tuple[str, str]] = []
        for i, (item, token) in enumerate(zip(batch.scheduled, tokens, strict=True)):
            seq = item.seq
            if token is None or seq.is_finished or seq.seq_id not in self._matchers:
                continue
            try:
                complete[i] = self.consume(seq.seq_id, item.output_position, token)
            except GrammarRefused as e:
                refused.append((seq.request_id, str(e)))
        return complete, refused

    def _catch_up(self, seq) -> None:
        """Feed the sequence's known output tokens its matcher has not taken yet."""
        if seq.num_pending_tokens:
            raise RuntimeError(f"sequence {seq.seq_id}: its grammar mask needs every earlier token, but "
                               f"{seq.num_pending_tokens} are still on the device")
        outputs = seq.output_token_ids
        for t in range(self._consumed[seq.seq_id], len(outputs)):
            self.consume(seq.seq_id, t, outputs[t])
        matcher = self._matchers[seq.seq_id]
        if matcher.is_error():  # e.g. a grammar past llguidance's resource limits: this sequence alone fails
            raise GrammarRefused(f"sequence {seq.seq_id}: its grammar failed: {matcher.get_error()}")

    def allowed(self, seqs: Seq) -> torch.Tensor:
        """[len(seqs), ceil(V / 32)] int32 bitmask of the tokens each sequence's grammar allows next (bit j of
        word w: token 32 w + j). Computed by the library's parallel executor; each row from its own matcher."""
        for seq in seqs:
            self._catch_up(seq)
        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(seqs), words), -1, dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr([(self._matchers[s.seq_id], i) for i, s in enumerate(seqs)],
                                               bitmask.data_ptr(), words * 4, len(seqs))
        return bitmask

    def mask_logits(self, logits: torch.Tensor, rows: Seq[int], seqs: Seq) -> torch.Tensor:
        """`logits` with row rows[i] masked by seqs[i]'s grammar (-inf where forbidden), for the structured
        sequences among `seqs`; other rows are untouched. Returns a new tensor when it masks anything (the
        runner's output buffer is not written)."""
        picked = [(r, s) for r, s in zip(rows, seqs, strict=True) if s.seq_id in self._matchers]
        if not picked:
            return logits
        dev, V = logits.device, logits.shape[1]
        bitmask = upload(self.allowed([s for _, s in picked]), torch.int32, dev)
        index = upload([r for r, _ in picked], torch.int64, dev)
        allowed = unpack_bitmask(bitmask, V)
        masked = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
        return logits.index_copy(0, index, masked)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 bitmask -> [R, vocab_size] bool (bit j of word w is token 32 w + j). On the device with
    elementwise shifts; on the host numpy's unpackbits (little-endian words, so byte order is bit order),
    which is an order of magnitude faster there than broadcasting shifts."""
    if bitmask.device.type == "cpu":
        bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(bits[:, :vocab_size].view(np.bool_))
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size] != 0
