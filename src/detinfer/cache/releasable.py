"""A KV pool whose memory can be handed back while the engine is idle, and taken again at the same addresses.

Why: in a colocated RL loop the sampler's KV pool sits unused on the GPU while the trainer runs, which needs
that memory most. `ReleasableKV` carves every layer's K and V pools out of one device arena; `release()`
returns the arena's physical memory, `restore()` maps fresh memory back. What the pools held is gone (the
engine drops its prefix cache first), and nothing may read them in between (the engine refuses to step).

CUDA: the arena is driver virtual memory (cuMemAddressReserve / cuMemCreate / cuMemMap / cuMemSetAccess):
release unmaps and frees the physical allocation but keeps the address range, and restore maps a new one at
the same range. The pool tensors' addresses never change, so CUDA graphs captured on them stay valid.
Elsewhere (CPU) the pools are ordinary tensors: release swaps each for an empty one and restore allocates
them again (no graphs hold CPU addresses).
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["ReleasableKV"]

_ALIGN = 256  # bytes: each pool starts on a 256-byte boundary (the kernels' vector loads want >= 16)


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]  # CUmemLocation; type 1 = a device


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _MemLocation),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _MemLocation), ("flags", ctypes.c_int)]


_PINNED, _DEVICE, _READ_WRITE = 1, 1, 3  # CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_LOCATION_TYPE_DEVICE, ..._READWRITE


class _Array:
    """An arena presented to torch (`__cuda_array_interface__`, bytes). torch keeps this object alive as long
    as any tensor viewing the memory, and with it the arena, which frees its memory only after that."""

    def __init__(self, arena: _DriverArena, nbytes: int):
        self.arena = arena
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (arena.address, False),
                                         "version": 3, "strides": None}


class _DriverArena:
    """`nbytes` of device memory at a fixed virtual address, whose physical backing comes and goes."""

    def __init__(self, nbytes: int, device: torch.device):
        self.lib = ctypes.CDLL("libcuda.so.1")
        torch.cuda.synchronize(device)  # torch's primary context exists and is current on this device
        self.prop = _AllocProp(type=_PINNED, location=_MemLocation(type=_DEVICE, id=device.index))
        granularity = ctypes.c_size_t()
        self._call("cuMemGetAllocationGranularity", ctypes.byref(granularity), ctypes.byref(self.prop),
                   ctypes.c_int(0))
        self.size = -(-nbytes // granularity.value) * granularity.value
        address = ctypes.c_uint64()
        self._call("cuMemAddressReserve", ctypes.byref(address), ctypes.c_size_t(self.size), ctypes.c_size_t(0),
                   ctypes.c_uint64(0), ctypes.c_ulonglong(0))
        self.address, self.handle, self.device = address.value, None, device
        try:
            self.map()
        except BaseException:
            self._call("cuMemAddressFree", ctypes.c_uint64(self.address), ctypes.c_size_t(self.size))
            raise

    def _call(self, name: str, *args) -> None:
        code = getattr(self.lib, name)(*args)
        if code != 0:
            raise RuntimeError(f"releasable KV pool: {name} failed (CUresult {code})")

    def map(self) -> None:
        handle = ctypes.c_ulonglong()
        self._call("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(self.size), ctypes.byref(self.prop),
                   ctypes.c_ulonglong(0))
        try:
            self._call("cuMemMap", ctypes.c_uint64(self.address), ctypes.c_size_t(self.size), ctypes.c_size_t(0),
                       handle, ctypes.c_ulonglong(0))
            access = _AccessDesc(location=self.prop.location, flags=_READ_WRITE)
            self._call("cuMemSetAccess", ctypes.c_uint64(self.address), ctypes.c_size_t(self.size),
                       ctypes.byref(access), ctypes.c_size_t(1))
        except BaseException:
            self.lib.cuMemUnmap(ctypes.c_uint64(self.address), ctypes.c_size_t(self.size))
            self.lib.cuMemRelease(handle)
            raise
        self.handle = handle

    def unmap(self) -> None:
        self._call("cuMemUnmap", ctypes.c_uint64(self.address), ctypes.c_size_t(self.size))
        self._call("cuMemRelease", self.handle)
        self.handle = None

    def __del__(self):  # the last tensor on the arena is gone (see _Array)
        try:
            if self.handle is not None:
                torch.cuda.synchronize(self.device)  # no kernel may still be using the memory
                self.unmap()
            self.lib.cuMemAddressFree(ctypes.c_uint64(self.address), ctypes.c_size_t(self.size))
        except Exception:  # noqa: BLE001 - interpreter shutdown: the driver may already be unloaded
            pass


class ReleasableKV:
    """Per layer a (K pool, V pool) pair of `spec.pool_shape` (see paged_kv.KVCacheSpec), in `pools`."""

    def __init__(self, spec, num_layers: int, device: torch.device | str):
        self.spec, self.num_layers, self.device = spec, num_layers, torch.device(device)
        elem = torch.empty((), dtype=spec.dtype).element_size()
        self._pool_bytes = -(-spec.num_blocks * spec.block_size * spec.num_kv_heads * spec.head_dim * elem
                             // _ALIGN) * _ALIGN
        self.nbytes = 2 * num_layers * self._pool_bytes
        self.released = False
        self._arena = _DriverArena(self.nbytes, self.device) if self.device.type == "cuda" else None
        self.pools = self._carve()

    def _carve(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self._arena is None:
            return [tuple(torch.empty(self.spec.pool_shape, dtype=self.spec.dtype, device=self.device)
                          for _ in range(2)) for _ in range(self.num_layers)]
        arena = torch.as_tensor(_Array(self._arena, self.nbytes), device=self.device)
        n = self._pool_bytes

        def pool(i: int) -> torch.Tensor:
            return arena[i * n:(i + 1) * n].view(self.spec.dtype)[:_numel(self.spec)].view(self.spec.pool_shape)
        return [(pool(2 * layer), pool(2 * layer + 1)) for layer in range(self.num_layers)]

    def release(self) -> None:
        """Give the pools' memory back (their contents are lost). The caller guarantees nothing reads them
        until `restore`: on CUDA every kernel that used them has finished (synchronized here)."""
        if self.released:
            return
        if self._arena is not None:
            torch.cuda.synchronize(self.device)
            self._arena.unmap()
        else:
            self.pools = [tuple(torch.empty(0, dtype=self.spec.dtype) for _ in range(2)) for _ in self.pools]
        self.released = True

    def restore(self) -> None:
        """Memory for the pools again, at the same device addresses (CUDA); contents undefined."""
        if not self.released:
            return
        if self._arena is not None:
            self._arena.map()
        else:
            self.pools = self._carve()
        self.released = False


def _numel(spec) -> int:
    b, s, h, d = spec.pool_shape
    return b * s * h * d
