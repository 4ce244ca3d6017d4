"""A direct NCCL communicator (ctypes over the libnccl that torch's CUDA build ships) for collectives that
must be captured in CUDA graphs.

Why not the torch process group for these: a `ProcessGroupNCCL` collective goes through torch's work
objects, its own NCCL stream and event bookkeeping; a plain `ncclAllReduce` / `ncclAllGather` enqueued on
the current stream is one kernel launch that graph capture records like any other. Both capture; measured
on 2 x H100 (NVLink, torch 2.11, NCCL 2.28; `bench/bench_collectives.py`), fp32 all-reduce per call
inside a graph: torch's group 11.7 us at 8 KB and 12.3 us at 64 KB, this communicator 8.3 and 8.9 us. The
torch group stays for everything else (start-up, gloo on CPU, the abort path).

Exactness is unchanged: an all-gather is a data move, so its bits never depend on the algorithm NCCL picks;
an fp32 sum over two ranks is one IEEE addition (commutative), so at P=2 any all-reduce gives the
gather-then-add bits (see `TPGroup.sum_partials`).

The unique id is exchanged through the group's TCP store. NVLink multicast (NVLS) stays off: a program that
uses it can take a shared host's GPUs out of service, so `NCCL_NVLS_ENABLE=0` is set before the
communicator is created unless the caller set it.
"""

from __future__ import annotations

import ctypes
import glob
import os

import torch

_NCCL_UNIQUE_ID_BYTES = 128
_DTYPES = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6, torch.float32: 7,
           torch.float64: 8, torch.bfloat16: 9}
_NCCL_SUM = 0


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * _NCCL_UNIQUE_ID_BYTES)]


def _candidate_paths() -> list[str]:
    paths = ["libnccl.so.2"]  # torch's CUDA build has loaded it already: dlopen returns that copy
    site = os.path.dirname(os.path.dirname(torch.__file__))  # the nvidia-nccl wheel sits beside torch
    paths += sorted(glob.glob(os.path.join(site, "nvidia", "nccl*", "lib", "libnccl.so*")))
    return paths


def load_library() -> ctypes.CDLL:
    """libnccl with the signatures used here; a clear error where there is none (CPU builds of torch)."""
    errors = []
    for path in _candidate_paths():
        try:
            lib = ctypes.CDLL(path)
            break
        except OSError as e:
            errors.append(f"{path}: {e}")
    else:
        raise RuntimeError("NCCL library not found (a CUDA build of torch ships it): " + "; ".join(errors[:3]))
    p, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(NcclUniqueId)]
    lib.ncclCommInitRank.argtypes = [ctypes.POINTER(p), i, NcclUniqueId, i]
    lib.ncclAllReduce.argtypes = [p, p, sz, i, i, p, p]
    lib.ncclAllGather.argtypes = [p, p, sz, i, p, p]
    lib.ncclBroadcast.argtypes = [p, p, sz, i, i, p, p]
    lib.ncclCommAbort.argtypes = [p]
    lib.ncclCommDestroy.argtypes = [p]
    lib.ncclGetErrorString.argtypes = [i]
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    for name in ("ncclGetUniqueId", "ncclCommInitRank", "ncclAllReduce", "ncclAllGather", "ncclBroadcast",
                 "ncclCommAbort", "ncclCommDestroy"):
        getattr(lib, name).restype = i
    return lib


class NcclComm:
    """One communicator over `size` ranks, one GPU each. Every call enqueues on the current CUDA stream."""

    def __init__(self, rank: int, size: int, device: torch.device, store, key: str = "detinfer/nccl_uid"):
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        self.lib, self.rank, self.size, self.device = load_library(), rank, size, device
        uid = NcclUniqueId()
        if rank == 0:
            self._check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
            store.set(key, bytes(uid.internal))
        else:
            raw = store.get(key)  # blocks until rank 0 has set it (the store's timeout bounds the wait)
            ctypes.memmove(uid.internal, raw, _NCCL_UNIQUE_ID_BYTES)
        self.comm = ctypes.c_void_p()
        with torch.cuda.device(device):
            self._check(self.lib.ncclCommInitRank(ctypes.byref(self.comm), size, uid, rank), "ncclCommInitRank")

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            msg = self.lib.ncclGetErrorString(code).decode()
            raise RuntimeError(f"{what} failed on rank {self.rank}: NCCL error {code} ({msg})")

    @staticmethod
    def _dtype(t: torch.Tensor) -> int:
        if t.dtype not in _DTYPES:
            raise TypeError(f"NCCL collectives here take {sorted(str(d) for d in _DTYPES)}, got {t.dtype}")
        return _DTYPES[t.dtype]

    def _stream(self) -> ctypes.c_void_p:
        return ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[P, *t.shape]: every rank's `t` in rank order (a data move, exact)."""
        t = t.contiguous()
        out = t.new_empty((self.size, *t.shape))
        self._check(self.lib.ncclAllGather(t.data_ptr(), out.data_ptr(), t.numel(), self._dtype(t), self.comm,
                                           self._stream()), "ncclAllGather")
        return out

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """In place: the sum over ranks in NCCL's order (exact only where that order cannot matter)."""
        if not t.is_contiguous():
            raise ValueError("all_reduce_sum needs a contiguous tensor (it reduces in place)")
        self._check(self.lib.ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(), self._dtype(t), _NCCL_SUM,
                                           self.comm, self._stream()), "ncclAllReduce")
        return t

    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        """In place: rank `root`'s values on every rank (a data move, exact)."""
        if not t.is_contiguous():
            raise ValueError("broadcast needs a contiguous tensor (it writes in place)")
        self._check(self.lib.ncclBroadcast(t.data_ptr(), t.data_ptr(), t.numel(), self._dtype(t), root, self.comm,
                                           self._stream()), "ncclBroadcast")
        return t

    def abort(self) -> None:
        """Unblock collectives stuck on a dead peer (safe from another thread)."""
        if self.comm:
            self.lib.ncclCommAbort(self.comm)
            self.comm = ctypes.c_void_p()
