"""Per-row logits processors: logit_bias, allowed_token_ids, bad words, min_tokens and the `token_mask` hook.

`process_logits` runs in the sampler before penalties and temperature (vLLM's order), for sampled and greedy
rows alike. Each row's result is a pure function of that row's own inputs: its logits, its SamplingParams,
its output position (= the number of tokens generated so far) and its generated token ids. Every change is
elementwise (an add of a bias, or -inf where a token is masked), so a row gets the same bits alone or in
any batch, and rows whose requests use no processor are returned bit for bit unchanged.

Order: logit_bias is added, then the masks (allowed_token_ids, bad words, min_tokens, token_mask) set their
tokens to -inf. A row whose masks exclude every token has only -inf logits: it draws token 0 (the first
maximum), whatever its sampling settings; avoiding that (e.g. allowed_token_ids all banned) is the caller's job.

Extension point (`SamplingParams.token_mask`): a callable `token_mask(output_token_ids) -> allowed` per
request, where `allowed` is a sequence of the token ids allowed next, a [vocab] bool tensor, or None for no
constraint. It is called once per sampled row per step, on the host, with the row's generated ids so far
(a tuple); it must depend on nothing else, so the constrained request stays reproducible and batch-invariant.
Structured output (`SamplingParams.structured_outputs`) does not use this hook: its grammar masks the logits in
`device_step.launch_step`, before the sampler, so that its logprobs are the masked ones (as in vLLM).

The reported logprobs are not affected by these processors: they are the raw model distribution (see
engine.outputs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

import torch

from detinfer import admission
from detinfer.cache.paged_kv import upload
from detinfer.engine.sampling_params import SamplingParams


def bad_word_sequences(tokenizer, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The token sequences that spell each bad word: as written and with one leading space (how a word
    usually appears after another), without special tokens; duplicates dropped, order kept."""
    seqs: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                seqs[ids] = None
    return tuple(seqs)


def prepare_processors(params: SamplingParams, tokenizer, vocab_size: int) -> SamplingParams:
    """What the engine does when a request is added: `params` with bad_words tokenized into
    bad_words_token_ids, after checking every token id the processors use against the vocabulary (a bad id
    is a ValueError here, never an error inside a step)."""
    if params.bad_words:
        if tokenizer is None:
            raise ValueError("bad_words need a tokenizer; this engine has none (use bad_words_token_ids)")
        params = dataclasses.replace(params, bad_words_token_ids=params.bad_words_token_ids
                                     + bad_word_sequences(tokenizer, params.bad_words))
    used = {"logit_bias": [t for t, _ in params.logit_bias or ()],
            "allowed_token_ids": list(params.allowed_token_ids or ()),
            "bad_words_token_ids": [t for seq in params.bad_words_token_ids for t in seq]}
    for name, ids in used.items():
        admission.check_token_ids(name, ids, vocab_size)
    return params


def _banned_last_tokens(bad_words: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """Last tokens of the banned sequences whose other tokens are exactly the latest generated ones."""
    banned = []
    for word in bad_words:
        head = len(word) - 1
        if head == 0 or (len(output) >= head and list(output[len(output) - head:]) == list(word[:head])):
            banned.append(word[-1])
    return banned


def _stop_ids(p: SamplingParams, eos_token_ids: Collection[int], vocab_size: int) -> list[int]:
    """What min_tokens holds back: the request's stop token ids, and EOS unless it ignores EOS (ids beyond the
    vocabulary are left out: they can never be drawn, and a stop id is not checked against the model)."""
    ids = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(eos_token_ids))
    return [t for t in ids if t < vocab_size]


def _allowed_mask(allowed, row: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[V] bool from a token_mask result (ids or a [V] bool tensor)."""
    if isinstance(allowed, torch.Tensor):
        if allowed.dtype != torch.bool or allowed.shape != (vocab_size,):
            raise ValueError(f"row {row}: token_mask returned a {tuple(allowed.shape)} {allowed.dtype} tensor; "
                             f"a mask must be a [{vocab_size}] bool tensor")
        return allowed.to(device)
    ids = admission.check_token_ids(f"row {row}: token_mask", allowed, vocab_size)
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[ids] = True
    return upload(mask, torch.bool, device)


def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int],
                   output_token_ids: Sequence[Sequence[int]] | None,
                   eos_token_ids: Collection[int] = ()) -> torch.Tensor:
    """`logits` [S, V] fp32 with each row's processors applied (see the module docstring).

    positions[r]: row r's output position (tokens generated so far, what min_tokens counts);
    output_token_ids[r]: its generated ids (needed only when some row has bad words or a token_mask);
    eos_token_ids: the model's EOS ids (min_tokens masks them unless the request ignores EOS).
    """
    S, V = logits.shape
    if not any(p.has_processors for p in params):
        return logits
    if output_token_ids is None and any(p.bad_words_token_ids or p.token_mask is not None for p in params):
        raise ValueError("bad words and token masks need output_token_ids for every row")
    bias_rows, bias_toks, bias_vals = [], [], []
    ban_rows, ban_toks = [], []
    allow: dict[int, torch.Tensor] = {}  # row -> [V] bool, rows with allowed_token_ids or a token_mask
    for r, p in enumerate(params):
        if not p.has_processors:
            continue
        for t, b in p.logit_bias or ():
            bias_rows.append(r)
            bias_toks.append(t)
            bias_vals.append(b)
        banned = []
        if p.bad_words_token_ids:
            banned += _banned_last_tokens(p.bad_words_token_ids, output_token_ids[r])
        if positions[r] < p.min_tokens:
            banned += _stop_ids(p, eos_token_ids, V)
        ban_rows += [r] * len(banned)
        ban_toks += banned
        if p.allowed_token_ids is not None:
            allow[r] = _allowed_mask(p.allowed_token_ids, r, V, logits.device)
        if p.token_mask is not None:
            allowed = p.token_mask(tuple(output_token_ids[r]))
            if allowed is not None:
                mask = _allowed_mask(allowed, r, V, logits.device)
                allow[r] = allow[r] & mask if r in allow else mask
    admission.check_token_ids("logit_bias", bias_toks, V)
    admission.check_token_ids("bad words / min_tokens", ban_toks, V)
    dev = logits.device
    x = logits
    if bias_rows:
        bias = torch.zeros(S, V, dtype=torch.float32)
        bias[bias_rows, bias_toks] = torch.tensor(bias_vals, dtype=torch.float32)
        bias = upload(bias, torch.float32, dev)
        # Only biased entries change: adding 0.0 elsewhere would turn -0.0 logits into +0.0.
        x = torch.where(bias != 0, x + bias, x)
    if ban_rows or allow:
        masked = torch.zeros(S, V, dtype=torch.bool)
        masked[ban_rows, ban_toks] = True
        masked = upload(masked, torch.bool, dev)
        for r, ok in allow.items():
            masked[r] |= ~ok
        x = torch.where(masked, torch.full_like(x, float("-inf")), x)
    return x
