"""The vocab-parallel greedy pick (`local_argmax` on each rank's logits columns, `pick_greedy` over the ranks'
candidates) against torch.argmax of the full row, bitwise, on rows built to break it: ties inside a shard and
across shards, NaN, all -inf rows, -0.0 against +0.0, rows whose every logit is negative (the last shard's
zero padding would win if it were scanned), and shards with no real column (V <= (P - 1) x V')."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.distributed.layers import local_argmax, pick_greedy

SPECIALS = [float("nan"), float("-inf"), float("inf"), -0.0, 0.0, -1.0, -2.0, 3.0, 1e-30]


def shards(full: torch.Tensor, p: int) -> list[torch.Tensor]:
    """[S, V] -> P shards [S, V'] as the ranks hold them: V' = ceil(V / P), the last zero-padded."""
    per = math.ceil(full.shape[1] / p)
    padded = torch.zeros(full.shape[0], per * p)
    padded[:, :full.shape[1]] = full
    return [padded[:, r * per:(r + 1) * per] for r in range(p)]


def pick(full: torch.Tensor, p: int) -> torch.Tensor:
    """What `TPTransformer.greedy_ids` computes, the all-gather replaced by a stack."""
    parts, v = shards(full, p), full.shape[1]
    per = parts[0].shape[1]
    return pick_greedy(torch.stack([local_argmax(x[:, :max(0, min(per, v - r * per))], r * per)
                                    for r, x in enumerate(parts)]))


@st.composite
def rows(draw):
    s = draw(st.sampled_from([1, 2, 7, 33]))
    v = draw(st.sampled_from([1, 3, 9, 10, 64, 333]))
    # few distinct values: ties everywhere; negatives often: the padding trap
    pool = torch.tensor(draw(st.lists(st.sampled_from(SPECIALS), min_size=1, max_size=4)))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    return pool[torch.randint(len(pool), (s, v), generator=gen)]


@settings(max_examples=300, deadline=None)
@given(full=rows(), p=st.sampled_from([1, 2, 3, 4, 8]))
def test_pick_is_the_argmax_of_the_full_row(full, p):
    assert torch.equal(pick(full, p), torch.argmax(full, dim=-1))


def test_the_hard_cases_by_name():
    nan, inf = float("nan"), float("inf")
    full = torch.tensor([
        [-5.0, -3.0, -3.0, -4.0, -3.0],  # every logit negative; a tie split across shards
        [-inf] * 5,  # nothing but -inf: token 0
        [1.0, nan, 2.0, nan, 0.0],  # first NaN wins, as in argmax
        [-0.0, -1.0, 0.0, -1.0, -2.0],  # -0.0 == +0.0: the first one
        [0.0, 0.0, 0.0, 7.0, 7.0],  # the maximum in the last shard only
    ])
    for p in (2, 3, 4, 8):
        assert torch.equal(pick(full, p), torch.argmax(full, dim=-1)), p
    assert pick(full, 2).tolist() == [1, 0, 1, 0, 3]


def test_scanning_the_padding_would_be_wrong():
    """Negative control: the last shard's zero padding, if scanned, beats an all-negative row."""
    full = torch.tensor([[-3.0, -1.0, -2.0]])  # P = 2: V' = 2, the last shard is [-2.0, 0.0 (padding)]
    parts = shards(full, 2)
    naive = pick_greedy(torch.stack([local_argmax(x, r * 2) for r, x in enumerate(parts)]))
    assert naive.tolist() == [3] and pick(full, 2).tolist() == [1]
