"""One tensor-parallel process group and the two collectives the parallel layers use.

The group is a standalone `ProcessGroupGloo` (CPU) / `ProcessGroupNCCL` (CUDA) over its own TCP store: it is
never registered as torch.distributed's default group, so an engine with TP does not take over (or clash
with) a process group the caller set up, and several engines can live in one process.

Collectives and their determinism:
- `all_gather(t)` -> [P, *t.shape]: a pure data move, so its result is exact whatever algorithm, protocol or
  channel count the library picks for the message size. Deterministic mode builds every cross-rank sum from
  it: gather the fp32 partials, then add them in a fixed order on every rank (`Ops.tree_sum`).
- `all_reduce_sum(t)`: the library's all-reduce, whose summation order may change with the message size (NCCL
  switches ring/tree and protocols), so fast mode uses it as is.
- `exact_sum(t)`: the deterministic cross-rank sum of fp32 partials. Its bits are those of "all-gather, then
  add in the fixed pairwise tree" (`pairwise_tree_sum`) on every rank and for every message size; at P = 2 it
  gets them from the all-reduce (see `exact_sum` for why that is exact there).
- `broadcast(t)`: rank 0's `t` on every rank (a data move: exact).
- `scatter(out, parts)`: rank r gets rank 0's `parts[r]` (a data move: exact; weight loads).
- `exact_sum_rounded(parts, bias, dtype)`: this rank's chunk tree, `exact_sum`, then the row-parallel
  epilogue (+ bias, round to the model dtype). With two GPUs that can read each other's memory it is one
  kernel of our own (`distributed.peer_sum`: 5.5 us against 9.7 us for the library all-reduce plus a cast at
  16 KB in a CUDA graph on 2 x H100), else the tree, `exact_sum` and elementwise ops; the same bits either
  way (the sum is one IEEE addition). `fast_sum(t)`: fast mode's, through the same kernel.

On GPUs the per-step collectives (all_gather, all_reduce_sum, exact_sum, broadcast) go through a direct NCCL
communicator (`nccl_comm.NcclComm`) that enqueues on the current CUDA stream: one kernel launch, captured in
CUDA graphs like any other (faster than the torch group's collectives inside a graph: 8.9 vs 12.3 us per fp32
all-reduce at 64 KB on 2 x H100, bench/bench_collectives.py). `DETINFER_TP_COLLECTIVES=torch` uses the torch
group instead (same bits: the sums are exact whatever the transport). The torch group does the rest
(agree_min at start-up, abort). Every rank must capture and replay the same collectives in the same order.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from detinfer.kernels.chunked_linear import pairwise_tree_sum

# How long a collective (or the rendezvous) may wait for a peer before it fails instead of hanging. A worker
# that dies is normally noticed at once (its sockets close, or the runner's watcher aborts the group); this
# bounds the cases nothing notices, e.g. a peer that hangs.
DEFAULT_TIMEOUT_S = 300.0

# Environment defaults of every NCCL rank (set before its communicator exists; a value the user set wins).
# NVLink SHARP / multicast reduces inside the switch, in an order and precision this package does not
# control, and is not reliably available on the machines we run on: off. The sums here are built from
# plain point-to-point data moves (and, at P = 2, one addition per element).
NCCL_ENV_DEFAULTS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (benchmarks; the engine uses `master_store`, which cannot race)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def master_store(size: int, *, host: str = "127.0.0.1", timeout_s: float = DEFAULT_TIMEOUT_S):
    """Rank 0's store on a port the OS picks (`store.port` tells the workers where it is)."""
    return dist.TCPStore(host, 0, size, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass
class TPGroup:
    rank: int
    size: int
    backend: str
    pg: object  # the ProcessGroupGloo / ProcessGroupNCCL
    device: torch.device = torch.device("cpu")  # where this rank's tensors live (NCCL: its GPU)
    comm: object | None = None  # NcclComm on GPUs (see the module doc); None: the torch group does it all
    peer: object | None = None  # PeerSum (two GPUs with peer access); None: exact_sum_rounded uses exact_sum

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` (same shape and dtype on all ranks), stacked in rank order: [P, *t.shape]."""
        t = t.contiguous()
        if self.comm is not None:
            return self.comm.all_gather(t)
        out = t.new_empty((self.size, *t.shape))  # gathered straight into the stacked result
        if self.backend == "nccl":  # one flat all-gather into `out`: no staging buffer and copy-outs
            self.pg._allgather_base(out, t).wait()
        else:
            self.pg.allgather([list(out.unbind(0))], [t]).wait()
        return out

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks in the library's order (fast mode; see the module doc)."""
        if self.comm is not None:
            return self.comm.all_reduce_sum(t)
        self.pg.allreduce([t]).wait()
        return t

    def exact_sum(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of fp32 `t` with exactly the bits of `pairwise_tree_sum(self.all_gather(t))`
        (rank order, fixed tree), on every rank, for any shape. `t` is consumed (may be overwritten).

        P = 2: the library's all-reduce. Why that is exact: with two ranks every element has two summands, a
        (rank 0's) and b (rank 1's), and the all-reduce computes it with ONE IEEE addition, a + b or b + a
        (ring: one reduce step then a copy; tree: one reduce at the root then a broadcast; no accumulator
        starts from 0, which would turn -0.0 + -0.0 into +0.0), then copies that one result to both ranks.
        IEEE addition is commutative and correctly rounded, so a + b == b + a bit for bit (every input,
        -0.0, infinities and subnormals included; NaN in, NaN out), and the tree over two parts is that one
        addition. So the bits do not depend on the algorithm, protocol or channel count the library picks
        for the message size, and one all-reduce moves half the bytes of the all-gather and launches no add
        kernel. fp32 only: for 16-bit types the library may add in fp32 and round (two roundings).
        (NVLink SHARP would reduce in the switch: disabled, `NCCL_ENV_DEFAULTS`.)

        P > 2: the order matters (a + b + c rounds differently by grouping), and the library's order may
        follow the message size: all-gather (a data move) and the fixed tree on every rank."""
        if t.dtype != torch.float32:
            raise TypeError(f"exact_sum: takes fp32 partials, got {t.dtype}")
        # Measured in a decode step (Qwen3-8B shapes, 2 x H100, graphs): the all-reduce 4.20 / 5.34 ms at
        # batch 1 / 64 against 4.25 / 5.74 ms for all-gather + add (docs/performance.md).
        if self.size == 2:
            return self.all_reduce_sum(t.contiguous())
        return pairwise_tree_sum(self.all_gather(t))

    def exact_sum_rounded(self, parts: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """`(exact_sum(tree_sum(parts)) + bias.float()).to(dtype)` (no bias: without the add) for this rank's
        fp32 partials parts [C, ..., N] (C = 1 without the chunk tree): the row-parallel layer's sum and
        epilogue. The peer kernel where it applies (every rank decides alike: it depends on the shape only),
        else the tree, the collective and two elementwise ops; the same bits (elementwise additions in the
        same order, and at P = 2 the cross-rank sum is one addition)."""
        if self.peer is not None and self.peer.fits(parts):
            return self.peer.sum_rounded(parts, bias, dtype)
        y = self.exact_sum(pairwise_tree_sum(parts) if parts.shape[0] > 1 else parts[0])
        if bias is not None:
            y = y + bias.float()
        return y.to(dtype)

    def fast_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Fast mode's sum of model-dtype partials: the peer kernel where it applies (what a serving stack's
        custom all-reduce does at two GPUs), else the library all-reduce (in place)."""
        if self.peer is not None and self.peer.fits(t[None]):
            return self.peer.sum_rounded(t[None], None, t.dtype)
        return self.all_reduce_sum(t)

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """In place: rank 0's `t` on every rank (same shape and dtype everywhere)."""
        if self.comm is not None:
            return self.comm.broadcast(t)
        self.pg.broadcast([t], dist.BroadcastOptions()).wait()
        return t

    def scatter(self, out: torch.Tensor, parts: list[torch.Tensor] | None = None) -> torch.Tensor:
        """In place: rank r's `out` receives rank 0's `parts[r]` (a data move: exact). Rank 0 passes one
        tensor per rank, each shaped and typed like every rank's `out`; the others pass none. The torch group
        carries it on GPUs too: it is no per-step collective (weight loads, `distributed.weight_push`)."""
        opts = dist.ScatterOptions()
        opts.rootRank = 0
        self.pg.scatter([out], [list(parts)] if self.rank == 0 else [], opts).wait()
        return out

    def agree_min(self, value: int) -> int:
        """The smallest `value` any rank passed (e.g. the KV block count every rank can allocate)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.pg.allreduce([t], opts).wait()
        return int(t.item())

    def abort(self) -> None:
        """Unblock collectives stuck on a dead peer (NCCL; gloo notices closed sockets by itself)."""
        if self.peer is not None:
            try:
                self.peer.abort()  # a peer-sum kernel waiting for the dead rank traps
            except Exception:  # noqa: BLE001 - best effort on a group that is already broken
                pass
        if self.comm is not None:
            try:
                self.comm.abort()
            except Exception:  # noqa: BLE001 - best effort on a group that is already broken
                pass
        fn = getattr(self.pg, "abort", None)
        if fn is not None:
            try:
                fn()
            except Exception:  # noqa: BLE001 - best effort on a group that is already broken
                pass


def connect(rank: int, size: int, port: int, device: torch.device, *, host: str = "127.0.0.1",
            timeout_s: float = DEFAULT_TIMEOUT_S, store=None) -> TPGroup:
    """Join the group (blocks until all `size` ranks have joined, or `timeout_s`). Rank 0 hosts the store
    (pass its `master_store` as `store`, or rank 0 creates one on `port`)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, size, rank == 0, timeout=timeout)
    backend = backend_for(device)
    if backend == "nccl":
        for key, value in NCCL_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, size, opts)
    else:
        pg = dist.ProcessGroupGloo(store, rank, size, timeout)
    comm = None
    if backend == "nccl" and os.environ.get("DETINFER_TP_COLLECTIVES", "nccl") != "torch":
        from detinfer.distributed.nccl_comm import NcclComm
        comm = NcclComm(rank, size, device, store)
    group = TPGroup(rank, size, backend, pg, device, comm)
    group._store = store  # the store must outlive the group
    if backend == "nccl":
        from detinfer.distributed import peer_sum
        # Both ranks must take the same path for every sum, or one waits in a kernel the other never runs.
        if group.agree_min(int(peer_sum.wanted(rank, size, device))):
            group.peer = peer_sum.connect_pair(rank, device, store, timeout_s, group.agree_min)
    return group
