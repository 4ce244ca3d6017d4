"""Helpers shared by the attention tests: sequences, multi-step plans, and a paged store that runs them.

A *plan* is a list of steps; a step is a list of (sequence index, new tokens) plus launch keywords. The
runner allocates shuffled physical blocks from a NaN-poisoned pool (a wrong read shows as NaN), writes
each step's new K/V with `write_kv`, runs attention on the step's packed queries, and scatters the
outputs back per sequence, so two plans over the same sequences can be compared token by token.
The module's own tests check the helpers themselves.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st

from detinfer.cache import build_block_tables, build_slot_mapping
from detinfer.kernels.attention import paged_attention
from detinfer.kernels.attention_ref import attend_ref
from detinfer.kernels.kv_write import write_kv

HAS_CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if HAS_CUDA else "cpu")
# |out - ref| <= ATOL + RTOL * |ref| against a float64 reference; values ~ N(0, 1). 16-bit dtypes round
# the softmax weights to the value dtype before the PV product (as every flash kernel does).
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}


@dataclass
class SeqData:
    q: torch.Tensor  # [L, Hq, D]
    k: torch.Tensor  # [L, Hkv, D]
    v: torch.Tensor  # [L, Hkv, D]

    @property
    def length(self) -> int:
        return self.q.shape[0]


def make_seqs(lengths, hq, hkv, d, dtype, seed, device=DEV) -> list[SeqData]:
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for n in lengths:
        q, k, v = (torch.randn((n, h, d), generator=g, dtype=torch.float32, device=device).to(dtype)
                   for h in (hq, hkv, hkv))
        out.append(SeqData(q, k, v))
    return out


def reference(seq: SeqData, scale: float, window=None) -> torch.Tensor:
    """float64 attention of every token of the sequence over its own prefix."""
    pos = torch.arange(seq.length, device=seq.q.device)
    return attend_ref(seq.q.double(), seq.k.double(), seq.v.double(), pos, scale, window)


def assert_accurate(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    err = (out.double() - ref).abs()
    bad = ~(err <= atol + rtol * ref.abs())  # NaN (unwritten or a poisoned read) fails too
    assert not bad.any(), f"{int(bad.sum())}/{bad.numel()} elements off; worst err {err.nan_to_num(1e9).max():.3g}"


@dataclass
class Step:
    entries: list[tuple[int, int]]  # (sequence index, new tokens this step), in packed order
    kwargs: dict = field(default_factory=dict)


def whole_plan(lengths, **kwargs) -> list[Step]:
    """Every sequence's whole prompt in one step."""
    return [Step([(i, n) for i, n in enumerate(lengths)], dict(kwargs))]


def prefill_then_decode(lengths, prefix, **kwargs) -> list[Step]:
    """The first prefix[i] tokens of each sequence in one step, then one token per sequence per step."""
    first = [(i, p) for i, p in enumerate(prefix) if p]
    steps = [Step(first, dict(kwargs))] if first else []
    done = list(prefix)
    while any(d < n for d, n in zip(done, lengths, strict=True)):
        entries = [(i, 1) for i, (d, n) in enumerate(zip(done, lengths, strict=True)) if d < n]
        for i, _ in entries:
            done[i] += 1
        steps.append(Step(entries, dict(kwargs, max_q_len=1)))
    return steps


@st.composite
def random_plans(draw, lengths, max_steps=6, schedules=("auto", "parallel", "sequential")):
    """Random chunkings (chunk sizes 1..L), interleaved into steps of random composition and order, with a
    random schedule, hint and extra block-table width per step."""
    chunks = []
    for n in lengths:
        cuts = sorted(set(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=min(max_steps - 1, n - 1)))))
        bounds = [0, *[c for c in cuts if 0 < c < n], n]
        chunks.append([b - a for a, b in zip(bounds, bounds[1:], strict=False)])
    rng = random.Random(draw(st.integers(0, 2**31 - 1)))
    pending = [list(c) for c in chunks]
    steps = []
    while any(pending):
        ready = [i for i, c in enumerate(pending) if c]
        chosen = rng.sample(ready, rng.randint(1, len(ready)))
        entries = [(i, pending[i].pop(0)) for i in chosen]
        kwargs = {"schedule": rng.choice(schedules), "extra_blocks": rng.randint(0, 3)}
        if rng.random() < 0.5:
            kwargs["max_q_len"] = max(n for _, n in entries)
        steps.append(Step(entries, kwargs))
    return steps


