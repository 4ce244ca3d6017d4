"""The sum of two GPUs' fp32 partials in one kernel that reads the other GPU's memory (tensor parallelism, P = 2).

What it computes: out = round_to(out.dtype, tree(own parts) + tree(peer's parts) [+ bias]), the same on both
ranks. A rank's parts are its C / P chunk partials under `--tp-invariant-reduction` (one part without it),
added in `pairwise_tree_sum`'s tree: elementwise fp32 additions, so the kernel has the torch tree's bits. At
two ranks every element then has two summands and IEEE addition is commutative and correctly rounded, so
own + peer on rank 0 and on rank 1 are the same bits, and the same bits as the library all-reduce or the
all-gather + tree (`distributed.group.TPGroup.exact_sum` says why). The bias add and the rounding to the
model dtype are the row-parallel layer's own epilogue (`y + bias.float()`, then `.to(dtype)`), so fusing
them changes no bit. Without a peer (`addresses=None`) the same kernel is one GPU's tree + bias + rounding
(TP=1 with the chunk tree). Fast mode's 16-bit partials are upcast exactly, added once in fp32 and rounded
once (what a library all-reduce of two bf16 values gives).

Why a kernel of our own: in a decode step the cross-rank sum is a latency problem (16 KB at batch 1), and a
library all-reduce costs ~8 us inside a CUDA graph plus a separate cast launch (and, with the chunk tree, the
tree's launches). Here each program adds its slice of the local parts, copies it into its mailbox, tells
the peer (a flag write over NVLink), waits for the peer's flag, reads the peer's mailbox and writes the
rounded sum: one launch, a few microseconds.

Protocol (per program g, identical grids on both ranks since they see the same message size):
- Each rank owns mailboxes [2 slots, G_MAX programs, PER_PROGRAM] fp32 and flags [2 source ranks, G_MAX]
  int64 in memory the peer can map (`distributed.peer_sum`), plus its own epoch counters [G_MAX].
- Program g of a call takes epoch e = epochs[g] + 1 and slot e % 2, writes its slice into the PEER's
  mailbox (slot, g) (stores over NVLink: posted, no round trip), then writes e into the peer's flags[my
  rank, g] (release, system scope: ordered after the data); it waits until its own flags[peer, g] >= e
  (acquire), reads its own mailbox (slot, g), which the peer filled, and stores epochs[g] = e. Pushing
  rather than reading the peer's memory saves one NVLink round trip per call.
- Why a mailbox can be refilled two calls later: a rank writes the peer's (slot, g) again at epoch e + 2
  only after its program g passed the wait of epoch e + 1, i.e. after the peer's program g signalled e + 1,
  which it does in a later launch than the one that read (slot, g) at epoch e. Program g only ever touches
  mailbox g, so grids of different sizes (message sizes) never overlap; ">=" because the peer may already
  be one call ahead (it signals e + 1 as soon as it has read our e).
- A peer that never signals (dead process, a rank that skipped a collective): the wait gives up after
  `timeout_ns` or when the host sets `abort` (the runner's watcher does when a worker exits), and the
  program executes a trap, so the step fails with a CUDA error instead of hanging or returning wrong bits.

Launch constants: PER_PROGRAM elements per program and 4 warps; they fix the partition of the message, not
any arithmetic (each element is one addition), so they may be anything. The CPU interpreter cannot run two
ranks at once: `phases` lets a test run the send half of both ranks, then the receive half.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detinfer.kernels._direct import LaunchCache
from detinfer.kernels._launch import interpreting
from detinfer.kernels._pdl import launch_options, pdl_start, use_pdl
from detinfer.kernels.chunked_linear import pairwise_tree_sum
from detinfer.kernels.peer_push import rank_ptr

# Elements per program: 16 fp32 per thread at 4 warps. A decode step's 4096-wide partial is 2 programs; a
# batch of 64 is 128 programs reading the peer in parallel (the NVLink round trip is the cost, not bytes).
PER_PROGRAM = 2048
# Programs (and mailboxes) per slot: the largest message is G_MAX * PER_PROGRAM elements (8 MiB of fp32).
G_MAX = 1024
CAPACITY = G_MAX * PER_PROGRAM
SEND, RECEIVE, BOTH = 1, 2, 3  # phases
LOCAL_PARTS = (1, 2, 4, 8)  # a rank's chunk partials the kernel adds itself (`--tp-invariant-reduction`: C / N)

_HAS_TIMER = hasattr(getattr(getattr(tl, "extra", None), "cuda", None), "globaltimer")


@triton.jit
def _trap(x):
    """Kill the kernel (and with it the step): the CUDA launch fails with an error the runner reports."""
    tl.inline_asm_elementwise("trap;\n\tmov.u64 $0, $1;", "=l,l", [x], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _give_up_if_late_or_aborted(start, spins, timeout_ns, abort_ptr, why, HAS_TIMER: tl.constexpr):
    """One poll loop's give-up check: trap (with `why` as the asm operand) once timeout_ns have passed since
    `start` (globaltimer) or, with no clock, after timeout_ns / 100 polls (each at least ~100 ns of an L2 round
    trip), or as soon as the host raised the abort word."""
    if HAS_TIMER:
        late = (tl.extra.cuda.globaltimer() - start) > timeout_ns
    else:
        late = spins > timeout_ns // 100
    stop = tl.load(abort_ptr, volatile=True) != 0
    if late | stop:
        _trap(why)


@triton.jit
def _wait_for_peer(flag_ptr, ep, abort_ptr, timeout_ns, HW_WAIT: tl.constexpr, HAS_TIMER: tl.constexpr):
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    if HW_WAIT:
        spins = 0
        start = 0
        if HAS_TIMER:
            start = tl.extra.cuda.globaltimer()
        while seen < ep:
            spins += 1
            _give_up_if_late_or_aborted(start, spins, timeout_ns, abort_ptr, seen, HAS_TIMER)
            seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    else:
        tl.device_assert(seen >= ep, "peer_sum: the peer has not sent (interpreter: run SEND on both first)")


@triton.jit
def _local_tree(parts_ptr, offs, ok, part_stride, NUM_PARTS: tl.constexpr):
    """This rank's parts [NUM_PARTS, n] (fp32, or 16-bit partials) added in `pairwise_tree_sum`'s tree:
    elementwise fp32 additions, so the bits are those of the torch tree whatever the layout."""
    p0 = tl.load(parts_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    s = p0
    if NUM_PARTS >= 2:
        p1 = tl.load(parts_ptr + part_stride + offs, mask=ok, other=0.0).to(tl.float32)
        s = p0 + p1
    if NUM_PARTS >= 4:
        p2 = tl.load(parts_ptr + 2 * part_stride + offs, mask=ok, other=0.0).to(tl.float32)
        p3 = tl.load(parts_ptr + 3 * part_stride + offs, mask=ok, other=0.0).to(tl.float32)
        s = s + (p2 + p3)
    if NUM_PARTS == 8:
        p4 = tl.load(parts_ptr + 4 * part_stride + offs, mask=ok, other=0.0).to(tl.float32)
        p5 = tl.load(parts_ptr + 5 * part_stride + offs, mask=ok, other=0.0).to(tl.float32)
        p6 = tl.load(parts_ptr + 6 * part_stride + offs, mask=ok, other=0.0).to(tl.float32)
        p7 = tl.load(parts_ptr + 7 * part_stride + offs, mask=ok, other=0.0).to(tl.float32)
        s = s + ((p4 + p5) + (p6 + p7))
    return s


@triton.jit
def _send(x, mask, box, mail0_addr, mail1_addr, flags0_addr, flags1_addr, g, ep,
          RANK: tl.constexpr, GMAX: tl.constexpr):
    """Push this program's values into the peer's mailbox (posted stores: the reader's copy is local), then
    raise the peer's flag for program g."""
    tl.store(rank_ptr(mail0_addr, mail1_addr, 1 - RANK, tl.float32) + box, x, mask=mask)
    tl.debug_barrier()  # every thread's writes into the peer's mailbox happen before the flag's release
    peer_flags = rank_ptr(flags0_addr, flags1_addr, 1 - RANK, tl.int64)
    tl.atomic_xchg(peer_flags + RANK * GMAX + g, ep, sem="release", scope="sys")


@triton.jit
def _await_mailbox(mail0_addr, mail1_addr, flags0_addr, flags1_addr, g, ep, abort_ptr, timeout_ns,
                   RANK: tl.constexpr, GMAX: tl.constexpr, HW_WAIT: tl.constexpr, HAS_TIMER: tl.constexpr):
    """Wait for the peer's flag for program g; then this rank's mailboxes (which the peer filled), a pointer."""
    own_flags = rank_ptr(flags0_addr, flags1_addr, RANK, tl.int64)
    _wait_for_peer(own_flags + (1 - RANK) * GMAX + g, ep, abort_ptr, timeout_ns, HW_WAIT, HAS_TIMER)
    tl.debug_barrier()  # the acquire (one thread) happens before every thread's mailbox reads
    return rank_ptr(mail0_addr, mail1_addr, RANK, tl.float32)


@triton.jit
def _receive(mask, box, mail0_addr, mail1_addr, flags0_addr, flags1_addr, g, ep, abort_ptr, timeout_ns,
             RANK: tl.constexpr, GMAX: tl.constexpr, HW_WAIT: tl.constexpr, HAS_TIMER: tl.constexpr):
    """Wait for the peer's flag for program g, then read what it pushed into this rank's mailbox."""
    own_mail = _await_mailbox(mail0_addr, mail1_addr, flags0_addr, flags1_addr, g, ep, abort_ptr, timeout_ns,
                              RANK, GMAX, HW_WAIT, HAS_TIMER)
    return tl.load(own_mail + box, mask=mask, other=0.0, cache_modifier=".cv")  # never a stale cached line


@triton.jit
def _missing_words(words, mask, tag):
    """How many of the masked words do not carry `tag` yet (0: all arrived)."""
    return tl.sum(tl.where(mask & ((words >> 32).to(tl.int32) != tag), 1, 0))


@triton.jit
def _receive_tagged(mask, box, mail0_addr, mail1_addr, ep, abort_ptr, timeout_ns, RANK: tl.constexpr,
                    HW_WAIT: tl.constexpr, HAS_TIMER: tl.constexpr):
    """Poll this rank's tagged mailbox until every masked word carries epoch ep's tag; their fp32 values
    (`kernels.peer_push` sends them). Volatile loads: a line read at an earlier poll is never reused."""
    own = rank_ptr(mail0_addr, mail1_addr, RANK, tl.int64) + box
    tag = ep.to(tl.int32)  # the low 32 bits, as `peer_push.send_tagged` wrote them
    words = tl.load(own, mask=mask, other=0, volatile=True)
    missing = _missing_words(words, mask, tag)
    if HW_WAIT:
        spins = 0
        start = 0
        if HAS_TIMER:
            start = tl.extra.cuda.globaltimer()
        while missing > 0:
            spins += 1
            _give_up_if_late_or_aborted(start, spins, timeout_ns, abort_ptr, missing.to(tl.int64), HAS_TIMER)
            words = tl.load(own, mask=mask, other=0, volatile=True)
            missing = _missing_words(words, mask, tag)
    else:
        tl.device_assert(missing == 0, "peer_sum: the peer has not sent (interpreter: run SEND on both first)")
    return words.to(tl.int32).to(tl.float32, bitcast=True)  # the low 32 bits


@triton.jit
def _peer_sum_kernel(parts_ptr, bias_ptr, out_ptr, epochs_ptr, abort_ptr,
                     mail0_addr, mail1_addr, flags0_addr, flags1_addr, n, row_len, part_stride, timeout_ns,
                     RANK: tl.constexpr, NUM_PARTS: tl.constexpr, EXCHANGE: tl.constexpr, HAS_BIAS: tl.constexpr,
                     PHASES: tl.constexpr, PER: tl.constexpr, GMAX: tl.constexpr, HW_WAIT: tl.constexpr,
                     HAS_TIMER: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)  # the parts are the previous kernel's output
    g = tl.program_id(0)
    offs = g.to(tl.int64) * PER + tl.arange(0, PER)
    ok = offs < n
    x = _local_tree(parts_ptr, offs, ok, part_stride, NUM_PARTS)
    if EXCHANGE:
        ep = tl.load(epochs_ptr + g) + 1
        box = ((ep % 2) * GMAX + g) * PER + tl.arange(0, PER)
        if PHASES % 2 == 1:
            _send(x, ok, box, mail0_addr, mail1_addr, flags0_addr, flags1_addr, g, ep, RANK, GMAX)
    if PHASES >= 2:
        s = x
        if EXCHANGE:
            y = _receive(ok, box, mail0_addr, mail1_addr, flags0_addr, flags1_addr, g, ep, abort_ptr, timeout_ns,
                         RANK, GMAX, HW_WAIT, HAS_TIMER)
            s = x + y  # one IEEE addition: the same bits on both ranks (commutative)
            tl.store(epochs_ptr + g, ep)
        if HAS_BIAS:
            s = s + tl.load(bias_ptr + offs % row_len, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, s.to(out_ptr.dtype.element_ty), mask=ok)


_LAUNCHES = LaunchCache(_peer_sum_kernel)
_NO_PEER = (0, 0, 0, 0)


def launch_peer_sum(parts: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, rank: int,
                    addresses: tuple[int, int, int, int] | None, epochs: torch.Tensor | None,
                    abort: torch.Tensor | None, timeout_ns: int = 0, phases: int = BOTH) -> None:
    """out = round(tree(parts) [+ the peer's tree(parts)] [+ bias]).

    `parts` [C, ..., N] (C in 1, 2, 4, 8; contiguous per part; fp32, or fp16/bf16 partials as fast mode
    has them) are this rank's partials, added in `pairwise_tree_sum`'s tree; at most CAPACITY elements per
    part. With `addresses` (rank 0's mailboxes, rank 1's mailboxes, rank 0's flags, rank 1's flags: this
    rank's own among them, the peer's mapped into this process) and this rank's `epochs` [G_MAX] int64 and
    `abort` [1] int32, the peer's tree is added (both ranks call with the same shapes, in the same order);
    with `addresses=None` nothing is exchanged (one GPU: tree + bias + round in one launch). Validation is
    the callers' (`distributed.peer_sum.PeerSum`, `Ops.tree_sum_rounded`)."""
    num_parts = parts.shape[0]
    n = parts[0].numel()
    if n == 0:
        return
    exchange = addresses is not None
    grid = (-(-n // PER_PROGRAM),)
    row_len = parts.shape[-1]
    hw_wait = exchange and phases == BOTH and not interpreting()
    pdl = use_pdl(parts.device)
    if not exchange:
        addresses, epochs, abort, phases = _NO_PEER, parts, parts, BOTH  # unused pointers
    part_stride = parts.stride(0) if num_parts > 1 else n
    tensors = (parts, bias if bias is not None else parts, out, epochs, abort)
    # Every scalar is part of the key: a direct launch replays the scalars it was first compiled with.
    key = (n, row_len, part_stride, num_parts, rank, exchange, bias is not None, phases, parts.dtype, out.dtype,
           pdl, timeout_ns, addresses)
    if _LAUNCHES.try_launch(key, tensors):
        return
    _LAUNCHES.launch(key, tensors, grid, (*addresses, n, row_len, part_stride, int(timeout_ns)),
                     dict(RANK=rank, NUM_PARTS=num_parts, EXCHANGE=exchange, HAS_BIAS=bias is not None,
                          PHASES=phases, PER=PER_PROGRAM, GMAX=G_MAX, HW_WAIT=hw_wait,
                          HAS_TIMER=_HAS_TIMER and hw_wait, USE_PDL=pdl),
                     num_warps=4, **launch_options(pdl))


def peer_sum_ref(own: torch.Tensor, peer: torch.Tensor | None, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> torch.Tensor:
    """What the kernel computes, in torch: each rank's parts [C, ...] through `pairwise_tree_sum` (fp32),
    the two trees added (`peer` None: one GPU), then the row-parallel layer's unfused epilogue."""
    s = pairwise_tree_sum(own.float())
    if peer is not None:
        s = s + pairwise_tree_sum(peer.float())
    if bias is not None:
        s = s + bias.float()
    return s.to(dtype)
