"""Launch configurations of the batch-invariant matmul kernel, and the rule that picks one.

Why the choice may depend on M at all: the kernel's reduction order is fixed by the data, not by the
config. Every config walks K upward from k = 0 into ONE fp32 accumulator per output element, and the GPU's
matrix instructions consume K in fixed hardware steps (16 elements for bf16/fp16), each added to that
accumulator in turn. A tile's BLOCK_M/BLOCK_N only decide which outputs one program owns; BLOCK_K only
decides how many hardware steps one loop iteration issues; TMA, persistence and warp specialization only
change how operands move. None of them regroups the additions, so an output row gets the same bits under
every config. That is a claim about the hardware, so it is asserted bitwise on the GPU for every config
`gpu_configs()` lists (tests/kernels/test_matmul.py, marker gpu) and for every candidate of the offline
sweep (measured on an H100: 42 bf16, 6 fp16 and 7 fp32 configs, BLOCK_K 32 to 512, all identical; see
docs/performance.md). A config that fails it must not be listed here.

Triton's CPU interpreter is different: it computes each `tl.dot` block with numpy and adds the block to the
accumulator, so there BLOCK_K *is* part of the reduction order. The interpreter therefore always uses one
fixed config, never chosen from M, N or K.

How a config is picked: the smallest M class that holds M gives a family; bandwidth-bound classes
(decode, small) take the largest tile that still yields ~0.7 tiles per SM; the compute-bound "batch"
class (M > 64) minimizes a wave estimate, ceil(tiles / SMs) x tile area / efficiency, where a config's
efficiency is its measured per-SM throughput relative to the 128x256 tile (WAVE_EFFICIENCY). That is how
a 128x128 tile wins when 128x256 tiles would leave part of the last wave idle (qkv at M = 1024: 192 big
tiles = 1.45 waves; 384 small ones = 2.9), and a 64-row tile wins when one of them per SM covers the
output (o at M = 256).

Offline tuning: the GPU tables below can be replaced, class by class, from a JSON file named by the
environment variable DETINFER_MATMUL_CONFIGS (`load_tables`; read at the first launch, cached per path, and
passed explicitly as a `MatmulTables`: the built-in tables below are never modified), e.g.
    {"16bit": {"batch": {"configs": [[128, 128, 64, 8, 4, "TPW"], [64, 64, 256, 4, 3]], "eff": [0.85, 0.33]}}}
(a config is [block_m, block_n, block_k, num_warps, num_stages, flags], flags from T = tma,
P = persistent, W = warp_specialize; "eff", optional, sets WAVE_EFFICIENCY of those configs; "max_m"
moves a class boundary). The choice stays a pure function of (M, N, dtype, table); any table is only as
safe as its GPU test run, which sweeps whatever table is active.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

import torch

ENV_OVERRIDE = "DETINFER_MATMUL_CONFIGS"


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
        if (self.persistent or self.warp_specialize) and not self.tma:
            raise ValueError("MatmulConfig: persistent / warp_specialize need tma=True (the descriptor kernel)")

    def spec(self) -> list:
        flags = "".join(f for f, on in (("T", self.tma), ("P", self.persistent), ("W", self.warp_specialize))
                        if on)
        return [self.block_m, self.block_n, self.block_k, self.num_warps, self.num_stages, flags]

    @staticmethod
    def from_spec(spec) -> MatmulConfig:
        if not isinstance(spec, (list, tuple)) or len(spec) not in (5, 6):
            raise ValueError(f"a matmul config spec is [block_m, block_n, block_k, num_warps, num_stages, "
                             f"flags], got {spec!r}")
        flags = spec[5] if len(spec) == 6 else ""
        if set(flags) - set("TPW"):
            raise ValueError(f"matmul config flags are letters of 'TPW', got {flags!r}")
        return MatmulConfig(*map(int, spec[:5]), tma="T" in flags, persistent="P" in flags,
                            warp_specialize="W" in flags)


# Interpreter (CPU CI). BLOCK_M = 1 because the interpreter's `tl.dot` is numpy's matmul, i.e. BLAS,
# whose result for a row depends on the row's position inside a multi-row block (measured with OpenBLAS
# sgemm: 26 of 32 row placements differed); a one-row block is a vector-matrix product of fixed shape, the
# same for every row. BLOCK_K is a constant (see module doc); 32 so that test shapes (K up to ~600) cross
# many K blocks. BLOCK_N = 64 keeps the number of interpreted programs down.
INTERPRETER_CONFIG = MatmulConfig(block_m=1, block_n=64, block_k=32, num_warps=4, num_stages=1)

# GPU tables: M classes in increasing order, each (max_m, family); `_RULES` names how a class picks from
# its family (default "tiles"). Measured on an H100 (docs/performance.md, linear runs 2 and 4).
_C = MatmulConfig
_TPW = {"tma": True, "persistent": True, "warp_specialize": True}
GPU_CONFIGS_16BIT: dict = {
    # decode: weight-bandwidth bound; 16-row tiles, 256-deep K steps, 64-wide N tiles (~96-160 KB of weights
    # in flight per program) where they give enough programs (qkv, gate_up, lm_head), 32-wide ones with a
    # 6-deep pipeline where they do not (N = 4096: o, down). Run 4 (CUDA graphs): 0.98-1.13x cuBLAS on the
    # five Llama shapes at M = 1-16. The 32-wide member, measured in the whole decode step (Qwen3-8B shapes,
    # batch 1, PDL on; docs/performance.md "Decode batch 1: PDL"): 6.06 -> 6.00 ms; with 4 stages 6.44,
    # 8 stages 6.02, 16x16 tiles 6.12-6.74, and 5 stages or TMA for the 64-wide tile slower.
    "decode": (16, (_C(16, 64, 256, 4, 4), _C(16, 32, 256, 4, 6))),
    # small batches: still bandwidth bound; the N tile narrows until there are enough programs for the SMs.
    # Run 4: 0.95-1.07x at M = 64. All three load through TMA: at M = 64 (Qwen3-8B shapes, graph timer) the
    # TMA kernel streamed the 64x64 / 64x32 tiles 4-8% faster than pointer loads (qkv 22.2 -> 21.3 us, o
    # 15.7 -> 14.8, down 40.9 -> 39.1; docs/performance.md, "Decode matmul configs").
    "small": (64, (_C(64, 128, 128, 4, 4, tma=True), _C(64, 64, 256, 4, 3, tma=True),
                   _C(64, 32, 256, 4, 4, tma=True))),
    # M > 64: compute bound, whole-K tiles, wave estimate (module doc). 128x256 TMA + persistent +
    # warp-specialized tiles for large outputs; 128x128 where 128x256 quantizes badly into waves; 64-row
    # tiles while few tiles cover the output (M <= ~256 with N <= ~6144). Run 4: M = 1024-4096 0.95-1.15x;
    # M = 256 0.77-0.93x (whole-K tiles cannot fill 132 SMs there; see docs/performance.md).
    "batch": (None, (_C(128, 256, 64, 8, 3, **_TPW), _C(128, 128, 64, 8, 4, **_TPW), _C(64, 128, 64, 4, 4, tma=True),
                     _C(64, 64, 256, 4, 3), _C(64, 32, 256, 4, 4))),
}
# fp32 runs IEEE fp32 FMA dots (no tf32, like torch's default): smaller tiles, operands live in registers.
# The 16x16 member is for narrow outputs, the MoE router's fp32 logits above all (N = 128 experts, K = 2048-
# 4096): the wider tiles gave it 2-4 programs, each walking all of K (a 30B-A3B decode step spent ~90 us per
# layer there on an H200, as much as its expert GEMMs); 16x16 tiles give 8 per 16 rows, 128-deep K steps
# halve the serial loop. The "tiles" rule picks it only where the wider tiles leave the SMs idle.
_FP32_NARROW = _C(16, 16, 128, 4, 3)
GPU_CONFIGS_FP32: dict = {
    "decode": (16, (_C(16, 64, 32, 4, 3), _FP32_NARROW)),
    "small": (64, (_C(32, 64, 32, 4, 3), _FP32_NARROW)),
    "mid": (768, (_C(64, 64, 32, 4, 3), _FP32_NARROW)),
    "large": (None, (_C(128, 128, 32, 8, 3),)),
}
_RULES = {"batch": "waves"}
# Per-SM throughput of a config relative to the 128x256 tile, for the wave estimate: time per tile-wave at
# K = 4096 over tile area, from run 4's single-wave cells (128x256: o M=1024 46.9 us; 128x128: o/qkv
# M=256-512 26-31 us; 64x128: o M=256 23.8 us; 64x64: o M=128 18.0 us; 64x32: o M=64 15.1 us). Configs
# not listed count as 1.0.
WAVE_EFFICIENCY: dict = {
    _C(128, 256, 64, 8, 3, **_TPW): 1.0,
    _C(128, 128, 64, 8, 4, **_TPW): 0.85,
    _C(64, 128, 64, 4, 4, tma=True): 0.46,
    _C(64, 64, 256, 4, 3): 0.33,
    _C(64, 32, 256, 4, 4): 0.19,
}
# fp32 outputs of 16-bit inputs (the row-parallel partials of kernels/chunked_linear.py; `matmul.fit_to_output`)
# stage the output tile through shared memory at 4 bytes per element: a 128x256 tile then needs 272 KB with
# its 3 load stages, over the 227 KB of an H100/H200 SM (Triton OutOfResources at prefill-sized M). Such
# launches cap the tile at 128x128 with 4 stages (196 KB), loaded through TMA descriptors: the pointer-load
# version of that tile ran at about half the speed of the 16-bit-output GEMMs (a TP=2 mixed step of 576 rows,
# H100: 5.5 ms in o_proj / down_proj against 4.9 ms for the twice-as-large qkv / gate_up;
# docs/performance.md). Plain TMA tiles (not persistent, not warp-specialized): the variant measured in the
# workload and tested; the warp-specialized one gave a similar mixed-step median on another machine (not
# compared side by side). Any config gives the same bits (module doc), so no bit moves.
WIDE_OUTPUT_CONFIG = _C(128, 128, 64, 8, 4, tma=True)
# A family member qualifies for the "tiles" rule when it yields at least this many tiles per SM: enough
# programs to keep every SM busy while streaming weights.
TILES_PER_SM = 0.7
_SM_COUNT = 132  # H100 SXM; only used when the device's count is not given


@dataclass(frozen=True)
class MatmulTables:
    """The tables `select_config` reads: {class: (max_m, family)} per dtype kind, and WAVE_EFFICIENCY."""

    configs_16bit: dict
    configs_fp32: dict
    efficiency: dict

    def for_dtype(self, dtype: torch.dtype) -> dict:
        return self.configs_fp32 if dtype == torch.float32 else self.configs_16bit


DEFAULT_TABLES = MatmulTables(GPU_CONFIGS_16BIT, GPU_CONFIGS_FP32, WAVE_EFFICIENCY)


def load_tables(path: str, base: MatmulTables = DEFAULT_TABLES) -> MatmulTables:
    """`base` with the classes a JSON file (module doc) replaces; `base` itself is left unchanged."""
    with open(path) as f:
        data = json.load(f)
    tables = {"16bit": dict(base.configs_16bit), "fp32": dict(base.configs_fp32)}
    efficiency = dict(base.efficiency)
    for key, table in tables.items():
        for cls, entry in data.get(key, {}).items():
            if cls not in table:
                raise ValueError(f"{ENV_OVERRIDE}: unknown class {key}/{cls}; classes are {list(table)}")
            max_m = entry.get("max_m", table[cls][0])
            configs = tuple(MatmulConfig.from_spec(s) for s in entry["configs"])
            if not configs:
                raise ValueError(f"{ENV_OVERRIDE}: class {key}/{cls} has no configs")
            eff = entry.get("eff")
            if eff is not None:
                if len(eff) != len(configs) or not all(float(e) > 0 for e in eff):
                    raise ValueError(f"{ENV_OVERRIDE}: class {key}/{cls}: 'eff' needs one positive number per "
                                     "config")
                efficiency.update(zip(configs, map(float, eff)))
            table[cls] = (max_m, configs)
    return MatmulTables(tables["16bit"], tables["fp32"], efficiency)


_LOADED: dict = {}


def active_tables() -> MatmulTables:
    """The tables the dispatcher uses: DEFAULT_TABLES, or those of the file DETINFER_MATMUL_CONFIGS names
    (loaded once per path)."""
    path = os.environ.get(ENV_OVERRIDE)
    if not path:
        return DEFAULT_TABLES
    if path not in _LOADED:
        _LOADED[path] = load_tables(path)
    return _LOADED[path]


def gpu_configs(dtype: torch.dtype, tables: MatmulTables | None = None) -> tuple[MatmulConfig, ...]:
    """Every config the GPU dispatcher can select for `dtype` (what the GPU invariance tests sweep)."""
    tables = active_tables() if tables is None else tables
    picked = [c for _, family in tables.for_dtype(dtype).values() for c in family]
    if dtype != torch.float32:
        picked.append(WIDE_OUTPUT_CONFIG)  # what an fp32-output launch of 16-bit inputs gets instead
    # A TMA config falls back to pointer loads with the same tiles when operands do not qualify (bmm,
    # unaligned or transposed operands): that twin is selectable too.
    twins = [replace(c, tma=False, persistent=False, warp_specialize=False) for c in picked if c.tma]
    return tuple(dict.fromkeys(picked + twins))


def select_config(m: int, n: int, k: int, dtype: torch.dtype, interpreter: bool,
                  sm_count: int = _SM_COUNT, tables: MatmulTables | None = None) -> MatmulConfig:
    """The config for one launch. Any GPU choice is bit-identical to any other (module doc), so this may
    look at M; `k` is accepted for future tables but unused (the reduction order never depends on it).
    tables: default `active_tables()`."""
    if interpreter:
        return INTERPRETER_CONFIG
    tables = active_tables() if tables is None else tables
    cls, (_, family) = next((c, e) for c, e in tables.for_dtype(dtype).items() if e[0] is None or m <= e[0])
    return pick_from_family(family, m, n, sm_count, rule=_RULES.get(cls, "tiles"), efficiency=tables.efficiency)


def _tiles(c: MatmulConfig, m: int, n: int) -> int:
    return -(-m // c.block_m) * -(-n // c.block_n)


def pick_from_family(family, m: int, n: int, sm_count: int = _SM_COUNT, rule: str = "tiles",
                     efficiency: dict | None = None) -> MatmulConfig:
    """rule "tiles": the largest tile area that still gives TILES_PER_SM tiles per SM, else the member with
    the most tiles. rule "waves": the member with the smallest ceil(tiles / SMs) x area / efficiency (ties:
    the larger tile)."""
    efficiency = WAVE_EFFICIENCY if efficiency is None else efficiency
    if rule == "waves":
        def estimate(c):
            area = c.block_m * c.block_n
            return -(-_tiles(c, m, n) // sm_count) * area / efficiency.get(c, 1.0), -area
        return min(family, key=estimate)
    if rule != "tiles":
        raise ValueError(f"unknown family rule {rule!r}")
    tiles = [_tiles(c, m, n) for c in family]
    ok = [c for c, t in zip(family, tiles) if t >= TILES_PER_SM * sm_count]
    if ok:
        return max(ok, key=lambda c: c.block_m * c.block_n)
    return family[max(range(len(family)), key=lambda i: tiles[i])]
