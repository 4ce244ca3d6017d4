"""The two-GPU row-parallel sum fused with the RMSNorm after it (kernels/peer_sum_norm.py), in the CPU
interpreter: both ranks' rows-channel blocks live in this process; each call runs the send half of both ranks,
then the receive half. Asserted: each rank's (y, h) == rms_norm(the rounded sum, weight, eps, residual) from
the standalone kernel, bit for bit. On GPUs: tests/distributed/test_peer_sum_gpu.py and the engine tests."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.kernels import peer_sum as ps
from detinfer.kernels import peer_sum_norm as psn
from detinfer.kernels.rmsnorm import rms_norm

pytestmark = pytest.mark.skipif(not ps.interpreting(), reason="CPU interpreter test (TRITON_INTERPRET=1)")


class _TwoRanks:
    """Both ranks' rows channel, and their tagged-words channel (int64 mailboxes, own epochs)."""

    def __init__(self):
        self.mails = [torch.zeros(2 * psn.G_ROWS * psn.BOX, dtype=torch.float32) for _ in range(2)]
        self.flags = [torch.zeros(2 * psn.G_ROWS, dtype=torch.int64) for _ in range(2)]
        self.epochs = [torch.zeros(psn.G_ROWS, dtype=torch.int64) for _ in range(2)]
        self.abort = [torch.zeros(1, dtype=torch.int32) for _ in range(2)]
        self.addresses = (self.mails[0].data_ptr(), self.mails[1].data_ptr(),
                          self.flags[0].data_ptr(), self.flags[1].data_ptr())
        self.tagged_mails = [torch.zeros(2 * psn.G_TAGGED * psn.BOX, dtype=torch.int64) for _ in range(2)]
        self.tagged_flags = [torch.zeros(2 * psn.G_TAGGED, dtype=torch.int64) for _ in range(2)]  # unused
        self.tagged_epochs = [torch.zeros(psn.G_TAGGED, dtype=torch.int64) for _ in range(2)]
        self.tagged_addresses = (self.tagged_mails[0].data_ptr(), self.tagged_mails[1].data_ptr(),
                                 self.tagged_flags[0].data_ptr(), self.tagged_flags[1].data_ptr())

    def run(self, parts, bias, residual, weight, eps, dtype, tagged=False):
        t, d = parts[0].shape[1:]
        outs = []
        for _ in range(2):
            x, y = (torch.full((t, d), float("nan"), dtype=dtype) for _ in range(2))
            h = torch.full((t, d), float("nan"), dtype=dtype) if residual is not None else None
            outs.append((x, y, h))
        for phase in (ps.SEND, ps.RECEIVE):
            for rank in (0, 1):
                x, y, h = outs[rank]
                addresses, epochs = ((self.tagged_addresses, self.tagged_epochs) if tagged else
                                     (self.addresses, self.epochs))
                psn.launch_peer_sum_rms_norm(parts[rank], bias, residual, weight, eps, x, y, h, rank,
                                             addresses, epochs[rank], self.abort[rank], 10**9, phases=phase,
                                             tagged=tagged)
        return outs


_RANKS = _TwoRanks()


def _bits(t):
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@settings(max_examples=12, deadline=None)
@given(num_parts=st.sampled_from([1, 4]), rows=st.sampled_from([1, 3, 9]), d=st.sampled_from([128, 333, 512]),
       has_bias=st.booleans(), has_res=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float16]),
       tagged=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_fused_sum_and_norm_equal_the_sum_then_the_standalone_norm(num_parts, rows, d, has_bias, has_res, dtype,
                                                                    tagged, seed):
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(num_parts, rows, d, generator=g) * 2 for _ in range(2)]
    for p in parts:  # values whose bits a tagged word must carry intact: signed zeros, subnormals, and an
        p.view(-1)[::7] = -0.0  # infinity in the last row only (its norm is NaN; the other rows stay finite)
        p.view(-1)[5::31] = -1e-42
        if rows > 1:
            p[0, -1, 3] = float("-inf")
    bias = torch.randn(d, generator=g).to(dtype) if has_bias else None
    residual = torch.randn(rows, d, generator=g).to(dtype) if has_res else None
    weight = (torch.rand(d, generator=g) + 0.5).to(dtype)
    assert psn.fits(parts[0])
    outs = _RANKS.run(parts, bias, residual, weight, 1e-6, dtype, tagged)
    x = ps.peer_sum_ref(parts[0], parts[1], bias, dtype)
    want = rms_norm(x, weight, 1e-6, residual=residual)
    want_y, want_h = want if has_res else (want, None)
    for rank, (got_x, got_y, got_h) in enumerate(outs):
        assert torch.equal(_bits(got_x), _bits(x)), f"rank {rank}: the rounded sum"
        assert torch.equal(_bits(got_y), _bits(want_y)), f"rank {rank}: the norm"
        if has_res:
            assert torch.equal(_bits(got_h), _bits(want_h)), f"rank {rank}: the new residual"


