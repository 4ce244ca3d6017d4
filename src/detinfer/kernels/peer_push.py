"""A row-parallel matmul's fp32 partial sent to the other GPU as the matmul stores it (tensor parallelism, P = 2).

In a decode step the cross-rank sum of o_proj / down_proj is a latency chain: the matmul ends, the sum kernel
starts, loads the partial, sends it over NVLink, waits for the peer's. Here the matmul's epilogue also writes
each output tile into the peer's mailbox for the fused sum + RMSNorm (`kernels.peer_sum_norm`, "rows_tagged"
channel of `distributed.peer_sum.PeerSum`), so the transfer overlaps the rest of the matmul, and the sum kernel
only reads: its own partial, and the peer's values from its own memory.

The values travel as tagged words (`send_tagged`): one 64-bit store per fp32 value, the value's bits in the
lower half and the call's epoch (its low 32 bits) in the upper half. An aligned 8-byte store lands whole, so a
word with tag e holds call e's value; the reader polls its words until every tag reads e
(`kernels.peer_sum._receive_tagged`): no flag, no fence, and the tiles may arrive in any order. Epochs are the
sum kernel's, per program g (row block): the matmul reads them for its rows, the sum kernel of the same call
reads the same values and advances them at its end (stream order: the next call's matmul sees them advanced).
A mailbox slot (e % 2) is written again two calls later only after this rank's sum kernel of call e + 1 has
received the peer's e + 1 words, which the peer's matmul sent after the peer's sum kernel of call e had read
slot e % 2; a stale word carries tag e - 2, never e. The values moved are the partial's exact bits, so the sum
(one IEEE addition per element at P = 2) is the same whichever way they travel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class PeerPush:
    """Where a matmul's output rows also go: both ranks' tagged mailboxes (addresses; this rank's own among
    them), this rank's epochs [G] int64, and the sum kernel's mailbox layout: `rows` rows per program (its
    norm tile), `block_d` words per row, `boxn` words per mailbox, `slot` words per slot (G * boxn)."""

    mail0: int
    mail1: int
    epochs: torch.Tensor
    rank: int
    rows: int
    block_d: int
    boxn: int
    slot: int

    @property
    def key(self) -> tuple:
        return (self.mail0, self.mail1, self.epochs.data_ptr(), self.rank, self.rows, self.block_d, self.boxn,
                self.slot)


@triton.jit
def rank_ptr(addr0, addr1, WHICH: tl.constexpr, DTYPE: tl.constexpr):
    """Rank WHICH's mailboxes or flags as a pointer: they arrive as addresses, since the peer's are a mapping
    of its GPU's memory that no torch tensor of this process describes."""
    if WHICH == 0:
        addr = addr0
    else:
        addr = addr1
    return addr.to(tl.pointer_type(DTYPE), bitcast=True)


@triton.jit
def send_tagged(x, mask, box, mail0_addr, mail1_addr, ep, RANK: tl.constexpr):
    """Push fp32 values x into the peer's tagged mailbox at word offsets `box`: word = (ep's low 32 bits) << 32
    | the value's bits (`ep` broadcasts against x)."""
    bits = x.to(tl.int32, bitcast=True).to(tl.uint32, bitcast=True).to(tl.int64)  # zero-extended
    words = (ep.to(tl.int64) << 32) | bits
    tl.store(rank_ptr(mail0_addr, mail1_addr, 1 - RANK, tl.int64) + box, words, mask=mask)


@triton.jit
def push_tile(acc, offs_m, offs_n, M, N, mail0_addr, mail1_addr, epochs_ptr, RANK: tl.constexpr,
              ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BOXN: tl.constexpr, SLOT: tl.constexpr):
    """The matmul epilogue's send: tile rows offs_m, columns offs_n of the fp32 output, each row into its sum
    program's mailbox (g = row // ROWS, that program's epoch + 1 as tag)."""
    m_ok = offs_m < M
    g = offs_m // ROWS
    ep = tl.load(epochs_ptr + g, mask=m_ok, other=0) + 1
    box = (ep % 2) * SLOT + g * BOXN + (offs_m % ROWS) * BLOCK_D
    send_tagged(acc, m_ok[:, None] & (offs_n < N)[None, :], box[:, None] + offs_n[None, :], mail0_addr, mail1_addr,
                ep[:, None], RANK)
