"""The two-GPU cross-rank sum through peer memory: set-up and use of `kernels.peer_sum` (see its doc).

Each rank allocates one block on its GPU (mailboxes, flags, epoch counters, abort flag), shares it with the
other rank as a CUDA IPC handle through the group's TCP store, and maps the peer's block. From then on a
row-parallel sum is one kernel launch on the current stream (captured in CUDA graphs like any kernel).

When it is used: two ranks on CUDA GPUs that can access each other's memory (NVLink or PCIe peer access),
both agreeing at start-up, for every message size: a message larger than a channel (`kernels.peer_sum.CAPACITY`
elements, 8 MiB of fp32; `kernels.peer_sum_norm.G_ROWS` rows) goes through in row pieces, one launch each.
Every element's sum is one addition and every row's norm is its own, so the pieces give the bits of one
launch (and of the library all-reduce, `TPGroup.exact_sum`); the mailbox protocol is per call, so pieces are
just successive calls. Why not the library above the capacity: a prefill-sized sum through the peer kernel
took ~0.65x the time of NCCL's fp32 all-reduce + cast (8 MiB, 2 x H100; docs/performance.md), and one path
at every size is one path to test. `DETINFER_TP_PEER_SUM=0` turns it off (every sum through NCCL).
"""

from __future__ import annotations

import ctypes
import os
import pickle
import warnings
import weakref

import torch

from detinfer.kernels import peer_combine as combine_kernel
from detinfer.kernels import peer_sum as kernel
from detinfer.kernels import peer_sum_norm as norm_kernel
from detinfer.kernels.peer_push import PeerPush
from detinfer.kernels.rmsnorm import _layout_for

_KEY = "detinfer/peer_sum/{}"
_IPC_LAZY_ENABLE_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS


def wanted(rank: int, size: int, device: torch.device) -> bool:
    """Whether this rank can and may use the peer sum (the ranks then agree: `TPGroup.agree_min`)."""
    if size != 2 or device.type != "cuda" or os.environ.get("DETINFER_TP_PEER_SUM", "1") == "0":
        return False
    # Rank r runs on the r-th GPU after rank 0's (engine/tp_runner.py), so the peer is the neighbour.
    index = device.index if device.index is not None else torch.cuda.current_device()
    peer = index + 1 if rank == 0 else index - 1
    return 0 <= peer < torch.cuda.device_count() and torch.cuda.can_device_access_peer(index, peer)


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]  # CUipcMemHandle


def _open_peer_allocation(handle: bytes) -> int:
    """Map the peer's allocation (a CUDA IPC handle) into this process for the current GPU; its base."""
    lib = _driver()
    fn = getattr(lib, "cuIpcOpenMemHandle_v2", None) or lib.cuIpcOpenMemHandle
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcHandle, ctypes.c_uint]
    h = _IpcHandle()
    ctypes.memmove(ctypes.addressof(h), handle, ctypes.sizeof(h))
    base = ctypes.c_uint64()
    code = fn(ctypes.byref(base), h, _IPC_LAZY_ENABLE_PEER_ACCESS)
    if code != 0:
        raise RuntimeError(f"peer sum: cuIpcOpenMemHandle failed (CUresult {code})")
    return base.value


def _close_peer_allocation(base: int) -> None:
    try:
        lib = _driver()
        lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
        lib.cuIpcCloseMemHandle(base)
    except Exception:  # noqa: BLE001 - teardown (the process may be exiting, the context gone)
        pass


def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _export(block: torch.Tensor) -> tuple[bytes, int]:
    """This rank's block as (CUDA IPC handle of the allocation holding it, the block's byte offset in it).
    Through the driver, not torch's sharing format (which wraps the handle in a header of its own)."""
    lib = _driver()
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    get_range = getattr(lib, "cuMemGetAddressRange_v2", None) or lib.cuMemGetAddressRange
    get_range.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    code = get_range(ctypes.byref(base), ctypes.byref(size), block.data_ptr())
    if code != 0:
        raise RuntimeError(f"cuMemGetAddressRange failed (CUresult {code})")
    handle = _IpcHandle()
    lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), ctypes.c_uint64]
    code = lib.cuIpcGetMemHandle(ctypes.byref(handle), base.value)
    if code != 0:  # e.g. memory from expandable segments (cuMemCreate), which this kind of handle cannot share
        raise RuntimeError(f"cuIpcGetMemHandle failed (CUresult {code})")
    return ctypes.string_at(ctypes.addressof(handle), ctypes.sizeof(handle)), block.data_ptr() - base.value


