"""`TPGroup.exact_sum`: the deterministic cross-rank sum, on CPU over gloo, asserted bit for bit.

At P = 2 it is the library's fp32 all-reduce, which must give exactly what "all-gather + the fixed pairwise
tree" gives (one commutative IEEE addition per element): checked over random shapes and values that
include -0.0, +-inf, subnormals, the largest floats (overflow to inf) and exact cancellations. At P = 4
the order matters, so it must stay all-gather + tree. `broadcast` and `agree_min` (the KV block count
every rank can allocate) are exact data moves / a minimum.

The ranks are threads of this process, each with its own gloo group over one store (cheap enough for
Hypothesis to run many examples).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from detinfer.distributed.group import TPGroup, connect, master_store
from detinfer.kernels.chunked_linear import pairwise_tree_sum

SPECIAL = [0.0, -0.0, math.inf, -math.inf, 1e-45, -1e-45, 1e-40, -3e-39, 3.4028234e38, -3.4028234e38, 1.0, -1.0]


class Ranks:
    """P gloo ranks as threads: `run(fn)` calls fn(group) on every rank at once -> the results, rank order."""

    def __init__(self, size: int):
        self.size = size
        self.pool = ThreadPoolExecutor(size)
        store = master_store(size, timeout_s=60)
        cpu = torch.device("cpu")
        futures = [self.pool.submit(connect, r, size, store.port, cpu, timeout_s=60,
                                    store=store if r == 0 else None) for r in range(size)]
        self.groups: list[TPGroup] = [f.result(timeout=120) for f in futures]

    def run(self, fn) -> list:
        futures = [self.pool.submit(fn, g) for g in self.groups]
        return [f.result(timeout=60) for f in futures]


@pytest.fixture(scope="module")
def ranks2():
    return Ranks(2)


@pytest.fixture(scope="module")
def ranks4():
    return Ranks(4)


@st.composite
def partials(draw, size: int):
    """`size` fp32 tensors of one random shape: random normals at random scales, special values sprinkled in,
    and some elements set to cancel exactly (rank 1's = -rank 0's)."""
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
    n = math.prod(shape)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    parts = []
    for _ in range(size):
        t = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-140, 120, (n,), generator=gen).float())
        picks = draw(st.lists(st.tuples(st.integers(0, n - 1), st.sampled_from(SPECIAL)), max_size=n))
        for i, v in picks:
            t[i] = v
        parts.append(t)
    for i in draw(st.lists(st.integers(0, n - 1), max_size=3)):
        parts[1][i] = -parts[0][i]
    return [p.reshape(shape) for p in parts]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _spy(monkeypatch) -> dict[str, int]:
    """Counts the group's all_reduce_sum / all_gather calls (all ranks)."""
    calls = {"all_reduce_sum": 0, "all_gather": 0}
    for name in calls:
        orig = getattr(TPGroup, name)

        def counted(self, t, _orig=orig, _name=name):
            calls[_name] += 1
            return _orig(self, t)
        monkeypatch.setattr(TPGroup, name, counted)
    return calls


def _check(ranks: Ranks, parts: list[torch.Tensor]) -> None:
    expected = pairwise_tree_sum(torch.stack(parts))  # what every rank computed before exact_sum existed
    got = ranks.run(lambda g: g.exact_sum(parts[g.rank].clone()))
    for r, out in enumerate(got):
        assert out.shape == expected.shape and out.dtype == torch.float32
        assert torch.equal(_bits(out), _bits(expected)), f"rank {r} differs from all-gather + tree"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=partials(2))
def test_p2_all_reduce_gives_the_gather_and_tree_bits(ranks2, parts):
    _check(ranks2, parts)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=partials(4))
def test_p4_gather_and_tree_bits(ranks4, parts):
    _check(ranks4, parts)


def test_p2_uses_one_all_reduce_p4_the_gather(ranks2, ranks4, monkeypatch):
    calls = _spy(monkeypatch)
    ranks2.run(lambda g: g.exact_sum(torch.ones(3, 5)))
    assert calls == {"all_reduce_sum": 2, "all_gather": 0}  # one per rank
    calls.update(all_reduce_sum=0)
    # P = 4: (a + b) + (c + d) != ((a + b) + c) + d in general, so the library's order is not used.
    parts = [torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([2.0**-24]), torch.tensor([2.0**-24])]
    got = ranks4.run(lambda g: g.exact_sum(parts[g.rank].clone()))
    assert calls == {"all_reduce_sum": 0, "all_gather": 4}
    assert all(torch.equal(out, torch.tensor([1.0 + 2.0**-23])) for out in got)  # (1 + 0) + (e + e); left to right: 1


def test_exact_sum_refuses_16_bit_partials(ranks2):
    with pytest.raises(TypeError, match="fp32 partials, got torch.bfloat16"):
        ranks2.groups[0].exact_sum(torch.ones(2, dtype=torch.bfloat16))


def test_broadcast_and_agree_min(ranks2, ranks4):
    ids = ranks4.run(lambda g: g.broadcast(torch.tensor([7, -1, 2**40]) if g.rank == 0 else
                                           torch.zeros(3, dtype=torch.int64)))
    assert all(torch.equal(t, torch.tensor([7, -1, 2**40])) for t in ids)
    assert ranks4.run(lambda g: g.agree_min([90, 75, 120, 80][g.rank])) == [75] * 4
    assert ranks2.run(lambda g: g.agree_min(12)) == [12, 12]
