"""dtype names and the one rule that turns a dtype setting into a torch dtype.

Names are the spelling of HF's `torch_dtype` and of `EngineConfig.dtype`. The engine computes in the
first three (the kernels' dtypes); fp64 is accepted where a model is loaded as a reference.
"""

from __future__ import annotations

import torch

from detinfer.constants import DTYPE_NAMES

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
LOAD_DTYPES = {**DTYPES, "float64": torch.float64}


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def resolve_dtype(dtype: torch.dtype | str | None, checkpoint_dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> torch.dtype:
    """A dtype setting -> torch dtype.

    None: the checkpoint's dtype (fp32 if it names none). "auto": the checkpoint's dtype on CUDA (bf16 if
    it names none), fp32 on any other device (what the CPU kernels compute in). A name of LOAD_DTYPES or a
    torch dtype among them: itself.
    """
    if dtype is None:
        return checkpoint_dtype or torch.float32
    if isinstance(dtype, str):
        if dtype == "auto":
            if device is None or torch.device(device).type != "cuda":
                return torch.float32
            return checkpoint_dtype or torch.bfloat16
        if dtype not in LOAD_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(LOAD_DTYPES)}, got {dtype!r}")
        return LOAD_DTYPES[dtype]
    if dtype not in LOAD_DTYPES.values():
        raise ValueError(f"dtype must be one of {sorted(LOAD_DTYPES)}, got {dtype}")
    return dtype