def connect_pair(rank: int, device: torch.device, store, timeout_s: float, agree) -> PeerSum | None:
    """Set up the peer sum on both ranks (call on both at the same point): a `PeerSum`, or None on both
    ranks when either rank could not share or map its block (then every sum goes through NCCL; a warning
    says why). `agree(int) -> int` is the group's min over ranks."""
    words = PeerSum.WORDS
    block, shared, problem = None, None, None
    with torch.cuda.device(device):
        try:
            block = torch.zeros(words, dtype=torch.int64, device=device)
            torch.cuda.synchronize(device)  # zeroed before the peer can see it
            shared = _export(block)
        except Exception as e:  # noqa: BLE001 - reported below, both ranks fall back together
            problem = f"{type(e).__name__}: {e}"
        store.set(_KEY.format(rank), pickle.dumps(shared))  # always: the peer waits for this key
        peer_shared = pickle.loads(store.get(_KEY.format(1 - rank)))
        mapped = None
        if shared is not None and peer_shared is not None:
            try:
                mapped = _open_peer_allocation(peer_shared[0])
            except Exception as e:  # noqa: BLE001 - as above
                problem = f"{type(e).__name__}: {e}"
        elif problem is None:
            problem = "the peer could not share its block"
    if not agree(int(mapped is not None)):
        if mapped is not None:
            _close_peer_allocation(mapped)
        warnings.warn(f"detinfer: the two-GPU peer sum is off, the row-parallel sums go through NCCL "
                      f"(same bits, slower): {problem or 'the peer could not map this block'}", RuntimeWarning,
                      stacklevel=2)
        return None
    return PeerSum(rank, device, block, mapped, mapped + peer_shared[1], timeout_s)


def _channel_layout() -> tuple[dict, int]:
    """Word offsets (int64 words) of each channel's mailboxes [2, G, BOX] fp32 (int64 for tagged words), flags
    [2, G] and epochs [G] in the block, and the abort flag's: "elements" for `kernels.peer_sum`, "rows" and
    "rows_tagged" for `kernels.peer_sum_norm`."""
    offsets, at = {}, 0
    for name, box, g, word_bytes in (("elements", kernel.PER_PROGRAM, kernel.G_MAX, 4),
                                     ("rows", norm_kernel.BOX, norm_kernel.G_ROWS, 4),
                                     ("rows_tagged", norm_kernel.BOX, norm_kernel.G_TAGGED, 8)):
        mail_words = 2 * g * box * word_bytes // 8  # two slots of g * box values
        offsets[name] = (at, at + mail_words, at + mail_words + 2 * g, g)
        at += mail_words + 3 * g
    return offsets, at


