"""The drop-in batch-invariant mode: `torch.library` overrides of the aten ops that reduce.

    import detinfer
    with detinfer.batch_invariant():
        logits = model(**batch).logits        # any PyTorch / HF model, unmodified

While enabled, the ops in `AtenImpls.overrides()` run detinfer's batch-invariant implementations (Triton on CUDA,
fixed-order folds on CPU and for fp64) for the CPU and CUDA dispatch keys. In strict mode (the default) the
ops in `_REFUSED` — reductions we have no invariant implementation for — raise `NotBatchInvariantError`
instead of silently running a batch-variant stock kernel. Hugging Face's eager attention is routed through
the invariant SDPA (see `hf_attention`). Leaving the context (or `disable()`) destroys the registrations
and restores the HF functions; the mode changes no other global setting.

The overrides are process-wide (the dispatcher has no per-thread registration), so enable the mode around
whole forward passes, not from concurrent threads that expect stock behaviour.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from dataclasses import dataclass

import torch

from detinfer.ops import hf_attention
from detinfer.ops.aten_impls import CPU_OVERRIDES, AtenImpls, NotBatchInvariantError

# Reductions without an invariant implementation yet: strict mode refuses them rather than run stock.
_REFUSED = (
    "var.correction", "std.correction", "var_mean.correction", "std_mean.correction",
    "linalg_vector_norm", "native_layer_norm", "native_group_norm", "logsumexp", "prod", "prod.dim_int",
    "addbmm", "addmv", "_addmm_activation", "_scaled_mm", "convolution", "_embedding_bag",
    "mm.dtype", "bmm.dtype", "addmm.dtype", "baddbmm.dtype",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward", "_efficient_attention_forward",
)

_DISPATCH_KEYS = ("CPU", "CUDA")


@dataclass(frozen=True)
class ModeConfig:
    """strict: refuse (raise) on reductions with no invariant implementation instead of running stock.
    cpu_triton: run CPU tensors through the Triton kernels in Triton's interpreter (needs
    TRITON_INTERPRET=1; for testing the kernels through the mode) instead of the fold-based refs."""

    strict: bool = True
    cpu_triton: bool = False


class _ModeState:
    """The one active registration (process-wide, like the dispatcher itself)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.lib: torch.library.Library | None = None
        self.config: ModeConfig | None = None
        self.hf_saved: dict = {}


_STATE = _ModeState()


def _refuser(name: str):
    def refuse(*args, **kwargs):
        raise NotBatchInvariantError(
            f"batch_invariant mode (strict): aten::{name} has no batch-invariant implementation in detinfer; "
            "its result could depend on the batch. Avoid the op, or enable the mode with strict=False to "
            "run the stock kernel for it.")
    return refuse


def _op_exists(name: str) -> bool:
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base, None)
    return packet is not None and (overload or "default") in packet.overloads()


def enable(strict: bool = True, cpu_triton: bool = False) -> None:
    """Turn the mode on (idempotent if already on with the same settings)."""
    config = ModeConfig(strict=bool(strict), cpu_triton=bool(cpu_triton))
    with _STATE.lock:
        if _STATE.lib is not None:
            if _STATE.config != config:
                raise RuntimeError(f"batch_invariant mode is already enabled with {_STATE.config}; "
                                   f"disable() it before enabling with {config}")
            return
        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # "Overriding a previously registered kernel" is the point here
            warnings.simplefilter("ignore")
            # The implementations carry this activation's configuration (no module global is set).
            for name, fn in AtenImpls(cpu_triton=config.cpu_triton).overrides().items():
                for key in _DISPATCH_KEYS:
                    lib.impl(name, fn, key)
            for name, fn in CPU_OVERRIDES.items():
                lib.impl(name, fn, "CPU")
            if config.strict:
                for name in _REFUSED:
                    if _op_exists(name):
                        for key in _DISPATCH_KEYS:
                            lib.impl(name, _refuser(name), key)
        _STATE.hf_saved = hf_attention.patch_loaded_modules()
        _STATE.lib, _STATE.config = lib, config


def disable() -> None:
    """Turn the mode off and restore every stock kernel (no-op if it is off)."""
    with _STATE.lock:
        if _STATE.lib is not None:
            _STATE.lib._destroy()
        hf_attention.restore_modules(_STATE.hf_saved)
        _STATE.hf_saved = {}
        _STATE.lib, _STATE.config = None, None


def is_enabled() -> bool:
    return _STATE.lib is not None


@contextlib.contextmanager
def batch_invariant(strict: bool = True, cpu_triton: bool = False):
    """Context manager form of enable()/disable(). Nested use keeps the outer activation."""
    was_on = is_enabled()
    enable(strict=strict, cpu_triton=cpu_triton)
    try:
        yield
    finally:
        if not was_on:
            disable()


__all__ = ["ModeConfig", "NotBatchInvariantError", "batch_invariant", "disable", "enable", "is_enabled"]