def test_any_number_of_rows_fits_and_one_launch_takes_the_channel_at_most():
    block_d, rows, _ = psn._layout_for(4096)
    assert psn.rows_per_launch(4096) == psn.G_ROWS * rows
    assert psn.fits(torch.zeros(1, psn.G_ROWS * rows + 1, 4096))  # the caller launches row pieces
    assert not psn.fits(torch.zeros(3, 4, 4096))  # three local parts: not a tree the kernel adds
    assert not psn.fits(torch.zeros(1, 4, 16384))  # a row wider than a mailbox
    ranks = _TwoRanks()
    too_many = [torch.zeros(1, psn.rows_per_launch(128) + 1, 128)] * 2
    with pytest.raises(ValueError, match="rows in one launch"):
        ranks.run(too_many, None, None, None, 1e-6, torch.float32)


@pytest.mark.parametrize("num_parts", [1, 4])
def test_row_pieces_give_the_bits_of_one_launch(num_parts):
    """What `PeerSum.sum_rms_norm` does past the channel: row slices of the parts (a chunk stride larger than
    the piece) launched in turn, each a new call of the mailbox protocol == one launch over all rows."""
    g = torch.Generator().manual_seed(5)
    rows, d = 11, 256
    parts = [torch.randn(num_parts, rows, d, generator=g) * 3 for _ in range(2)]
    residual = torch.randn(rows, d, generator=g).to(torch.float16)
    weight = (torch.rand(d, generator=g) + 0.5).to(torch.float16)
    whole = _RANKS.run(parts, None, residual, weight, 1e-6, torch.float16)
    for cut in ((0, 4, 11), (0, 1, 2, 11)):
        pieces = [_RANKS.run([p[:, a:b] for p in parts], None, residual[a:b], weight, 1e-6, torch.float16)
                  for a, b in zip(cut, cut[1:])]
        for rank in (0, 1):
            for i in range(3):  # x, y, h
                got = torch.cat([piece[rank][i] for piece in pieces])
                assert torch.equal(_bits(got), _bits(whole[rank][i])), f"rank {rank}, output {i}, cut {cut}"


def test_tagged_words_and_flags_alternate_over_calls_with_the_same_bits():
    """Calls that take the tagged channel and calls that take the flags channel, interleaved (what a step
    with decode-sized and larger sums does): each transport's mailboxes alternate by its own epochs, and
    every call's outputs equal the other transport's bit for bit."""
    ranks, g = _TwoRanks(), torch.Generator().manual_seed(11)
    for call in range(5):
        rows = 1 + 2 * call
        parts = [torch.randn(1, rows, 256, generator=g) * 3 for _ in range(2)]
        weight = (torch.rand(256, generator=g) + 0.5).to(torch.float16)
        residual = torch.randn(rows, 256, generator=g).to(torch.float16)
        by = [ranks.run(parts, None, residual, weight, 1e-6, torch.float16, tagged) for tagged in (True, False)]
        for rank in (0, 1):
            for i in range(3):
                assert torch.equal(_bits(by[0][rank][i]), _bits(by[1][rank][i])), f"call {call} rank {rank} out {i}"
    assert [int(e[0]) for e in ranks.tagged_epochs] == [5, 5]
    # A word written at epoch 5 carries tag 5 in its upper half and the value's bits in its lower half.
    word = int(ranks.tagged_mails[0].view(2, psn.G_TAGGED, psn.BOX)[1, 0, 0])
    assert word >> 32 == 5


def test_the_tagged_channel_refuses_calls_past_its_programs():
    ranks = _TwoRanks()
    d = 4096
    rows = (psn.G_TAGGED + 1) * psn._layout_for(d)[1]
    assert psn.programs(rows, d) == psn.G_TAGGED + 1
    with pytest.raises(ValueError, match="programs on the tagged channel"):
        ranks.run([torch.zeros(1, rows, d)] * 2, None, None, None, 1e-6, torch.float32, tagged=True)
