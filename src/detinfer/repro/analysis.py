"""Analysis of N completions of one prompt: how many are unique, and where and how they diverge.

Pure Python over plain data (no torch, no tokenizer): the runners turn engine or server outputs into
`Completion`s and pass a `decode` function for the token units they carry (token ids for the offline engine,
token strings for a server, characters when a server returns no tokens at all).

Completions are grouped by their exact token sequence. With logprobs, a group's members are also compared
bit for bit on their logprobs (`logprob_variants`): two runs can pick the same tokens while their logits
already differ, which is the early warning of nondeterminism before any token flips.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

Decode = Callable[[Sequence[Any]], str]
CONTEXT_TOKENS = 12  # tokens of continuation shown on each side of a divergence
PREFIX_CHARS = 80  # characters of the shared text shown before a divergence
LOGPROB_WINDOW = 4  # positions before the divergence whose logprobs are listed side by side


@dataclass(frozen=True)
class Completion:
    """One run's output. tokens: token ids or token strings, None when the source gave no tokens (then
    the text's characters are the units compared). logprobs: the chosen token's logprob per position;
    top_logprobs: per position, (token, logprob) pairs of the most likely tokens. meta: how the run was
    made (arrival, background load, latency), reported as is."""

    run: int
    text: str
    tokens: tuple[Any, ...] | None = None
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[tuple[tuple[Any, float], ...], ...] | None = None
    finish_reason: str | None = None
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if isinstance(self.run, bool) or not isinstance(self.run, int):
            raise TypeError(f"run must be an int, got {self.run!r}")
        if not isinstance(self.text, str):
            raise TypeError(f"text must be a str, got {type(self.text).__name__}")
        if self.tokens is not None:
            object.__setattr__(self, "tokens", tuple(self.tokens))
        n = len(self.units)
        if self.logprobs is not None:
            object.__setattr__(self, "logprobs", tuple(float(x) for x in self.logprobs))
            if len(self.logprobs) != n:
                raise ValueError(f"run {self.run}: {len(self.logprobs)} logprobs for {n} tokens")
        if self.top_logprobs is not None:
            tops = tuple(tuple((t, float(lp)) for t, lp in pos) for pos in self.top_logprobs)
            object.__setattr__(self, "top_logprobs", tops)
            if len(tops) != n:
                raise ValueError(f"run {self.run}: {len(tops)} top_logprobs entries for {n} tokens")

    @property
    def units(self) -> tuple[Any, ...]:
        """What is compared: the tokens, or the text's characters when there are no tokens."""
        return self.tokens if self.tokens is not None else tuple(self.text)


