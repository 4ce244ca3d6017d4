"""Expert parallelism at two GPUs: the MoE combine that takes each slot from the GPU owning its expert, in one
kernel (no all-gather).

Each rank holds y [T, k, H] (model dtype): its experts' slot outputs, zeros for the peer's. The one-device
layer's combine is out[t] = sum_r w[t, r] * y_owner(t, r)[t, r] in routing-rank order in fp32, rounded once
(`kernels/moe_combine.py`); the all-gather path copies each slot from its owner first (a data move). Here
each program (token t, H block) pushes its slots into the peer's mailbox (`kernels/peer_sum.py`'s protocol,
"rows" channel), waits for the peer's, and for each slot in routing-rank order takes its own value when it
owns the expert (ids[t, r] // experts_per_rank == rank) and the peer's otherwise: a select, not an add, so
every slot has its owner's exact bits (an add would turn an owner's -0.0 into +0.0). The arithmetic after
the select is `moe_combine._combine_kernel`'s, expression for expression (products rounded, then added:
no fma), so the result has the all-gather + combine's bits, on both ranks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detinfer.kernels._direct import LaunchCache
from detinfer.kernels._launch import interpreting
from detinfer.kernels._pdl import launch_options, pdl_start, use_pdl
from detinfer.kernels.peer_sum import _HAS_TIMER, BOTH, _await_mailbox, _send
from detinfer.kernels.peer_sum_norm import BOX, G_ROWS

BLOCK_H = 1024  # columns per program; any width gives the same bits (no reduction across columns)


def fits(y: torch.Tensor) -> bool:
    """Whether y [T, k, H] goes through the kernel: a program's k x BLOCK_H slot values fit a mailbox."""
    t, k, h = y.shape
    return k & (k - 1) == 0 and k * BLOCK_H <= BOX and t * triton.cdiv(h, BLOCK_H) <= G_ROWS


@triton.jit
def _peer_combine_kernel(w_ptr, ids_ptr, y_ptr, out_ptr, epochs_ptr, abort_ptr,
                         mail0_addr, mail1_addr, flags0_addr, flags1_addr, H, experts_per_rank, timeout_ns,
                         RANK: tl.constexpr, K_SLOTS: tl.constexpr, BLOCK_H: tl.constexpr, PHASES: tl.constexpr,
                         BOXN: tl.constexpr, GMAX: tl.constexpr, HW_WAIT: tl.constexpr, HAS_TIMER: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)  # y is the previous kernel's output
    t = tl.program_id(0)
    hb = tl.program_id(1)
    g = t * tl.num_programs(1) + hb
    cols = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    slots = tl.arange(0, K_SLOTS)
    tile_mask = (slots < K_SLOTS)[:, None] & mask[None, :]
    y_tile = tl.load(y_ptr + (t * K_SLOTS + slots)[:, None] * H + cols[None, :], mask=tile_mask, other=0.0)
    ep = tl.load(epochs_ptr + g) + 1
    box = ((ep % 2) * GMAX + g) * BOXN + slots[:, None] * BLOCK_H + tl.arange(0, BLOCK_H)[None, :]
    if PHASES % 2 == 1:  # every slot value, exact in fp32, into the peer's mailbox
        _send(y_tile.to(tl.float32), tile_mask, box, mail0_addr, mail1_addr, flags0_addr, flags1_addr, g, ep,
              RANK, GMAX)
    if PHASES >= 2:
        own_mail = _await_mailbox(mail0_addr, mail1_addr, flags0_addr, flags1_addr, g, ep, abort_ptr, timeout_ns,
                                  RANK, GMAX, HW_WAIT, HAS_TIMER)  # holds the peer's slot values
        w_row = w_ptr + t * K_SLOTS
        ids_row = ids_ptr + t * K_SLOTS
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for r in tl.static_range(K_SLOTS):  # routing-rank order, as moe_combine's kernel
            mine = tl.load(y_ptr + (t * K_SLOTS + r) * H + cols, mask=mask, other=0.0).to(tl.float32)
            theirs = tl.load(own_mail + ((ep % 2) * GMAX + g) * BOXN + r * BLOCK_H + tl.arange(0, BLOCK_H),
                             mask=mask, other=0.0, cache_modifier=".cv")
            owned = (tl.load(ids_row + r) // experts_per_rank) == RANK
            value = tl.where(owned, mine, theirs)  # a select: the owner's exact bits
            prod = tl.load(w_row + r).to(tl.float32) * value
            if r == 0:
                acc = prod
            else:
                acc = acc + prod
        tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(epochs_ptr + g, ep)


_LAUNCHES = LaunchCache(_peer_combine_kernel)


def launch_peer_combine(weights: torch.Tensor, ids: torch.Tensor, y: torch.Tensor, out: torch.Tensor,
                        experts_per_rank: int, rank: int, addresses: tuple[int, int, int, int], epochs, abort,
                        timeout_ns: int, phases: int = BOTH) -> None:
    """out [T, H] = the combine of each slot's owner's y (module doc). weights [T, k] fp32, ids [T, k],
    y [T, k, H] contiguous, `fits(y)`, k a power of two; "rows" channel addresses / epochs / abort of
    `distributed.peer_sum.PeerSum`. Both ranks call with the same shapes, in the same order."""
    t, k, h = y.shape
    if t == 0 or h == 0:
        return
    grid = (t, triton.cdiv(h, BLOCK_H))
    hw_wait = phases == BOTH and not interpreting()
    pdl = use_pdl(y.device)
    tensors = (weights, ids, y, out, epochs, abort)
    key = (t, k, h, experts_per_rank, rank, phases, y.dtype, ids.dtype, out.dtype, pdl, timeout_ns, addresses)
    if _LAUNCHES.try_launch(key, tensors):
        return
    _LAUNCHES.launch(key, tensors, grid, (*addresses, h, experts_per_rank, int(timeout_ns)),
                     dict(RANK=rank, K_SLOTS=k, BLOCK_H=BLOCK_H, PHASES=phases, BOXN=BOX, GMAX=G_ROWS,
                          HW_WAIT=hw_wait, HAS_TIMER=_HAS_TIMER and hw_wait, USE_PDL=pdl),
                     num_warps=4, enable_fp_fusion=False, **launch_options(pdl))
