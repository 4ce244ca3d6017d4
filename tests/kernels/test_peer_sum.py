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

    def sum(self, parts, bias, dtype):
        """parts: each rank's partials [C, ..., N] -> each rank's output [..., N]."""
        outs = [torch.full(p.shape[1:], float("nan"), dtype=dtype) for p in parts]
        for phase in (ps.SEND, ps.RECEIVE):
            for rank in (0, 1):
                ps.launch_peer_sum(parts[rank], bias, outs[rank], rank, self.addresses, self.epochs[rank],
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
    out0, out1 = _RANKS.sum((p0[None], p1[None]), bias, dtype)
    want = ps.peer_sum_ref(p0[None], p1[None], bias, dtype)
    assert torch.equal(out0, want) and torch.equal(out1, want)
    bits = torch.int32 if dtype == torch.float32 else torch.int16  # torch.equal calls -0.0 == +0.0
    assert torch.equal(out0.view(bits), want.view(bits)) and torch.equal(out1.view(bits), want.view(bits))
    # The reference is the row-parallel layer's unfused epilogue over the all-reduce's sum, either order.
    assert torch.equal(ps.peer_sum_ref(p1[None], p0[None], bias, dtype), want)


def test_mailboxes_alternate_and_epochs_advance_over_calls_of_different_sizes():
    pair = _TwoRanks()
    g = torch.Generator().manual_seed(0)
    sizes = [(1, 4096), (64, 4096), (1, 7), (3, 4096), (64, 4096)]
    for rows, cols in sizes:
        p0, p1 = _partial(g, rows, cols), _partial(g, rows, cols)
        out0, out1 = pair.sum((p0[None], p1[None]), None, torch.float32)
        assert torch.equal(out0, p0 + p1) and torch.equal(out1, p0 + p1)
    programs = [-(-r * c // ps.PER_PROGRAM) for r, c in sizes]
    for rank in (0, 1):  # program g took part in every call whose grid reached it
        want = torch.tensor([sum(n > g for n in programs) for g in range(ps.G_MAX)])
        assert torch.equal(pair.epochs[rank], want)
        # Each rank told the other its epoch per program: rank r's flags[1 - r, g] == the peer's epochs[g].
        assert torch.equal(pair.flags[rank].view(2, ps.G_MAX)[1 - rank], want)


@settings(max_examples=20, deadline=None)
@given(num_parts=st.sampled_from(ps.LOCAL_PARTS), rows=st.sampled_from([1, 3, 64]),
       cols=st.sampled_from([7, 333, 4096]), has_bias=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_each_rank_adds_its_chunk_subtree_first(num_parts, rows, cols, has_bias, seed):
    """--tp-invariant-reduction: each rank's C / P chunk partials go through the tree inside the kernel, then
    the ranks' subtrees are added: the bits of the full pairwise tree over all 2 C / P chunks."""
    from detinfer.kernels.chunked_linear import pairwise_tree_sum

    g = torch.Generator().manual_seed(seed)
    parts = [torch.stack([_partial(g, rows, cols) for _ in range(num_parts)]) for _ in range(2)]
    bias = torch.randn(cols, generator=g) if has_bias else None
    out0, out1 = _RANKS.sum(parts, bias, torch.float32)
    full = pairwise_tree_sum(torch.cat(parts))  # rank 0's chunks, then rank 1's: the TP=1 order
    want = full if bias is None else full + bias
    assert torch.equal(out0.view(torch.int32), want.view(torch.int32))
    assert torch.equal(out1.view(torch.int32), want.view(torch.int32))


def test_16_bit_partials_are_summed_in_fp32_and_rounded_once():
    """Fast mode's model-dtype partials: one fp32 addition of the two exact upcasts, one rounding."""
    g = torch.Generator().manual_seed(5)
    p0, p1 = (torch.randn(4, 333, generator=g).to(torch.float16) for _ in range(2))
    out0, out1 = _RANKS.sum((p0[None], p1[None]), None, torch.float16)
    want = (p0.float() + p1.float()).to(torch.float16)
    assert torch.equal(out0.view(torch.int16), want.view(torch.int16)) and torch.equal(out1, want)


@settings(max_examples=15, deadline=None)
@given(num_parts=st.sampled_from(ps.LOCAL_PARTS), rows=st.sampled_from([1, 5]), cols=st.sampled_from([7, 4096]),
       has_bias=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float16]), seed=st.integers(0, 2**31 - 1))
def test_one_gpu_tree_bias_and_rounding_in_one_launch(num_parts, rows, cols, has_bias, dtype, seed):
    """No peer (TP=1 with the chunk tree): tree + bias + rounding == the unfused torch epilogue, bitwise."""
    g = torch.Generator().manual_seed(seed)
    parts = torch.stack([_partial(g, rows, cols) for _ in range(num_parts)])
    bias = torch.randn(cols, generator=g).to(dtype) if has_bias else None
    out = torch.full((rows, cols), float("nan"), dtype=dtype)
    ps.launch_peer_sum(parts, bias, out, 0, None, None, None)
    want = ps.peer_sum_ref(parts, None, bias, dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(out.view(bits), want.view(bits))