class PeerSum:
    """This rank's block (three channels of mailboxes, flags and epochs; an abort flag) and the peer's, mapped
    (`connect_pair`)."""

    LAYOUT, ABORT_WORD = _channel_layout()
    WORDS = ABORT_WORD + 1

    def __init__(self, rank: int, device: torch.device, block: torch.Tensor, mapped: int, peer_base: int,
                 timeout_s: float):
        self.rank, self.device, self._block = rank, device, block
        self.timeout_ns = int(timeout_s * 1e9)
        weakref.finalize(self, _close_peer_allocation, mapped)  # the peer's mapping lives as long as this
        own_base = block.data_ptr()
        bases = (own_base, peer_base) if rank == 0 else (peer_base, own_base)
        self.channels = {}  # name -> (addresses for the kernel, this rank's epochs)
        for name, (mail, flags, epochs, g) in self.LAYOUT.items():
            addresses = (bases[0] + 8 * mail, bases[1] + 8 * mail, bases[0] + 8 * flags, bases[1] + 8 * flags)
            self.channels[name] = (addresses, block[epochs:epochs + g])
        self.abort_flag = block[self.ABORT_WORD:].view(torch.int32)[:1]
        self._one = torch.ones(1, dtype=torch.int32).pin_memory()
        self._abort_stream = torch.cuda.Stream(device)
        self._pushes: dict[int, PeerPush] = {}  # row width -> where a matmul pushes such rows (`push_for`)

    @staticmethod
    def fits(parts: torch.Tensor) -> bool:
        """Whether the kernel takes this rank's partials parts [C, ..., N] (C in LOCAL_PARTS; rows of at most
        CAPACITY elements, any number of them: larger messages go in row pieces)."""
        return parts.dim() >= 2 and parts.shape[0] in kernel.LOCAL_PARTS and parts.shape[-1] <= kernel.CAPACITY

    def sum_rounded(self, parts: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """round_to(dtype, tree(parts) + the peer's tree(parts) [+ bias]) for this rank's partials parts
        [C, ..., N] on its GPU (fp32; fast mode's are 16-bit), `fits(parts)`; the peer calls with the same
        shape at the same point of its step."""
        if parts.dtype not in (torch.float32, torch.bfloat16, torch.float16) or parts.device != self.device:
            raise ValueError(f"peer sum: takes float partials on {self.device}, got {parts.dtype} on {parts.device}")
        if not self.fits(parts):
            raise ValueError(f"peer sum: parts {tuple(parts.shape)}: the kernel adds {kernel.LOCAL_PARTS} parts of "
                             f"at most {kernel.CAPACITY} elements")
        parts = parts.contiguous()
        out = torch.empty(parts.shape[1:], dtype=dtype, device=parts.device)
        if bias is not None:
            bias = bias.contiguous()
        addresses, epochs = self.channels["elements"]
        n = parts.shape[-1]
        rows_in, rows_out = parts.view(parts.shape[0], -1, n), out.view(-1, n)
        step = kernel.CAPACITY // n  # whole rows per launch: the bias stays aligned with each piece's columns
        for r in range(0, rows_in.shape[1], step):
            kernel.launch_peer_sum(rows_in[:, r:r + step], bias, rows_out[r:r + step], self.rank, addresses,
                                   epochs, self.abort_flag, self.timeout_ns)
        return out

    @staticmethod
    def fits_norm(parts: torch.Tensor) -> bool:
        return norm_kernel.fits(parts)

    TRANSPORTS = ("flags", "tagged", "pushed")

    def sum_rms_norm(self, parts: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                     weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None,
                     transport: str = "flags", want_sum: bool = False):
        """`rms_norm(sum_rounded(parts, bias, dtype), weight, eps, residual)` in one kernel (the same bits):
        y, or (y, h) with the residual; with `want_sum` the rounded sum x comes first ((x, y) or (x, y, h)).
        parts [C, T, D] fp32, `fits_norm(parts)`. `transport`, the same on both ranks: "flags" (values, then a
        flag per program), "pushed" (the matmul that made `parts` sent them already: `push_for`; receive
        only), "tagged" (this kernel sends tagged words itself: tests and benchmarks). Same bits every way."""
        if transport not in self.TRANSPORTS:
            raise ValueError(f"peer sum: transport must be one of {self.TRANSPORTS}, got {transport!r}")
        parts = parts.contiguous()
        t, d = parts.shape[1:]
        x = torch.empty((t, d), dtype=dtype, device=parts.device)
        y_dtype = dtype if weight is None else torch.promote_types(weight.dtype, dtype)
        y = torch.empty((t, d), dtype=y_dtype, device=parts.device)
        h = torch.empty_like(x) if residual is not None else None
        tagged = transport != "flags"
        addresses, epochs = self.channels["rows_tagged" if tagged else "rows"]
        step = norm_kernel.rows_per_launch(d)  # larger steps in row pieces: each row's norm is its own
        for r in range(0, t, step):
            piece = slice(r, r + step)
            norm_kernel.launch_peer_sum_rms_norm(
                parts[:, piece], bias, residual[piece] if residual is not None else None, weight, eps, x[piece],
                y[piece], h[piece] if h is not None else None, self.rank, addresses, epochs, self.abort_flag,
                self.timeout_ns, tagged=tagged, pushed=transport == "pushed")
        out = (y,) if residual is None else (y, h)
        out = ((x,) if want_sum else ()) + out
        return out[0] if len(out) == 1 else out

    @staticmethod
    def can_push(rows: int, d: int) -> bool:
        """Whether a sum + norm of `rows` rows of width d fits the tagged channel: a norm tile that fits a
        mailbox (as `fits_norm`), one launch of at most G_TAGGED programs (decode-sized steps). The same on
        both ranks (the shape decides). A pushed partial must be consumed by the fused kernel (the peer's
        waits for it), so this never admits a call that `fits_norm` refuses."""
        block_d, per_program, _ = _layout_for(d)
        return rows > 0 and per_program * block_d <= norm_kernel.BOX and \
            norm_kernel.programs(rows, d) <= norm_kernel.G_TAGGED

    def push_for(self, rows: int, d: int) -> PeerPush | None:
        """Where a row-parallel matmul of `rows` rows and width d sends its fp32 partial for the fused sum +
        norm (`kernels.peer_push`), or None when it does not fit (`can_push`): then the sum kernel sends."""
        if not self.can_push(rows, d):
            return None
        push = self._pushes.get(d)
        if push is None:
            (mail0, mail1, _, _), epochs = self.channels["rows_tagged"]
            block_d, norm_rows, _ = _layout_for(d)
            push = self._pushes[d] = PeerPush(mail0, mail1, epochs, self.rank, norm_rows, block_d, norm_kernel.BOX,
                                              norm_kernel.G_TAGGED * norm_kernel.BOX)
        return push

    @staticmethod
    def fits_combine(y: torch.Tensor) -> bool:
        return combine_kernel.fits(y)

    def combine(self, weights: torch.Tensor, ids: torch.Tensor, y: torch.Tensor, experts_per_rank: int,
                dtype: torch.dtype) -> torch.Tensor:
        """Expert parallelism: the MoE combine of each slot's owner's output (`kernels.peer_combine`): the
        bits of all-gathering y [T, k, H] and combining the owners' slots. `fits_combine(y)`."""
        out = torch.empty((y.shape[0], y.shape[2]), dtype=dtype, device=y.device)
        addresses, epochs = self.channels["rows"]
        combine_kernel.launch_peer_combine(weights.contiguous(), ids.contiguous(), y.contiguous(), out,
                                           experts_per_rank, self.rank, addresses, epochs, self.abort_flag,
                                           self.timeout_ns)
        return out

    def abort(self) -> None:
        """Make a kernel waiting for a dead peer trap now (a copy engine writes the flag: it needs no free SM)."""
        with torch.cuda.stream(self._abort_stream):
            self.abort_flag.copy_(self._one, non_blocking=True)
