"""Expert parallelism's combine through the peer's mailboxes (kernels/peer_combine.py), in the CPU interpreter:
both ranks' rows-channel blocks in this process, the send half of both ranks, then the receive half. Asserted:
each rank's output == all-gather, pick each slot's owner, `combine_slots_ref`, bit for bit (signed zeros
included: the kernel selects, it never adds a zero). On GPUs: the expert-parallel engine tests."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.distributed.layers import pick_slot_owners
from detinfer.kernels import peer_combine as pc
from detinfer.kernels import peer_sum as ps
from detinfer.kernels.moe_combine import combine_slots_ref

pytestmark = pytest.mark.skipif(not ps.interpreting(), reason="CPU interpreter test (TRITON_INTERPRET=1)")


class _TwoRanks:
    def __init__(self):
        from detinfer.kernels.peer_sum_norm import BOX, G_ROWS
        self.mails = [torch.zeros(2 * G_ROWS * BOX, dtype=torch.float32) for _ in range(2)]
        self.flags = [torch.zeros(2 * G_ROWS, dtype=torch.int64) for _ in range(2)]
        self.epochs = [torch.zeros(G_ROWS, dtype=torch.int64) for _ in range(2)]
        self.abort = [torch.zeros(1, dtype=torch.int32) for _ in range(2)]
        self.addresses = (self.mails[0].data_ptr(), self.mails[1].data_ptr(),
                          self.flags[0].data_ptr(), self.flags[1].data_ptr())

    def combine(self, weights, ids, ys, per_rank, dtype):
        outs = [torch.full((ys[0].shape[0], ys[0].shape[2]), float("nan"), dtype=dtype) for _ in range(2)]
        for phase in (ps.SEND, ps.RECEIVE):
            for rank in (0, 1):
                pc.launch_peer_combine(weights, ids, ys[rank], outs[rank], per_rank, rank, self.addresses,
                                       self.epochs[rank], self.abort[rank], 10**9, phases=phase)
        return outs


_RANKS = _TwoRanks()


@settings(max_examples=12, deadline=None)
@given(t=st.sampled_from([1, 3, 8]), k=st.sampled_from([2, 8]), h=st.sampled_from([64, 1000, 2048]),
       dtype=st.sampled_from([torch.float32, torch.float16]), seed=st.integers(0, 2**31 - 1))
def test_each_slot_from_its_owner_then_the_combine(t, k, h, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    num_experts, per_rank = 16, 8
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g)
    full = torch.randn(t, k, h, generator=g).to(dtype)
    full.view(-1)[::17] = -0.0  # an owner's -0.0 must stay -0.0
    owner = ids // per_rank
    ys = [torch.where((owner == r)[:, :, None], full, torch.zeros_like(full)) for r in range(2)]
    assert pc.fits(ys[0])
    want = combine_slots_ref(weights, pick_slot_owners(torch.stack(ys), ids, per_rank), dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for rank, out in enumerate(_RANKS.combine(weights, ids, ys, per_rank, dtype)):
        assert torch.equal(out.view(bits), want.view(bits)), f"rank {rank}"


def test_shapes_the_kernel_refuses():
    assert not pc.fits(torch.zeros(1, 3, 2048))  # k not a power of two
    assert not pc.fits(torch.zeros(1, 16, 2048))  # 16 x 1024 slot values exceed a mailbox
    assert not pc.fits(torch.zeros(257, 8, 2048))  # more programs than the channel has mailboxes
