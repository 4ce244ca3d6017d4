"""Batch-invariant token sampling and logprobs: pure functions of each row's inputs.

Every operation here is either elementwise (per row, per token), an exact selection (sort, max, argmax,
gather, integer counts) or a fixed-order float reduction built from elementwise adds (`fold_sum`, and
`_inclusive_scan` for cumulative sums; both from the numerics backend `Ops`). torch.sum / cumsum /
softmax are not used on probabilities: their reduction order depends on the tensor's shape, so a row's
result could change with the batch around it.
Processing order: the per-row logits processors (logit_bias, allowed_token_ids, bad words, min_tokens,
token_mask: `engine.logits_processors`) -> repetition/presence/frequency penalties -> temperature -> top_k ->
top_p (over the top-k survivors, renormalised) -> min_p -> draw.

Random draws use the Gumbel-max trick with noise from a counter-based hash, not a torch RNG:
    k = splitmix64(splitmix64(splitmix64(seed) ^ t) ^ sample_index)
    h = splitmix64(k ^ token_id);  u = ((h >> 12) + 0.5) / 2**52 in (0, 1);  g = -log(-log(u))
    token = argmax over kept tokens of (z / T + g)   (fp64)
so the token drawn at output position t of sample i is a function of (logits row, seed, t, i) only —
not of the batch, the step, or any generator state. The hash uses int64 tensor ops (wrapping multiply,
masked shifts for the logical right shift), so the noise bits are the same on CPU and CUDA.

Greedy rows (temperature 0) take argmax of the penalised logits; ties go to the lowest token id.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple

import torch

# Per-row values go up through the engine's one host->device path (pinned memory, a non-blocking copy on CUDA):
# the engine enqueues sampling behind a forward pass it does not want to wait for.
from detinfer.cache.paged_kv import upload
from detinfer.engine.logits_processors import process_logits
from detinfer.engine.sampling_params import SamplingParams
from detinfer.ops.backend import Ops


def _as_int64(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _as_int64(0x9E3779B97F4A7C15)
_MIX1 = _as_int64(0xBF58476D1CE4E5B9)
_MIX2 = _as_int64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic, so mask off the sign copies)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function on int64 tensors (two's-complement wraparound = arithmetic mod 2**64)."""
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, sample_indices: torch.Tensor,
                 vocab_size: int) -> torch.Tensor:
    """[S, vocab_size] fp64 standard Gumbel noise; row r depends only on (seeds[r], positions[r],
    sample_indices[r]) and the token id (see module docstring)."""
    key = splitmix64(splitmix64(splitmix64(seeds) ^ positions) ^ sample_indices)
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    bits = _shr(splitmix64(key[:, None] ^ tokens[None, :]), 12)  # 52 random bits
    u = (bits.to(torch.float64) + 0.5) * (2.0 ** -52)  # exact, strictly inside (0, 1)
    return -torch.log(-torch.log(u))


# The float reductions are the numerics backend's fixed-order ones, the same in every mode (sampling is
# always a pure function of the row): a pairwise fold, and a Hillis-Steele scan for cumulative sums.
fold_sum, _inclusive_scan = Ops.fold_sum, Ops.cumsum


