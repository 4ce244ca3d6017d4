"""A row-parallel matmul that sends its fp32 partial to the other GPU as it stores it (kernels/peer_push.py),
and the fused sum + norm that then only receives (kernels/peer_sum_norm.py, `pushed`), in the CPU
interpreter: both ranks' tagged mailboxes live in this process; both ranks' matmuls run, then both receives.
Asserted bitwise: the matmul's own output is the unpushed one's, and each rank's (x, y, h) are the rounded sum
of the two partials followed by the standalone norm, over calls of changing sizes (the slots alternate, the
epochs advance). On GPUs: tests/distributed/test_peer_sum_gpu.py and the TP engine tests."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.kernels import peer_sum as ps
from detinfer.kernels import peer_sum_norm as psn
from detinfer.kernels.chunked_linear import linear_parts
from detinfer.kernels.peer_push import PeerPush
from detinfer.kernels.rmsnorm import _layout_for, rms_norm

pytestmark = pytest.mark.skipif(not ps.interpreting(), reason="CPU interpreter test (TRITON_INTERPRET=1)")


class _TwoRanks:
    """Both ranks' tagged channel: int64 mailboxes [2, G_TAGGED, BOX], epochs, abort flags."""

    def __init__(self):
        self.mails = [torch.zeros(2 * psn.G_TAGGED * psn.BOX, dtype=torch.int64) for _ in range(2)]
        self.flags = [torch.zeros(2 * psn.G_TAGGED, dtype=torch.int64) for _ in range(2)]  # unused by it
        self.epochs = [torch.zeros(psn.G_TAGGED, dtype=torch.int64) for _ in range(2)]
        self.abort = [torch.zeros(1, dtype=torch.int32) for _ in range(2)]
        self.addresses = (self.mails[0].data_ptr(), self.mails[1].data_ptr(), self.flags[0].data_ptr(),
                          self.flags[1].data_ptr())

    def push(self, rank: int, d: int) -> PeerPush:
        block_d, rows, _ = _layout_for(d)
        return PeerPush(self.addresses[0], self.addresses[1], self.epochs[rank], rank, rows, block_d, psn.BOX,
                        psn.G_TAGGED * psn.BOX)

    def step(self, xs, ws, residual, weight, dtype):
        """Both ranks' pushed matmuls, then both ranks' receiving sum + norm: [(parts, x, y, h)] per rank."""
        parts = [linear_parts(xs[r], ws[r], 1, self.push(r, ws[r].shape[0])) for r in (0, 1)]
        outs = []
        for rank in (0, 1):
            t, d = parts[rank].shape[1:]
            x, y, h = (torch.full((t, d), float("nan"), dtype=dtype) for _ in range(3))
            psn.launch_peer_sum_rms_norm(parts[rank], None, residual, weight, 1e-6, x, y, h, rank, self.addresses,
                                         self.epochs[rank], self.abort[rank], 10**9, tagged=True, pushed=True)
            outs.append((parts[rank], x, y, h))
        return outs


def _bits(t):
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@settings(max_examples=6, deadline=None)
@given(sizes=st.lists(st.sampled_from([1, 3, 8, 9]), min_size=1, max_size=3), d=st.sampled_from([128, 333, 4096]),
       k=st.sampled_from([32, 100]), seed=st.integers(0, 2**31 - 1))
def test_pushed_partials_sum_and_norm_like_the_unfused_path(sizes, d, k, seed):
    ranks, g = _TwoRanks(), torch.Generator().manual_seed(seed)
    weight = (torch.rand(d, generator=g) + 0.5).to(torch.float16)
    for call, rows in enumerate(sizes):
        xs = [torch.randn(rows, k, generator=g) for _ in range(2)]
        ws = [torch.randn(d, k, generator=g) for _ in range(2)]
        xs[0][0, :3] = 0.0  # a zero row start: exact zeros and signed zeros in the partials
        ws[1][::5] = -0.0
        residual = torch.randn(rows, d, generator=g).to(torch.float16)
        outs = ranks.step(xs, ws, residual, weight, torch.float16)
        plain = [linear_parts(xs[r], ws[r], 1) for r in (0, 1)]
        x = ps.peer_sum_ref(plain[0], plain[1], None, torch.float16)
        want_y, want_h = rms_norm(x, weight, 1e-6, residual=residual)
        for rank, (parts, got_x, got_y, got_h) in enumerate(outs):
            assert torch.equal(_bits(parts), _bits(plain[rank])), f"call {call} rank {rank}: the matmul's output"
            assert torch.equal(_bits(got_x), _bits(x)), f"call {call} rank {rank}: the rounded sum"
            assert torch.equal(_bits(got_y), _bits(want_y)), f"call {call} rank {rank}: the norm"
            assert torch.equal(_bits(got_h), _bits(want_h)), f"call {call} rank {rank}: the new residual"
    used = -(-max(sizes) // _layout_for(d)[1])  # programs of the largest call; the rest never ran
    for epochs in ranks.epochs:
        assert int(epochs[0]) == len(sizes) and int(epochs[used:].abs().sum()) == 0


def test_a_pushed_word_holds_the_epoch_and_the_exact_value():
    ranks = _TwoRanks()
    x = torch.ones(1, 64)
    ws = [torch.full((128, 64), -0.0), torch.full((128, 64), 0.5)]
    ranks.step([x, x], ws, None, None, torch.float32)
    slot = ranks.mails[1].view(2, psn.G_TAGGED, psn.BOX)[1, 0, :128]  # rank 0's partial, in rank 1's slot 1
    assert torch.equal(slot >> 32, torch.ones(128, dtype=torch.int64))
    assert torch.equal((slot & 0xFFFFFFFF).to(torch.int32), torch.zeros(128).view(torch.int32))  # +0.0 (x 1 *-0)
    got = ranks.mails[0].view(2, psn.G_TAGGED, psn.BOX)[1, 0, :128]  # rank 1's, in rank 0's
    assert torch.equal((got & 0xFFFFFFFF).to(torch.int32), torch.full((128,), 32.0).view(torch.int32))


def test_only_one_fp32_chunk_is_pushed():
    ranks = _TwoRanks()
    with pytest.raises(ValueError, match="one chunk"):
        linear_parts(torch.ones(1, 64), torch.ones(128, 64), 2, ranks.push(0, 128))
    with pytest.raises(ValueError, match="tagged channel only"):
        psn.launch_peer_sum_rms_norm(torch.zeros(1, 1, 128), None, None, None, 1e-6, *(torch.zeros(1, 128),) * 3,
                                     0, ranks.addresses, ranks.epochs[0], ranks.abort[0], 10**9, pushed=True)


def test_which_calls_are_pushed():
    """The engine pushes only what the fused sum + norm's tagged channel takes in one launch: decode-sized
    row counts, norm tiles that fit a mailbox (a pushed partial that nothing received would stall the peer)."""
    from detinfer.distributed.peer_sum import PeerSum

    assert PeerSum.can_push(1, 4096) and PeerSum.can_push(psn.G_TAGGED, 4096)
    assert not PeerSum.can_push(psn.G_TAGGED + 1, 4096)
    assert PeerSum.can_push(8 * psn.G_TAGGED, 128)  # 8 rows a program at width 128
    assert not PeerSum.can_push(1, 16384)  # a row wider than a mailbox: the unfused sum
    assert not PeerSum.can_push(0, 4096)
