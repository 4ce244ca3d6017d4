"""The two-GPU row-parallel sum and the RMSNorm after it, in one kernel (tensor parallelism, P = 2).

In a decoder layer the row-parallel output (o_proj, down_proj) goes straight into an RMSNorm with the residual
add (`post_attention_layernorm`, the next layer's `input_layernorm`, the final norm). This kernel does both:
the peer sum of `kernels/peer_sum.py` (each rank's chunk tree, the exchange through the mailboxes, + bias,
rounded to the model dtype) for whole rows, then the norm. Bits: the sum is `peer_sum`'s (elementwise adds);
the norm is `kernels/rmsnorm.py`'s own code (`rms_norm_tile`), run on the rounded sum after it is stored and
read back, with the constexprs and warps of the standalone kernel (`rmsnorm._layout_for(D)`), so its loads,
layouts and reduction tree are the standalone kernel's: the same bits as the sum followed by `rms_norm`.

The exchange is `peer_sum`'s protocol per program over a second set of mailboxes ("rows" channel of
`distributed.peer_sum.PeerSum`): program g handles ROWS rows, BOX >= ROWS * BLOCK_D elements a mailbox.
Calls of at most G_TAGGED programs (decode steps: one program per row at hidden sizes 2048-8192) can use
the "rows_tagged" channel instead (int64 mailboxes of BOX tagged words, `kernels.peer_push`): there the
row-parallel matmul itself sent this rank's partial to the peer as it stored it (`pushed`), and the kernel
only receives (own partial + the peer's words, then the norm); a call that was not pushed can also send
tagged words itself (`transport="tagged"` of `PeerSum.sum_rms_norm`, for tests and benchmarks). Which way the
values travel changes no bit: they are the same values, and both ranks pick alike, from the shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detinfer.kernels._direct import LaunchCache
from detinfer.kernels._launch import interpreting
from detinfer.kernels._pdl import launch_options, pdl_start, use_pdl
from detinfer.kernels.peer_push import send_tagged
from detinfer.kernels.peer_sum import (
    _HAS_TIMER,
    BOTH,
    RECEIVE,
    _local_tree,
    _receive,
    _receive_tagged,
    _send,
)
from detinfer.kernels.rmsnorm import _layout_for, rms_norm_tile

# The rows channel: mailboxes of BOX fp32 (a tile of ROWS x BLOCK_D, BLOCK_D = D rounded up to a power of two:
# hidden sizes up to 8192) for up to G_ROWS programs (512 rows at ROWS = 1: decode and graphed mixed steps).
BOX = 8192
G_ROWS = 512
# Programs of the tagged-words channel: calls of up to this many programs (rows, at hidden sizes 2048-8192)
# get their partials pushed by the matmul. Measured on 2 x H100 (bench/bench_collectives.py, an o_proj matmul
# + sum + norm per pair, docs/performance.md "Tagged words"): pushed -1.4 us at 1 row, -0.8
# at 8, -0.4 at 16, +0.6 at 64 (twice the bytes over NVLink while the matmul streams its weights).
G_TAGGED = 16


def fits(parts: torch.Tensor) -> bool:
    """Whether this rank's partials parts [C, T, D] go through the fused kernel (else sum, then norm): any T
    (`rows_per_launch` rows per launch), D whose norm tile fits a mailbox."""
    if parts.dim() != 3 or parts.shape[0] not in (1, 2, 4, 8):
        return False
    block_d, rows, _ = _layout_for(parts.shape[-1])
    return rows * block_d <= BOX


def rows_per_launch(d: int) -> int:
    """The most rows one launch takes (G_ROWS programs of the norm's ROWS rows); a caller with more launches
    row pieces in order (each row's sum and norm are its own: the same bits)."""
    return G_ROWS * _layout_for(d)[1]


@triton.jit
def _peer_sum_rms_norm_kernel(parts_ptr, bias_ptr, x_ptr, res_ptr, w_ptr, y_ptr, h_ptr, epochs_ptr, abort_ptr,
                              mail0_addr, mail1_addr, flags0_addr, flags1_addr, n_rows, D, eps, part_stride,
                              res_stride, timeout_ns,
                              RANK: tl.constexpr, NUM_PARTS: tl.constexpr, HAS_BIAS: tl.constexpr,
                              HAS_RES: tl.constexpr, HAS_W: tl.constexpr, ROWS: tl.constexpr,
                              BLOCK_D: tl.constexpr, PHASES: tl.constexpr, BOXN: tl.constexpr,
                              GMAX: tl.constexpr, HW_WAIT: tl.constexpr, HAS_TIMER: tl.constexpr,
                              TAGGED: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)  # the parts are the previous kernel's output
    g = tl.program_id(0)
    rows = g.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    offs = rows[:, None] * D + cols[None, :]  # parts, x, y, h: contiguous [T, D]
    s = _local_tree(parts_ptr, offs, mask, part_stride, NUM_PARTS)
    ep = tl.load(epochs_ptr + g) + 1
    box = ((ep % 2) * GMAX + g) * BOXN + tl.arange(0, ROWS)[:, None] * BLOCK_D + cols[None, :]
    if PHASES % 2 == 1:
        if TAGGED:
            send_tagged(s, mask, box, mail0_addr, mail1_addr, ep, RANK)
        else:
            _send(s, mask, box, mail0_addr, mail1_addr, flags0_addr, flags1_addr, g, ep, RANK, GMAX)
    if PHASES >= 2:  # receive, then the norm
        if TAGGED:
            s = s + _receive_tagged(mask, box, mail0_addr, mail1_addr, ep, abort_ptr, timeout_ns, RANK, HW_WAIT,
                                    HAS_TIMER)
        else:
            s = s + _receive(mask, box, mail0_addr, mail1_addr, flags0_addr, flags1_addr, g, ep, abort_ptr,
                             timeout_ns, RANK, GMAX, HW_WAIT, HAS_TIMER)
        if HAS_BIAS:
            s = s + tl.load(bias_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
        tl.store(x_ptr + offs, s.to(x_ptr.dtype.element_ty), mask=mask)
        tl.debug_barrier()  # the rounded rows are visible to every thread of this program
        rms_norm_tile(x_ptr, res_ptr, w_ptr, y_ptr, h_ptr, g, n_rows, D, eps, D, res_stride, D, D,
                      HAS_RES, HAS_W, ROWS, BLOCK_D)
        tl.store(epochs_ptr + g, ep)


_LAUNCHES = LaunchCache(_peer_sum_rms_norm_kernel)


def programs(n_rows: int, d: int) -> int:
    """Programs (mailboxes) a call of n_rows rows of width d takes."""
    return -(-n_rows // _layout_for(d)[1])


def launch_peer_sum_rms_norm(parts, bias, residual, weight, eps: float, x, y, h, rank: int,
                             addresses: tuple[int, int, int, int], epochs, abort, timeout_ns: int,
                             phases: int = BOTH, tagged: bool = False, pushed: bool = False) -> None:
    """x = round(tree(parts) + the peer's tree [+ bias]) [T, D], then y (and h) as `rms_norm(x, weight, eps,
    residual)` writes them; parts [C, T, D] fp32 with contiguous rows (a row slice of a contiguous tensor),
    `fits(parts)`, T <= `rows_per_launch(D)`; x, y, h contiguous [T, D] (h: residual given). Rows channel
    addresses / epochs / abort of `distributed.peer_sum.PeerSum`; with `tagged`, the tagged-words channel's
    (at most G_TAGGED programs), and with `pushed` (tagged only) the matmul that made `parts` already sent
    them to the peer (`kernels.peer_push`): receive only."""
    if pushed and not tagged:
        raise ValueError("peer_sum_rms_norm: pushed partials arrive on the tagged channel only")
    if pushed:
        phases = RECEIVE
    num_parts, n_rows, d = parts.shape
    if n_rows > rows_per_launch(d):
        raise ValueError(f"peer_sum_rms_norm: {n_rows} rows in one launch, at most {rows_per_launch(d)}")
    if tagged and programs(n_rows, d) > G_TAGGED:
        raise ValueError(f"peer_sum_rms_norm: {programs(n_rows, d)} programs on the tagged channel, at most "
                         f"{G_TAGGED}")
    if n_rows == 0:
        return
    block_d, rows, warps = _layout_for(d)
    hw_wait = (phases == BOTH or pushed) and not interpreting()
    pdl = use_pdl(parts.device)
    res = residual if residual is not None else x
    tensors = (parts, bias if bias is not None else parts, x, res, weight if weight is not None else x, y,
               h if h is not None else y, epochs, abort)
    part_stride = parts.stride(0) if num_parts > 1 else n_rows * d
    key = (n_rows, d, eps, num_parts, part_stride, rank, bias is not None, residual is not None,
           weight is not None, phases, parts.dtype, x.dtype, y.dtype, pdl, timeout_ns, addresses, res.stride(0),
           tensors[4].dtype, tagged, pushed)
    if _LAUNCHES.try_launch(key, tensors):
        return
    _LAUNCHES.launch(key, tensors, (programs(n_rows, d),),
                     (*addresses, n_rows, d, float(eps), part_stride, res.stride(0), int(timeout_ns)),
                     dict(RANK=rank, NUM_PARTS=num_parts, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
                          HAS_W=weight is not None, ROWS=rows, BLOCK_D=block_d, PHASES=phases, BOXN=BOX,
                          GMAX=G_TAGGED if tagged else G_ROWS, HW_WAIT=hw_wait, HAS_TIMER=_HAS_TIMER and hw_wait,
                          TAGGED=tagged, USE_PDL=pdl),
                     num_warps=warps, enable_fp_fusion=False, **launch_options(pdl))
