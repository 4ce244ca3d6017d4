"""One tensor-parallel process group and the two collectives the parallel layers use.

The group is a standalone `ProcessGroupGloo` (CPU) / `ProcessGroupNCCL` (CUDA) over its own TCP store: it is
never registered as torch.distributed's default group, so an engine with TP does not take over (or clash
with) a process group the caller set up, and several engines can live in one process.

Collectives and their determinism:
- `all_gather(t)` -> [P, *t.shape]: a pure data move, so its result is exact whatever algorithm, protocol or
  channel count the library picks for the message size. Deterministic mode builds every cross-rank sum from
  it: gather the fp32 partials, then add them in a fixed order on every rank (`Ops.tree_sum`).
- `all_reduce_sum(t)`: the library's all-reduce, whose summation order may change with the message size (NCCL
  switches ring/tree and protocols), so only fast mode uses it.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

# How long a collective (or the rendezvous) may wait for a peer before it fails instead of hanging. A worker
# that dies is normally noticed at once (its sockets close, or the runner's watcher aborts the group); this
# bounds the cases nothing notices, e.g. a peer that hangs.
DEFAULT_TIMEOUT_S = 300.0


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

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` (same shape and dtype on all ranks), stacked in rank order: [P, *t.shape]."""
        t = t.contiguous()
        out = t.new_empty((self.size, *t.shape))  # gathered straight into the stacked result
        self.pg.allgather([list(out.unbind(0))], [t]).wait()
        return out

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks in the library's order (fast mode only; see the module doc)."""
        self.pg.allreduce([t]).wait()
        return t

    def abort(self) -> None:
        """Unblock collectives stuck on a dead peer (NCCL; gloo notices closed sockets by itself)."""
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
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, size, opts)
    else:
        pg = dist.ProcessGroupGloo(store, rank, size, timeout)
    group = TPGroup(rank, size, backend, pg)
    group._store = store  # the store must outlive the group
    return group
