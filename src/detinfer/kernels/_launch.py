"""Shared checks for every Triton launcher: where a kernel may run and what it accepts.

A launcher runs its Triton kernel on CUDA tensors, or on CPU tensors when Triton's interpreter is on
(TRITON_INTERPRET=1, how CI tests the kernels without a GPU). Anything else is a clear error, never a
silent fallback to a stock (batch-variant) kernel: callers that want a CPU path call the op's
pure-torch `*_ref` function, which is batch-invariant by construction.
"""

from __future__ import annotations

import os

import torch

# dtypes the Triton kernels take; they all accumulate in fp32.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (read at call time, not import time)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_kernel_inputs(op: str, *tensors: torch.Tensor | None, dtypes=KERNEL_DTYPES) -> None:
    """Raise a ValueError/TypeError naming `op` if the tensors cannot go to its Triton kernel."""
    present = [t for t in tensors if t is not None]
    for t in present:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: expected torch.Tensor, got {type(t).__name__}")
        if t.dtype not in dtypes:
            allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise TypeError(f"{op}: dtype {str(t.dtype).replace('torch.', '')} is not supported "
                            f"(allowed: {allowed}); use the op's *_ref function for other dtypes")
    devices = {t.device for t in present}
    if len(devices) > 1:
        raise ValueError(f"{op}: all tensors must be on one device, got {sorted(map(str, devices))}")
    if present:
        dev = present[0].device
        if dev.type == "cpu" and not interpreting():
            raise ValueError(f"{op}: the Triton kernel needs CUDA tensors (got CPU); set TRITON_INTERPRET=1 "
                             "to run it in Triton's interpreter, or call the op's *_ref function")
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"{op}: unsupported device {dev}; allowed: cuda (or cpu with TRITON_INTERPRET=1)")
