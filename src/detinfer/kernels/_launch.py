"""Shared checks for every Triton launcher: where a kernel may run and what it accepts.

A launcher runs its Triton kernel on CUDA tensors, or on CPU tensors when Triton's interpreter is on
(TRITON_INTERPRET=1, how CI tests the kernels without a GPU). Anything else is a clear error, never a
silent fallback to a stock (batch-variant) kernel: callers that want a CPU path call the op's
pure-torch `*_ref` function, which is batch-invariant by construction.
"""

from __future__ import annotations

import os

import torch

from detinfer.constants import FP32_DOT_PRECISION, LOW_DOT_PRECISION

# dtypes the Triton kernels take; they all accumulate in fp32.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# head_dims the attention kernels take (here, not in kernels/attention.py, so that choosing a backend
# does not import Triton).
SUPPORTED_HEAD_DIMS = (64, 128, 256)


def dot_precision(dtype: torch.dtype) -> str:
    """`input_precision` of a kernel's tl.dot for inputs of `dtype` (see constants.py)."""
    return FP32_DOT_PRECISION if dtype == torch.float32 else LOW_DOT_PRECISION


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (read at call time, not import time)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    n = int(n)
    return 1 << (n - 1).bit_length() if n > 1 else 1


_SM_COUNTS: dict = {}


def sm_count(device: torch.device, *, off_gpu: int) -> int:
    """Streaming multiprocessors of a CUDA device (cached). Off the GPU (the interpreter) there are none,
    so each launcher says which nominal count its schedule should assume there (`off_gpu`)."""
    if device.type != "cuda":
        return off_gpu
    n = _SM_COUNTS.get(device)
    if n is None:
        n = _SM_COUNTS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return n


def check_kernel_inputs(op: str, *tensors: torch.Tensor | None, dtypes=KERNEL_DTYPES) -> None:
    """Raise a ValueError/TypeError naming `op` if the tensors cannot go to its Triton kernel."""
    first = tensors[0] if tensors else None
    if isinstance(first, torch.Tensor) and first.is_cuda and first.dtype in dtypes:
        # The usual case, decided with a few attribute reads: tensors on one CUDA device, allowed dtypes.
        dev = first.device
        if all(t is None or (isinstance(t, torch.Tensor) and t.dtype in dtypes and t.device == dev)
               for t in tensors[1:]):
            return
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


def check_step_metadata(cu_q_lens: torch.Tensor, kv_lens: torch.Tensor, block_tables: torch.Tensor, *,
                        block_size: int, num_blocks: int, num_tokens: int, max_kv_len: int | None = None,
                        op: str = "paged attention") -> None:
    """Value checks of one step's metadata (one device->host copy). Raises ValueError naming the problem.

    Rows of q past cu_q_lens[-1] are allowed (padding; attention leaves them unwritten). max_kv_len, when
    given, must bound every kv_len (attention sizes its split grid from it); max_q_len is a speed hint
    only and needs no check.
    """
    cu = cu_q_lens.detach().cpu().to(torch.int64)
    kv = kv_lens.detach().cpu().to(torch.int64)
    s = kv.shape[0]
    if cu.shape != (s + 1,) or block_tables.shape[0] != s:
        raise ValueError(f"{op}: need cu_q_lens [S+1], kv_lens [S], block_tables [S, .] with one S; got "
                         f"{tuple(cu_q_lens.shape)}, {tuple(kv_lens.shape)}, {tuple(block_tables.shape)}")
    if s == 0:
        return
    q_lens = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or bool((q_lens < 0).any()):
        raise ValueError(f"{op}: cu_q_lens must start at 0 and never decrease, got {cu.tolist()}")
    if int(cu[-1]) > num_tokens:
        raise ValueError(f"{op}: cu_q_lens[-1] = {int(cu[-1])} exceeds the {num_tokens} query rows of q")
    bad = torch.nonzero(q_lens > kv).flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"{op}: sequence {i} has q_len {int(q_lens[i])} > kv_len {int(kv[i])} (kv_lens "
                         "count every key including this step's new ones)")
    if max_kv_len is not None and int(kv.max()) > max_kv_len:
        raise ValueError(f"{op}: max_kv_len {max_kv_len} < longest kv_len {int(kv.max())}")
    need = (kv + block_size - 1) // block_size
    short = torch.nonzero(need > block_tables.shape[1]).flatten()
    if short.numel():
        i = int(short[0])
        raise ValueError(f"{op}: block table too short: sequence {i} has kv_len {int(kv[i])}, needing "
                         f"{int(need[i])} blocks of {block_size}; the table has {block_tables.shape[1]} "
                         "columns")
    tables = block_tables.detach().cpu().to(torch.int64)
    used = torch.arange(tables.shape[1])[None, :] < need[:, None]
    ids = tables[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"{op}: block tables reference block ids outside [0, {num_blocks}) "
                         f"(min {int(ids.min())}, max {int(ids.max())})")