def first_divergence(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    """Index of the first position where a and b differ; the shorter length when one is a prefix of the
    other (one run stopped earlier); None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def first_logprob_divergence(a: Completion, b: Completion) -> int | None:
    """First position where a and b differ in their token or in their logprob's bits; None when both
    match everywhere (both need logprobs)."""
    if a.logprobs is None or b.logprobs is None:
        raise ValueError("first_logprob_divergence needs logprobs on both completions")
    d = first_divergence(a.units, b.units)
    end = min(len(a.units), len(b.units)) if d is None else d
    for i in range(end):
        if repr(a.logprobs[i]) != repr(b.logprobs[i]):
            return i
    return d


def max_logprob_difference(reference: Completion,
                           completions: Sequence[Completion]) -> tuple[float, tuple[int, int] | None]:
    """The largest |logprob(run) - logprob(reference)| over every run and every position where the run
    has so far produced exactly the reference's tokens (that token included): there both scored the same
    token after the same context, so the difference is the numerics' alone. Once the tokens part, the
    contexts differ and the logprobs are no longer comparable, so later positions are left out. Positions
    where either logprob is not finite are left out too. Returns (difference, (run, position)), the
    earliest run and position on ties; (0.0, None) when every compared logprob is bit-identical."""
    if reference.logprobs is None or any(c.logprobs is None for c in completions):
        raise ValueError("max_logprob_difference needs logprobs on every completion")
    best, at = 0.0, None
    for c in sorted(completions, key=lambda c: c.run):
        d = first_divergence(reference.units, c.units)
        shared = min(len(reference.units), len(c.units)) if d is None else d
        for i in range(shared):
            a, b = reference.logprobs[i], c.logprobs[i]
            if math.isfinite(a) and math.isfinite(b) and abs(a - b) > best:
                best, at = abs(a - b), (c.run, i)
    return best, at


def join_decode(units: Sequence[Any]) -> str:
    """Decoder for token strings or characters: concatenation."""
    return "".join(str(u) for u in units)


@dataclass(frozen=True)
class Group:
    """A distinct completion: its rank by count (0 = most common), how many runs produced it, which, and
    a representative run's completion (from its most common logprob variant, else its first run).
    variant_counts: runs per distinct logprob sequence among its runs, most common first (empty without
    logprobs); a single entry means every run reproduced the logprobs bit for bit as well."""

    rank: int
    count: int
    runs: tuple[int, ...]
    completion: Completion
    variant_counts: tuple[int, ...] = ()

    @property
    def logprob_variants(self) -> int | None:
        return len(self.variant_counts) if self.variant_counts else None


@dataclass(frozen=True)
class PairDivergence:
    """Where distinct completions `a` and `b` (group ranks) part. index: first differing unit. prefix: the
    end of their shared text; a_text / b_text: what each says from there (CONTEXT_TOKENS units; "" at the
    end of a completion). With logprobs: each run's logprob of its own token there, of the other run's
    token (from its top logprobs, None when not among them), the first position where their logprobs
    differ at all, the largest difference over the shared prefix, and a window of (index, a, b) logprobs
    up to the divergence."""

    a: int
    b: int
    a_count: int
    b_count: int
    index: int
    prefix: str
    a_text: str
    b_text: str
    a_ended: bool
    b_ended: bool
    a_logprob: float | None = None
    b_logprob: float | None = None
    a_logprob_of_b_token: float | None = None
    b_logprob_of_a_token: float | None = None
    first_logprob_diff: int | None = None
    max_prefix_logprob_diff: float | None = None
    logprob_window: tuple[tuple[int, float, float], ...] = ()


@dataclass(frozen=True)
class Summary:
    """Everything the report shows for one set of N runs.

    num_unique: distinct completions; most_common_count: runs that produced the most common one;
    agreed_prefix: units every run shares (None when all are identical); divergence_from_mode: per group,
    its first divergence from group 0 (None for group 0); num_unique_logprobs: distinct (tokens, logprobs)
    sequences (None unless every run has logprobs); reference_run: the run group 0 is represented by (the
    first run of its most common logprob variant); logprob_divergence: for each run whose tokens or
    logprob bits differ from the reference run, the first position where either differs (empty without
    logprobs); pairs: the pairwise divergences of the most common groups, pairs_left_out of them not
    listed (max_pairs). max_logprob_diff: see `max_logprob_difference` (None without logprobs), with
    max_logprob_diff_at its (run, position) (None when every compared logprob is bit-identical)."""

    n: int
    unit: str
    num_unique: int
    most_common_count: int
    groups: tuple[Group, ...]
    agreed_prefix: int | None
    divergence_from_mode: tuple[int | None, ...]
    num_unique_logprobs: int | None
    reference_run: int
    logprob_divergence: tuple[int, ...]
    pairs: tuple[PairDivergence, ...]
    pairs_left_out: int
    max_logprob_diff: float | None = None
    max_logprob_diff_at: tuple[int, int] | None = None

    @property
    def divergence_positions(self) -> list[int]:
        """One entry per run that differs from the most common completion: where it departs from it."""
        out: list[int] = []
        for g, d in zip(self.groups, self.divergence_from_mode):
            if d is not None:
                out += [d] * g.count
        return out


def group_completions(completions: Sequence[Completion]) -> list[Group]:
    """Groups by exact unit sequence, most common first (ties: the group whose first run came first)."""
    by_key: dict[tuple, list[Completion]] = {}
    for c in completions:
        by_key.setdefault(c.units, []).append(c)
    members = sorted(by_key.values(), key=lambda cs: (-len(cs), min(c.run for c in cs)))
    groups = []
    for rank, cs in enumerate(members):
        cs = sorted(cs, key=lambda c: c.run)
        rep, counts = cs[0], ()
        if all(c.logprobs is not None for c in cs):
            by_bits: dict[tuple, list[Completion]] = {}
            for c in cs:
                by_bits.setdefault(_bits(c.logprobs), []).append(c)
            # most common variant first (ties: earliest run); its first run stands for the group, so the
            # reference the other runs are compared with is the majority's numerics, not an outlier's
            variants = sorted(by_bits.values(), key=lambda v: (-len(v), v[0].run))
            rep, counts = variants[0][0], tuple(len(v) for v in variants)
        groups.append(Group(rank, len(cs), tuple(c.run for c in cs), rep, counts))
    return groups


def _bits(logprobs: Sequence[float]) -> tuple:
    """Exact identity of a logprob sequence: floats compared by value would merge -0.0 and 0.0, and NaN
    would never equal itself; repr round-trips every double exactly."""
    return tuple(repr(x) for x in logprobs)


def _top_lookup(top: Sequence[tuple[Any, float]] | None, token: Any) -> float | None:
    if top is None:
        return None
    for t, lp in top:
        if t == token:
            return lp
    return None


def pair_divergence(a: Group, b: Group, decode: Decode = join_decode) -> PairDivergence:
    """Describe where two distinct groups part (see PairDivergence)."""
    ca, cb = a.completion, b.completion
    ua, ub = ca.units, cb.units
    d = first_divergence(ua, ub)
    if d is None:
        raise ValueError(f"groups {a.rank} and {b.rank} hold the same completion")
    shared = decode(ua[:d])
    # Decode prefix + continuation together and cut at the shared text, so a multi-byte character split
    # across tokens still decodes whole.
    a_text = decode(ua[:d + CONTEXT_TOKENS])[len(shared):]
    b_text = decode(ub[:d + CONTEXT_TOKENS])[len(shared):]
    out: dict[str, Any] = dict(a=a.rank, b=b.rank, a_count=a.count, b_count=b.count, index=d,
                               prefix=shared[-PREFIX_CHARS:], a_text=a_text, b_text=b_text,
                               a_ended=d >= len(ua), b_ended=d >= len(ub))
    la, lb = ca.logprobs, cb.logprobs
    if la is not None and lb is not None:
        if d < len(ua):
            out["a_logprob"] = la[d]
        if d < len(ub):
            out["b_logprob"] = lb[d]
        if d < len(ua) and d < len(ub) and ca.top_logprobs is not None and cb.top_logprobs is not None:
            out["a_logprob_of_b_token"] = _top_lookup(ca.top_logprobs[d], ub[d])
            out["b_logprob_of_a_token"] = _top_lookup(cb.top_logprobs[d], ua[d])
        # Over the shared prefix both runs scored the same tokens, so their logprobs are comparable; the
        # divergence position itself scores different tokens and is only listed, not diffed.
        diffs = [i for i in range(d) if _bits([la[i]]) != _bits([lb[i]])]
        out["first_logprob_diff"] = diffs[0] if diffs else None
        finite = [abs(la[i] - lb[i]) for i in range(d) if math.isfinite(la[i]) and math.isfinite(lb[i])]
        out["max_prefix_logprob_diff"] = max(finite, default=0.0)
        lo = max(0, d - LOGPROB_WINDOW)
        out["logprob_window"] = tuple((i, la[i], lb[i]) for i in range(lo, min(d + 1, len(ua), len(ub))))
    return PairDivergence(**out)


def summarize(completions: Sequence[Completion], decode: Decode = join_decode,
              max_pairs: int = 100) -> Summary:
    """Unique counts, divergence from the most common completion and pairwise divergences.

    Pairs are taken in rank order (most common groups first), at most `max_pairs` of them: k distinct
    completions have k(k-1)/2 pairs, and the rare ones add little."""
    if not completions:
        raise ValueError("no completions to summarize")
    if isinstance(max_pairs, bool) or not isinstance(max_pairs, int) or max_pairs < 0:
        raise ValueError(f"max_pairs must be an int >= 0, got {max_pairs!r}")
    runs = [c.run for c in completions]
    if len(set(runs)) != len(runs):
        raise ValueError("completions must have distinct run indices")
    with_tokens = [c.tokens is not None for c in completions]
    if any(with_tokens) and not all(with_tokens):
        raise ValueError("either every completion carries tokens or none does (they are compared)")
    groups = group_completions(completions)
    mode_units = groups[0].completion.units
    from_mode = tuple(None if g.rank == 0 else first_divergence(mode_units, g.completion.units) for g in groups)
    agreed = min((d for d in from_mode if d is not None), default=None)
    num_lp, lp_div, max_diff, max_diff_at = None, [], None, None
    if all(c.logprobs is not None for c in completions):
        num_lp = len({(c.units, _bits(c.logprobs)) for c in completions})
        ref = groups[0].completion
        for c in sorted(completions, key=lambda c: c.run):
            d = first_logprob_divergence(ref, c)
            if d is not None:
                lp_div.append(d)
        max_diff, max_diff_at = max_logprob_difference(ref, completions)
    pairs, total = [], len(groups) * (len(groups) - 1) // 2
    for i in range(len(groups)):
        for j in range(i + 1, len(groups)):
            if len(pairs) == max_pairs:
                break
            pairs.append(pair_divergence(groups[i], groups[j], decode))
    return Summary(n=len(completions), unit="token" if all(with_tokens) else "char",
                   num_unique=len(groups), most_common_count=groups[0].count, groups=tuple(groups),
                   agreed_prefix=agreed, divergence_from_mode=from_mode, num_unique_logprobs=num_lp,
                   reference_run=groups[0].completion.run, logprob_divergence=tuple(lp_div),
                   pairs=tuple(pairs), pairs_left_out=total - len(pairs), max_logprob_diff=max_diff,
                   max_logprob_diff_at=max_diff_at)
