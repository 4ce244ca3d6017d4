"""Launch configurations of the batch-invariant matmul kernel, and the rule that picks one.

Why the choice may depend on M at all: the kernel's reduction order is fixed by the data, not by the
config. Every config walks K upward from k = 0 into ONE fp32 accumulator per output element, and the GPU's
matrix instructions consume K in fixed hardware steps (16 elements for bf16/fp16, 8 for tf32), each added
to that accumulator in turn. A tile's BLOCK_M/BLOCK_N only decide which outputs one program owns; BLOCK_K
only decides how many hardware steps one loop iteration issues. None of them regroups the additions, so
one output row gets the same bits under every config. That is a claim about the hardware, so it is
asserted bitwise on the GPU for every config in `GPU_CONFIGS` (tests/kernels/test_matmul.py, marker gpu,
and bench/matmul_gpu_check.py); a config that failed it must not be listed here.

Triton's CPU interpreter is different: it computes each `tl.dot` block with numpy and adds the block to the
accumulator, so there BLOCK_K *is* part of the reduction order. The interpreter therefore always uses one
fixed config per dtype (`INTERPRETER_CONFIG`), never chosen from M, N or K.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    # Row-tile grouping of the launch order (L2 reuse of B across neighbouring row tiles). Changes only
    # which program runs when, never what a program computes: free to vary.
    group_m: int = 8
    # Operands fetched by the TMA engine from descriptors (Hopper+, 16-bit, aligned operands; otherwise the
    # same tiles run with pointer loads). `persistent`: one program per SM walking tiles;
    # `warp_specialize`: producer/consumer warps. All three change how data moves, not the K order.
    tma: bool = False
    persistent: bool = False
    warp_specialize: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"MatmulConfig.{name} must be a power of two (>= 16 on a GPU), got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"MatmulConfig.num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps}")
        if self.num_stages < 1 or self.group_m < 1:
            raise ValueError("MatmulConfig.num_stages and group_m must be >= 1")


# Interpreter (CPU CI). BLOCK_M = 1 because the interpreter's `tl.dot` is numpy's matmul, i.e. BLAS,
# whose result for a row depends on the row's position inside a multi-row block (measured with OpenBLAS
# sgemm: 26 of 32 row placements differed); a one-row block is a vector-matrix product of fixed shape, the
# same for every row. BLOCK_K is a constant (see module doc); 32 so that test shapes (K up to ~600) cross
# many K blocks. BLOCK_N = 64 keeps the number of interpreted programs down.
INTERPRETER_CONFIG = MatmulConfig(block_m=1, block_n=64, block_k=32, num_warps=4, num_stages=1)

# GPU candidates, by the M range they are meant for (placeholders until the offline sweep in
# bench/matmul_gpu_check.py replaces them with measured winners). 16-bit dtypes.
_C = MatmulConfig
GPU_CONFIGS_16BIT = {
    "decode": _C(16, 64, 256, 4, 4, tma=True),
    "small": _C(64, 128, 128, 4, 4, tma=True),
    "medium": _C(128, 128, 64, 8, 4, tma=True),
    "large": _C(128, 256, 64, 8, 3, tma=True, persistent=True),
}
# fp32 runs IEEE fp32 FMA dots (no tf32): smaller tiles, the FMA path holds operands in registers.
GPU_CONFIGS_FP32 = {
    "decode": _C(16, 32, 64, 4, 3),
    "small": _C(32, 64, 32, 4, 3),
    "medium": _C(64, 64, 32, 4, 3),
    "large": _C(128, 128, 32, 8, 3),
}


def _m_class(m: int) -> str:
    if m <= 16:
        return "decode"
    if m <= 128:
        return "small"
    if m <= 1024:
        return "medium"
    return "large"


def gpu_configs(dtype: torch.dtype) -> tuple[MatmulConfig, ...]:
    """Every config the GPU dispatcher can select for `dtype` (what the GPU invariance tests sweep)."""
    table = GPU_CONFIGS_FP32 if dtype == torch.float32 else GPU_CONFIGS_16BIT
    picked = list(table.values())
    # A TMA config falls back to pointer loads with the same tiles when operands do not qualify (bmm,
    # unaligned or transposed operands): that twin is selectable too.
    twins = [replace(c, tma=False, persistent=False, warp_specialize=False) for c in picked if c.tma]
    return tuple(dict.fromkeys(picked + twins))


def select_config(m: int, n: int, k: int, dtype: torch.dtype, interpreter: bool) -> MatmulConfig:
    """The config for one launch. Any GPU choice is bit-identical to any other (module doc)."""
    if interpreter:
        return INTERPRETER_CONFIG
    table = GPU_CONFIGS_FP32 if dtype == torch.float32 else GPU_CONFIGS_16BIT
    return table[_m_class(m)]
