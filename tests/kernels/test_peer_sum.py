"""The two-rank peer sum kernel (kernels/peer_sum.py) in the CPU interpreter: both ranks' blocks live in this
process and each call runs the send half of both ranks, then the receive half (the interpreter cannot run
two ranks' programs at once). The real two-GPU kernel is tested in tests/distributed/test_peer_sum_gpu.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.kernels import peer_sum as ps

pytestmark = pytest.mark.skipif(not ps.interpreting(), reason="CPU interpreter test (TRITON_INTERPRET=1)")


class _TwoRanks:
    """Both ranks' mailboxes, flags, epochs and abort flags, laid out as distributed.peer_sum lays them."""

    def __init__(self):
        self.mails = [torch.zeros(2 * ps.CAPACITY, dtype=torch.float32) for _ in range(2)]
        self.flags = [torch.zeros(2 * ps.G_MAX, dtype=torch.int64) for _ in range(2)]
        self.epochs = [torch.zeros(ps.G_MAX, dtype=torch.int64) for _ in range(2)]
        self.abort = [torch.zeros(1, dtype=torch.int32) for _ in range(2)]
        self.addresses = (self.mails[0].data_ptr(), self.mails[1].data_ptr(),
                          self.flags[0].data_ptr(), self.flags[1].data_ptr())

    def sum(self, partials, bias, dtype):
        outs = [torch.full(p.shape, float("nan"), dtype=dtype) for p in partials]
        for phase in (ps.SEND, ps.RECEIVE):
            for rank in (0, 1):
                ps.launch_peer_sum(partials[rank], bias, outs[rank], rank, self.addresses, self.epochs[rank],
                                   self.abort[rank], 10**9, phases=phase)
        return outs


_RANKS = _TwoRanks()  # one pair for the whole module, as an engine keeps one: epochs carry across calls


def _partial(g: torch.Generator, rows: int, cols: int) -> torch.Tensor:
    x = torch.randn(rows, cols, generator=g) * 3.0
    x.view(-1)[::11] = -0.0  # signed zeros: -0.0 + -0.0 must stay -0.0 (no accumulator started at +0.0)
    return x


@settings(max_examples=25, deadline=None)
@given(rows=st.sampled_from([1, 2, 7, 64]), cols=st.sampled_from([1, 7, 333, 4096]),
       has_bias=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float16]), seed=st.integers(0, 2**31 - 1))
def test_both_ranks_get_the_rounded_sum_bit_for_bit(rows, cols, has_bias, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    p0, p1 = _partial(g, rows, cols), _partial(g, rows, cols)
    bias = torch.randn(cols, generator=g).to(dtype) if has_bias else None
    out0, out1 = _RANKS.sum((p0, p1), bias, dtype)
    want = ps.peer_sum_ref(p0, p1, bias, dtype)
    assert torch.equal(out0, want) and torch.equal(out1, want)
    bits = torch.int32 if dtype == torch.float32 else torch.int16  # torch.equal calls -0.0 == +0.0
    assert torch.equal(out0.view(bits), want.view(bits)) and torch.equal(out1.view(bits), want.view(bits))
    # The reference is the row-parallel layer's unfused epilogue over the all-reduce's sum, either order.
    assert torch.equal(ps.peer_sum_ref(p1, p0, bias, dtype), want)


def test_mailboxes_alternate_and_epochs_advance_over_calls_of_different_sizes():
    pair = _TwoRanks()
    g = torch.Generator().manual_seed(0)
    sizes = [(1, 4096), (64, 4096), (1, 7), (3, 4096), (64, 4096)]
    for rows, cols in sizes:
        p0, p1 = _partial(g, rows, cols), _partial(g, rows, cols)
        out0, out1 = pair.sum((p0, p1), None, torch.float32)
        assert torch.equal(out0, p0 + p1) and torch.equal(out1, p0 + p1)
    programs = [-(-r * c // ps.PER_PROGRAM) for r, c in sizes]
    for rank in (0, 1):  # program g took part in every call whose grid reached it
        want = torch.tensor([sum(n > g for n in programs) for g in range(ps.G_MAX)])
        assert torch.equal(pair.epochs[rank], want)
        # Each rank told the other its epoch per program: rank r's flags[1 - r, g] == the peer's epochs[g].
        assert torch.equal(pair.flags[rank].view(2, ps.G_MAX)[1 - rank], want)
