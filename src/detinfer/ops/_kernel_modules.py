"""`kernel_module(name)`: a detinfer.kernels module, imported on first use (choosing a backend must not
import Triton) and cached, because an import statement in a per-op method costs more than the rest of the
dispatch. Shared by ops/backend.py and ops/fp8_ops.py."""

from __future__ import annotations

import functools
import importlib


@functools.cache
def kernel_module(name: str):
    return importlib.import_module(f"detinfer.kernels.{name}")