def _token_counts(histories: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[S, V] int32 occurrence counts (integer adds: exact in any order)."""
    rows = [r for r, h in enumerate(histories) for _ in h]
    toks = [t for h in histories for t in h]
    counts = torch.zeros(len(histories), vocab_size, dtype=torch.int32, device=device)
    if toks:
        if min(toks) < 0 or max(toks) >= vocab_size:
            raise ValueError(f"token histories hold ids outside [0, {vocab_size})")
        counts.index_put_((upload(rows, torch.int64, device), upload(toks, torch.int64, device)),
                          torch.ones(len(toks), dtype=torch.int32, device=device), accumulate=True)
    return counts


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                    prompt_token_ids: Sequence[Sequence[int]] | None,
                    output_token_ids: Sequence[Sequence[int]] | None) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens; presence/frequency penalties over output tokens
    (vLLM's semantics). Rows without penalties are returned unchanged (bit for bit)."""
    S, V = logits.shape
    if not any(p.has_penalties for p in params):
        return logits
    if prompt_token_ids is None or output_token_ids is None:
        raise ValueError("penalties need prompt_token_ids and output_token_ids for every row")
    if len(prompt_token_ids) != S or len(output_token_ids) != S:
        raise ValueError(f"token histories must have one entry per row ({S}), got "
                         f"{len(prompt_token_ids)} prompt and {len(output_token_ids)} output entries")
    dev = logits.device
    out_counts = _token_counts(output_token_ids, V, dev)
    seen = (_token_counts(prompt_token_ids, V, dev) + out_counts) > 0
    rep = upload([p.repetition_penalty for p in params], torch.float32, dev)[:, None]
    pres = upload([p.presence_penalty for p in params], torch.float32, dev)[:, None]
    freq = upload([p.frequency_penalty for p in params], torch.float32, dev)[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    x = torch.where(seen & (rep != 1.0), penalised, logits)
    additive = freq * out_counts.to(torch.float32) + pres * (out_counts > 0).to(torch.float32)
    return torch.where(additive != 0, x - additive, x)


def sampling_mask(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor) -> torch.Tensor:
    """[S, V] bool: tokens each row may draw. `scaled` = logits / temperature; top_k [S] int64 (<= 0:
    off), top_p [S] and min_p [S] fp32. Ties at a threshold are all kept, so the mask does not depend on
    how sort orders equal values."""
    S, V = scaled.shape
    sorted_desc = torch.sort(scaled, dim=-1, descending=True).values
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
    kth = sorted_desc.gather(1, (k - 1)[:, None])
    keep = scaled >= kth
    # top-p over the top-k survivors: probabilities of the sorted survivors, renormalised.
    surviving = torch.where(sorted_desc >= kth, sorted_desc, torch.full_like(sorted_desc, float("-inf")))
    e = torch.exp(surviving - sorted_desc[:, :1])
    probs = e / fold_sum(e, dim=-1, keepdim=True)
    inclusive = _inclusive_scan(probs)
    mass_before = torch.cat([torch.zeros_like(inclusive[:, :1]), inclusive[:, :-1]], dim=-1)
    # Keep the shortest prefix whose mass reaches top_p: a token is kept if the mass before it < top_p.
    num_kept = (mass_before < top_p[:, None]).sum(-1).clamp(min=1)  # integer count: exact
    pth = sorted_desc.gather(1, (num_kept - 1)[:, None])
    keep &= (scaled >= pth) | (top_p >= 1.0)[:, None]
    # min-p: p / p_max = exp(z - z_max) >= min_p.
    keep &= torch.exp(scaled - sorted_desc[:, :1]) >= min_p[:, None]
    return keep


def _checked_penalised(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int | None],
                       positions: Sequence[int], sample_indices: Sequence[int] | None,
                       prompt_token_ids: Sequence[Sequence[int]] | None,
                       output_token_ids: Sequence[Sequence[int]] | None,
                       eos_token_ids: Collection[int] = ()) -> tuple[torch.Tensor, list[int]]:
    """Validates the per-row arguments; returns (the processed and penalised fp32 logits, the sample indices
    as a list)."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be a 2-D float32 tensor [S, V], got {logits.dim()}-D "
                         f"{str(logits.dtype).replace('torch.', '')}")
    S = logits.shape[0]
    sample_indices = [0] * S if sample_indices is None else list(sample_indices)
    for name, values in (("params", params), ("seeds", seeds), ("positions", positions),
                         ("sample_indices", sample_indices)):
        if len(values) != S:
            raise ValueError(f"{name} must have one entry per logits row ({S}), got {len(values)}")
    for r, (p, seed, t, i) in enumerate(zip(params, seeds, positions, sample_indices, strict=True)):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"params[{r}] must be a SamplingParams, got {type(p).__name__}")
        if seed is None and not p.is_greedy:
            raise ValueError(f"row {r}: temperature {p.temperature} > 0 needs a seed (the scheduler draws "
                             "one when the request is added)")
        if t < 0 or i < 0:
            raise ValueError(f"row {r}: position ({t}) and sample index ({i}) must be >= 0")
    processed = process_logits(logits, params, positions, output_token_ids, eos_token_ids)
    return apply_penalties(processed, params, prompt_token_ids, output_token_ids), sample_indices


def sampling_scores(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int | None],
                    positions: Sequence[int], sample_indices: Sequence[int] | None = None,
                    prompt_token_ids: Sequence[Sequence[int]] | None = None,
                    output_token_ids: Sequence[Sequence[int]] | None = None,
                    eos_token_ids: Collection[int] = ()) -> torch.Tensor:
    """[S, V] fp64 scores whose row-wise argmax is the drawn token (see `sample` for the arguments).

    Sampled rows: penalised logits / T + Gumbel noise, -inf where masked. Greedy rows: the penalised
    logits (no noise). Exposed so tests can check invariance on every bit, not only on the argmax.
    """
    penalised, sample_indices = _checked_penalised(logits, params, seeds, positions, sample_indices,
                                                   prompt_token_ids, output_token_ids, eos_token_ids)
    dev, V = logits.device, logits.shape[1]
    # fp32 -> fp64 is exact and order-preserving: greedy argmax (and its ties) are unchanged.
    x = penalised.to(torch.float64)
    # Shortcuts are decided from the params (host data, no device sync). They skip work whose result
    # would be the identity for every row, so they cannot change any row's bits.
    if all(p.is_greedy for p in params):
        return x
    # Every per-row value goes up in two copies (one int64, one float32 tensor), built from lists once.
    ints = upload([[0 if s is None else s for s in seeds], list(positions), sample_indices,
                   [p.top_k for p in params], [int(p.is_greedy) for p in params]], torch.int64, dev)
    floats = upload([[1.0 if p.is_greedy else p.temperature for p in params], [p.top_p for p in params],
                     [p.min_p for p in params]], torch.float32, dev)
    greedy, temperature = ints[4] != 0, floats[0]
    scaled = penalised / temperature[:, None]
    noise = gumbel_noise(ints[0], ints[1], ints[2], V)
    drawn = scaled.to(torch.float64) + noise
    if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
        keep = sampling_mask(scaled, ints[3], floats[1], floats[2])
        drawn = torch.where(keep, drawn, torch.full_like(drawn, float("-inf")))
    return torch.where(greedy[:, None], x, drawn)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int | None],
           positions: Sequence[int], sample_indices: Sequence[int] | None = None,
           prompt_token_ids: Sequence[Sequence[int]] | None = None,
           output_token_ids: Sequence[Sequence[int]] | None = None,
           eos_token_ids: Collection[int] = ()) -> torch.Tensor:
    """Draw one token per row of `logits` [S, V] fp32; returns [S] int64 token ids.

    Per row r: params[r]; seeds[r] (may be None for greedy rows); positions[r] = output position t of
    the token being drawn; sample_indices[r] = which of the request's n samples (default 0); the prompt
    and output token ids so far (needed only when some row has penalties, bad words or a token_mask);
    eos_token_ids: the model's EOS ids (what min_tokens masks). Each row's token depends only on that row's
    inputs. argmax returns the first maximum, so greedy ties go to the lowest token id.
    """
    if all(isinstance(p, SamplingParams) and p.is_greedy for p in params):
        # The argmax of the fp32 rows is that of their exact fp64 copy (same values, same first maximum):
        # skipping the copy saves writing and reading an [S, V] fp64 tensor (~0.1 ms per step at 64 rows x
        # 152k vocab on an H100).
        penalised, _ = _checked_penalised(logits, params, seeds, positions, sample_indices, prompt_token_ids,
                                          output_token_ids, eos_token_ids)
        return torch.argmax(penalised, dim=-1)
    return torch.argmax(sampling_scores(logits, params, seeds, positions, sample_indices,
                                        prompt_token_ids, output_token_ids, eos_token_ids), dim=-1)


class Logprobs(NamedTuple):
    token_logprobs: torch.Tensor  # [S] logprob of each given token
    token_ranks: torch.Tensor     # [S] int64: 1 + number of tokens strictly more likely
    top_token_ids: torch.Tensor   # [S, k] int64, most likely first; ties: lowest token id first
    top_logprobs: torch.Tensor    # [S, k]


LogSoftmaxFn = Callable[..., torch.Tensor]


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor | Sequence[int], top_k: int,
                     log_softmax_fn: LogSoftmaxFn, *, validate: bool = True) -> Logprobs:
    """Logprobs of `token_ids` [S] under `logits` [S, V], plus each row's top-k (token, logprob).

    `log_softmax_fn(x, dim=-1)` does the normalisation: pass the model's `ops.log_softmax` (the engine
    does) so deterministic mode is batch-invariant. These are logprobs of the distribution the logits describe;
    to score under a temperature, divide the logits first. No engine state: trainers call this to
    recompute the logprobs of sampled tokens. validate=False skips the token-id range check, which reads
    the ids back to the host (the engine passes ids its sampler drew, still on the device).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [S, V], got shape {tuple(logits.shape)}")
    S, V = logits.shape
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= V:
        raise ValueError(f"top_k must be an int in [0, {V}] (the vocab size), got {top_k!r}")
    ids = torch.as_tensor(token_ids, dtype=torch.int64, device=logits.device).reshape(-1)
    if ids.numel() != S:
        raise ValueError(f"token_ids must have one id per logits row ({S}), got {ids.numel()}")
    if validate and S and (int(ids.min()) < 0 or int(ids.max()) >= V):
        raise ValueError(f"token_ids must be in [0, {V}), got min {int(ids.min())} max {int(ids.max())}")
    logprobs = log_softmax_fn(logits, dim=-1)
    chosen = logprobs.gather(1, ids[:, None])
    ranks = (logprobs > chosen).sum(-1) + 1
    if top_k:
        top = torch.sort(logprobs, dim=-1, descending=True, stable=True)
        top_vals, top_ids = top.values[:, :top_k], top.indices[:, :top_k]
    else:
        top_vals = logprobs.new_empty(S, 0)
        top_ids = torch.empty(S, 0, dtype=torch.int64, device=logits.device)
    return Logprobs(chosen[:, 0], ranks, top_ids, top_vals)
