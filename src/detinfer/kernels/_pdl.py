"""Programmatic dependent launch (PDL): a kernel of a decode step may start while the one before it ends.

In a stream (and in a CUDA graph) a kernel normally starts only after the previous kernel has completed
and its writes are visible. A decode step of an 8B model at batch 1 is ~330 kernels of 2-70 us, so each
boundary's idle time (the next grid's launch, its programs' start-up, the first loads' DRAM latency) is
paid ~330 times. With PDL (Hopper and later), a kernel launched with the PDL attribute may start as soon as
every program of the previous kernel has called `gdc_launch_dependents` (or exited). Its programs then
run their prologue early, and must call `gdc_wait` before touching anything an earlier kernel writes or
reads: `gdc_wait` returns once the previous grid has completed and its memory is visible, and because
every PDL kernel waits before it releases its own dependents, "the previous grid completed" extends to
every earlier kernel of the stream.

Every kernel here waits before its first global read, even of step metadata that was written long
before: `gdc_wait` is also what makes a non-PDL predecessor's writes visible (measured: reading the
attention metadata before the wait would save ~0.01-0.03 ms per batch-1 step, not worth a rule about who
wrote what). The one thing done before the wait: decode-class matmuls ask the L2 for the first columns of
their weight rows (`prefetch_rows_l2`; matmul.PREFETCH_COLS says how many and why). A prefetch is a cache
hint and the L2 is coherent, so no data it fetches can be stale.

Bits: PDL changes when a program starts, never what it computes; every kernel's arithmetic is the same
with and without it (asserted on the GPU: tests/kernels/test_pdl.py).

Where it is on: CUDA devices of compute capability >= 9.0 with a Triton that has the `gdc_*` intrinsics,
not in the interpreter, unless `DETINFER_PDL=0` is set (read at import) or `set_enabled(False)` is called.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from detinfer.kernels._launch import interpreting

_ENABLED = [os.environ.get("DETINFER_PDL", "1") != "0"]
_DEVICE_OK: dict = {}


def _triton_has_gdc() -> bool:
    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    return cuda is not None and hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")


_TRITON_OK = _triton_has_gdc()


def set_enabled(on: bool) -> None:
    """Turn PDL launches on or off process-wide (launchers read this at every launch; their launch keys
    include it, so cached launches follow)."""
    _ENABLED[0] = bool(on)


def enabled() -> bool:
    return _ENABLED[0]


def use_pdl(device: torch.device) -> bool:
    """Whether launches on `device` use PDL now."""
    if not _ENABLED[0] or device.type != "cuda" or not _TRITON_OK or interpreting():
        return False
    ok = _DEVICE_OK.get(device)
    if ok is None:
        ok = _DEVICE_OK[device] = torch.cuda.get_device_capability(device)[0] >= 9
    return ok


def launch_options(on: bool) -> dict:
    """Launch keyword arguments for a kernel compiled with USE_PDL=on (none when off, so Triton versions
    or backends without the option never see it)."""
    return {"launch_pdl": True} if on else {}


@triton.jit
def pdl_start(USE_PDL: tl.constexpr):
    """Wait for the previous grid (everything before it in the stream), then let the next PDL kernel
    launch: its programs start and wait in their own `pdl_start` while this grid runs."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_rows_l2(base_ptr, rows, row_ok, stride_row, PREFETCH_COLS: tl.constexpr, COLS_PER_LINE: tl.constexpr):
    """Ask the L2 for the first PREFETCH_COLS columns (unit stride) of `rows`, one 128-byte line every
    COLS_PER_LINE columns. Rows past the edge are redirected to row 0 (a valid address)."""
    lines = tl.arange(0, PREFETCH_COLS // COLS_PER_LINE) * COLS_PER_LINE
    safe = tl.where(row_ok, rows, 0).to(tl.int64)
    ptrs = base_ptr + safe[:, None] * stride_row + lines[None, :].to(tl.int64)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)