class PagedRunner:
    """Runs plans over `seqs` through a NaN-poisoned paged pool with shuffled physical blocks."""

    def __init__(self, seqs: list[SeqData], block_size: int = 16, seed: int = 0, spare_blocks: int = 8):
        self.seqs, self.block_size = seqs, block_size
        hkv, d = seqs[0].k.shape[1:]
        need = sum(-(-s.length // block_size) for s in seqs) + spare_blocks
        dev, dtype = seqs[0].q.device, seqs[0].q.dtype
        self.k_cache = torch.full((need, block_size, hkv, d), float("nan"), dtype=dtype, device=dev)
        self.v_cache = torch.full_like(self.k_cache, float("nan"))
        self.free = list(range(need))
        random.Random(seed).shuffle(self.free)

    def run(self, plan: list[Step], scale: float, attn=paged_attention, **common) -> list[torch.Tensor]:
        """Run a whole plan from an empty cache; returns each sequence's outputs [L, Hq, D]."""
        self.reset()
        outs = [torch.full_like(s.q, float("nan")) for s in self.seqs]
        for step in plan:
            starts = list(self.cached)
            res = self.run_more(step.entries, scale, attn=attn, **dict(common, **step.kwargs))
            for (i, n), out in zip(step.entries, res, strict=True):
                outs[i][starts[i]:starts[i] + n] = out
        return outs

    def reset(self) -> None:
        self.free.extend(b for blocks in getattr(self, "blocks", []) for b in reversed(blocks))
        self.cached = [0] * len(self.seqs)
        self.blocks: list[list[int]] = [[] for _ in self.seqs]

    def run_more(self, entries: list[tuple[int, int]], scale: float, attn=paged_attention, commit=True,
                 extra_blocks: int = 0, **kw) -> list[torch.Tensor]:
        """One step from the current cache state: write the entries' new K/V, attend, return one
        [n, Hq, D] output per entry. commit=False forgets the step afterwards (its slots are rewritten
        with the same values by a later step)."""
        if not hasattr(self, "cached"):
            self.reset()
        seqs, bs, dev = self.seqs, self.block_size, self.seqs[0].q.device
        idx = [i for i, _ in entries]
        for i, n in entries:
            while len(self.blocks[i]) * bs < self.cached[i] + n:
                self.blocks[i].append(self.free.pop())
        starts = [self.cached[i] for i in idx]
        counts = [n for _, n in entries]
        lists = [self.blocks[i] for i in idx]
        tables = build_block_tables(lists, max_blocks=max(map(len, lists)) + extra_blocks, device=dev)
        slots = build_slot_mapping(lists, starts, counts, bs, device=dev)
        cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        kv_lens = torch.tensor([c + n for c, n in zip(starts, counts, strict=True)], dtype=torch.int32,
                               device=dev)
        new = {name: torch.cat([getattr(seqs[i], name)[c:c + n]
                                for (i, n), c in zip(entries, starts, strict=True)])
               for name in ("q", "k", "v")}
        write_kv(new["k"], new["v"], self.k_cache, self.v_cache, slots)
        self.last_step = {"q": new["q"], "block_tables": tables, "kv_lens": kv_lens, "cu_q_lens": cu}
        out = attn(new["q"], self.k_cache, self.v_cache, tables, kv_lens, cu, scale, **kw)
        if commit:
            for i, n in entries:
                self.cached[i] += n
        return list(out.split(counts))


def test_random_plans_cover_every_token_once():
    from hypothesis import given, settings

    @settings(max_examples=20)
    @given(st.data())
    def check(data):
        lengths = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=4))
        plan = data.draw(random_plans(lengths))
        seen = [0] * len(lengths)
        for step in plan:
            assert len({i for i, _ in step.entries}) == len(step.entries)
            for i, n in step.entries:
                assert n >= 1
                seen[i] += n
        assert seen == lengths

    check()


def test_prefill_then_decode_plan():
    plan = prefill_then_decode([5, 3], [2, 3])
    assert plan[0].entries == [(0, 2), (1, 3)]
    assert [s.entries for s in plan[1:]] == [[(0, 1)], [(0, 1)], [(0, 1)]]
