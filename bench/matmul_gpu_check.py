"""GPU landscape of the batch-invariant matmul: which launch configs give identical bits, and how fast
each one is against cuBLAS, on the Llama-3-8B linear shapes. Used offline to fill matmul_configs.py.

    PYTHONUNBUFFERED=1 python bench/matmul_gpu_check.py --out DIR [--budget-s 240] [--sections ...]

Sections (each stops early once the time budget is spent, and says so):
  ceilings  device-to-device copy bandwidth and a cuBLAS bf16 8192^3 product (the two roofs)
  bits      every candidate config against one reference config, bitwise, per dtype and shape;
            zero extension of K (contract B) for a few configs
  sweep     bf16 time of every candidate config per (shape, M) cell vs F.linear; best per cell
  fp32      IEEE vs tf32x3 dot for fp32 inputs: time, error vs fp64, bits across configs
  negctl    for which (shape, M) stock F.linear's row 0 changes bits (bf16)
  mid       mid-M (128/256/512) candidates; the family (1-2 configs, picked by the "waves" rule with
            unit efficiencies) with the best worst case is written as the 'batch' class of a
            DETINFER_MATMUL_CONFIGS table (--write-table PATH); run 3's tuning, superseded by `cells`
  tests     only compiles, in parallel, every variant the GPU tests will launch (saves test time)
  host      host time of one call (time.perf_counter over 1000 calls, no sync; tiny shapes so that the
            GPU never becomes the bottleneck): F.linear, linear(), the previous linear() if
            .devcarry/old_matmul.py exists, _run with a given config, the bare Triton launch
  cells     per (shape, M) cell of the bar: cuBLAS and the dispatcher under both timers (CUDA-graph
            replays and do_bench), and every CELL_CANDS candidate of that M class under graph replays
  cellbits  every CELL_CANDS candidate against one reference config, bitwise, on the five shapes
  splitk    EXPERIMENT (not used by the library): fixed-chunk split-K. Every path accumulates each CHUNK of
            K from zero and adds the chunk sums in order from 0.0; split-K runs one program per (tile,
            chunk) writing fp32 chunk sums, then a reduction adds them in chunk order. Checks split ==
            unsplit bitwise (any M, zero-extended K), times split-K at the mid-M cells and the unsplit
            chunked kernel (two accumulators) at large M against cuBLAS and the library's kernel
Writes DIR/landscape.json (all numbers) and prints a summary table last. `--smoke` runs every section on
tiny shapes in Triton's CPU interpreter (numbers meaningless; only checks that the script runs).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from detinfer.kernels import matmul as mm  # noqa: E402
from detinfer.kernels.matmul_configs import MatmulConfig as C  # noqa: E402
from detinfer.kernels.matmul_configs import gpu_configs, pick_from_family  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
          "lm_head": (4096, 128256)}  # (K, N)
MS = [1, 16, 64, 256, 1024, 8192]  # the bench adds 4 and 4096
T, P, WS = {"tma": True}, {"tma": True, "persistent": True}, {"tma": True, "persistent": True,
                                                                 "warp_specialize": True}
DECODE = [C(16, 16, 256, 2, 4), C(16, 32, 256, 4, 4), C(16, 64, 256, 4, 4), C(16, 32, 512, 4, 3),
          C(16, 64, 128, 4, 6), C(16, 128, 128, 4, 4), C(16, 32, 128, 4, 8), C(16, 16, 512, 4, 4),
          C(16, 64, 512, 4, 3), C(16, 32, 256, 4, 4, **T), C(16, 64, 256, 4, 4, **T), C(16, 64, 128, 4, 6, **T),
          C(16, 128, 128, 4, 4, **T), C(16, 128, 256, 4, 3, **T)]
SMALL = [C(64, 32, 256, 4, 4), C(64, 64, 128, 4, 4), C(64, 128, 64, 4, 4), C(64, 64, 256, 4, 3),
         C(128, 64, 128, 8, 4), C(64, 128, 128, 4, 4), C(32, 64, 256, 4, 4), C(64, 64, 128, 4, 4, **T),
         C(64, 128, 128, 4, 4, **T), C(64, 128, 64, 4, 5, **T), C(128, 64, 128, 4, 4, **T),
         C(128, 128, 64, 8, 4, **T), C(64, 256, 64, 4, 4, **T)]
LARGE = [C(128, 256, 64, 8, 3), C(128, 256, 64, 8, 4), C(128, 128, 64, 8, 4), C(256, 128, 64, 8, 3),
         C(128, 128, 128, 8, 3), C(128, 256, 64, 8, 3, **T), C(128, 256, 64, 8, 4, **T),
         C(128, 128, 64, 4, 4, **T), C(128, 128, 64, 8, 4, **T), C(256, 128, 64, 8, 3, **T),
         C(128, 256, 64, 8, 3, **P), C(128, 256, 64, 8, 4, **P), C(128, 128, 64, 8, 4, **P),
         C(128, 128, 64, 4, 4, **P), C(128, 128, 64, 4, 3, **WS), C(128, 256, 64, 8, 3, **WS)]
# Mid M (65..768): few whole-K tiles per SM; candidates trade tile efficiency against wave quantization
# (small tiles: many per SM; low shared memory: several programs resident per SM).
MID = [C(64, 64, 64, 4, 4, **P), C(64, 64, 64, 4, 3, **T), C(64, 64, 128, 4, 3, **P), C(64, 128, 64, 4, 4, **P),
       C(128, 64, 64, 4, 3, **T), C(128, 64, 64, 4, 4, **P), C(128, 128, 64, 4, 4, **T), C(128, 128, 64, 4, 4, **P),
       C(128, 128, 64, 8, 4, **P), C(128, 128, 64, 4, 3, **WS), C(64, 64, 64, 4, 4, **WS),
       C(128, 256, 64, 8, 3, **WS), C(64, 128, 128, 4, 4, **T), C(128, 64, 128, 4, 4, **T), C(64, 64, 256, 4, 3),
       C(64, 32, 256, 4, 4)]
MID_MS = [128, 256, 512]
ALL16 = DECODE + SMALL + LARGE
FP16_SUBSET = [DECODE[1], DECODE[9], SMALL[1], SMALL[8], LARGE[0], LARGE[10]]
FP32 = [C(16, 32, 32, 4, 3), C(16, 64, 32, 4, 3), C(32, 64, 32, 4, 3), C(64, 64, 32, 4, 3),
        C(64, 128, 32, 8, 3), C(128, 128, 32, 8, 3), C(32, 32, 64, 4, 3)]
DEV = "cpu" if SMOKE else "cuda"
FP32_MKN = (1024, 4096, 4096)
CONTRACT_B = {"bf16": [DECODE[0], DECODE[9], SMALL[1], LARGE[0], LARGE[10], LARGE[14]],
              "fp16": [FP16_SUBSET[0], FP16_SUBSET[1], FP16_SUBSET[-1]], "fp32": [FP32[0], FP32[-1]]}
BIAS = [DECODE[0], DECODE[9], LARGE[0], LARGE[10]]
if SMOKE:  # interpreter: tiny shapes, one-row tiles (the interpreter's multi-row dots are not invariant)
    SHAPES = {"qkv": (64, 96), "lm_head": (32, 200)}
    MS = [1, 20]
    DECODE = [C(1, 64, 32, 4, 1), C(1, 64, 32, 4, 1, **T)]
    SMALL, LARGE = [C(1, 32, 32, 4, 1, **P)], [C(1, 64, 64, 4, 1, **T)]
    ALL16 = DECODE + SMALL + LARGE
    FP16_SUBSET, FP32 = ALL16, [C(1, 64, 32, 4, 1)]
    FP32_MKN = (20, 64, 64)
    CONTRACT_B = {"bf16": ALL16, "fp16": ALL16, "fp32": FP32}
    BIAS = ALL16
    MID, MID_MS = [C(1, 64, 32, 4, 1), C(1, 32, 32, 4, 1, **T)], [20]
DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# Candidates per M class for the `cells` section (the bar's weak cells and their neighbours).
TW = {"tma": True, "persistent": True, "warp_specialize": True}
CELL_CANDS = {
    "decode": [C(16, 64, 256, 4, 4), C(16, 32, 256, 4, 4), C(16, 64, 128, 4, 6), C(16, 128, 128, 4, 4, **T)],
    "small": [C(64, 128, 128, 4, 4, **T), C(64, 64, 256, 4, 3), C(64, 32, 256, 4, 4), C(64, 64, 128, 4, 4, **T),
              C(64, 128, 64, 4, 4, **P), C(64, 256, 64, 4, 3, **T), C(64, 64, 64, 4, 4, **TW),
              C(64, 128, 64, 4, 4, **TW)],
    "mid": [C(128, 128, 64, 4, 3, **TW), C(64, 64, 256, 4, 3), C(128, 256, 64, 8, 3, **TW),
            C(128, 128, 64, 8, 3, **TW), C(128, 128, 64, 8, 4, **TW), C(128, 128, 64, 4, 4, **TW),
            C(128, 128, 64, 4, 4, **T), C(128, 128, 64, 8, 4, **T), C(128, 128, 64, 8, 4, **P),
            C(64, 128, 64, 4, 4, **T), C(128, 64, 64, 4, 4, **T), C(64, 128, 64, 4, 4, **TW),
            C(64, 256, 64, 4, 4, **T), C(128, 128, 128, 8, 3, **T), C(256, 128, 64, 8, 3, **TW),
            C(128, 256, 64, 8, 4, **TW), C(128, 64, 64, 4, 4, **TW)],
    "large": [C(128, 256, 64, 8, 3, **TW), C(128, 256, 64, 8, 4, **TW), C(256, 128, 64, 8, 3, **TW),
              C(128, 256, 64, 8, 3, **P), C(128, 128, 64, 8, 4, **TW), C(128, 128, 64, 8, 3, **TW),
              C(128, 256, 64, 8, 4, **T)],
}
CELLS = [(4, ("qkv", "o"), "decode"), (64, tuple(SHAPES), "small"), (256, tuple(SHAPES), "mid"),
         (1024, tuple(SHAPES), "mid"), (4096, ("qkv", "lm_head", "o"), "large"), (128, ("qkv", "o"), "mid"),
         (512, ("qkv", "o", "down"), "mid"), (2048, ("qkv", "o"), "mid")]
if SMOKE:
    CELL_CANDS = {cls: [C(1, 64, 32, 4, 1), C(1, 32, 32, 4, 1, **T)] for cls in CELL_CANDS}
    CELLS = [(4, ("qkv",), "decode"), (20, tuple(SHAPES), "mid")]

T0 = time.time()
RESULTS: dict = {}


def left(budget):
    return budget - (time.time() - T0)


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def run_cfg(x, w, cfg, bias=None):
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    mm._launch(x.unsqueeze(0), w.t().unsqueeze(0), bias, out.unsqueeze(0), cfg)
    return out


# --------------------------------------------------------------- split-K experiment kernels (section splitk)
import triton.language as tl  # noqa: E402

_tile_coords = mm._tile_coords
_store_tile = mm._store_tile


@triton.jit(do_not_specialize=["M"])
def _xk_partials(a_desc, w_desc, ws_ptr, M, N, K, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Program (tile, chunk): ws[chunk] = A[:, chunk] @ W[:, chunk]^T for one tile, from zero, in fp32."""
    chunks = tl.cdiv(K, CHUNK)
    pid = tl.program_id(0)
    c = pid % chunks
    pid_m, pid_n = _tile_coords(pid // chunks, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k0 = c * CHUNK
    for kb in range(0, CHUNK // BLOCK_K):
        a = a_desc.load([pid_m * BLOCK_M, k0 + kb * BLOCK_K])
        w = w_desc.load([pid_n * BLOCK_N, k0 + kb * BLOCK_K])
        acc = tl.dot(a, w.T, acc)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ptrs = ws_ptr + c.to(tl.int64) * M * N + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(ptrs, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit(do_not_specialize=["M"])
def _xk_reduce(ws_ptr, c_ptr, M, N, K, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """out = ((0 + ws[0]) + ws[1]) + ... in chunk order, then rounded to the output dtype."""
    chunks = tl.cdiv(K, CHUNK)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(0, chunks):
        total += tl.load(ws_ptr + c * M * N + offs, mask=mask, other=0.0)  # < 2**31 in this experiment
    tl.store(c_ptr + offs, total.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "num_programs"])
def _xk_chunked(a_desc, w_desc, c_ptr, M, N, K, stride_cm, num_programs, CHUNK: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """The unsplit kernel with the same arithmetic: per tile, chunk sums from zero added in order to a
    second fp32 accumulator (one flat K loop; the chunk boundary resets the inner accumulator)."""
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    steps = CHUNK // BLOCK_K
    k_steps = tl.cdiv(K, CHUNK) * steps
    for tile in tl.range(tl.program_id(0), num_tiles, num_programs, flatten=FLATTEN,
                         warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, k_steps):
            a = a_desc.load([pid_m * BLOCK_M, kb * BLOCK_K])
            w = w_desc.load([pid_n * BLOCK_N, kb * BLOCK_K])
            acc = tl.dot(a, w.T, acc)
            if (kb + 1) % steps == 0:
                total += acc
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        _store_tile(total, c_ptr, c_ptr, pid_m, pid_n, M, N, stride_cm, 1, False, BLOCK_M, BLOCK_N)


def xk_split(x, w, cfg, chunk, ws=None, out=None):
    """Split-K: tiles x chunks programs of fp32 chunk sums, then the in-order reduction."""
    from triton.tools.tensor_descriptor import TensorDescriptor as TD

    m, k = x.shape
    n = w.shape[0]
    chunks = -(-k // chunk)
    ws = torch.empty(chunks * m * n, device=x.device, dtype=torch.float32) if ws is None else ws
    out = torch.empty(m, n, device=x.device, dtype=x.dtype) if out is None else out
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    tiles = -(-m // bm) * -(-n // bn)
    a_desc, w_desc = TD(x, [m, k], [x.stride(0), 1], [bm, bk]), TD(w, [n, k], [w.stride(0), 1], [bn, bk])
    _xk_partials[(tiles * chunks,)](a_desc, w_desc, ws, m, n, k, CHUNK=chunk, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                    GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    block = 1024
    _xk_reduce[(-(-(m * n) // block),)](ws, out, m, n, k, CHUNK=chunk, BLOCK=block, num_warps=4)
    return out


def xk_chunked(x, w, cfg, chunk, out=None):
    from triton.tools.tensor_descriptor import TensorDescriptor as TD

    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype) if out is None else out
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    tiles = -(-m // bm) * -(-n // bn)
    progs = min(tiles, mm._num_sms(x.device)) if cfg.persistent else tiles
    _xk_chunked[(progs,)](TD(x, [m, k], [x.stride(0), 1], [bm, bk]), TD(w, [n, k], [w.stride(0), 1], [bn, bk]),
                          out, m, n, k, out.stride(0), progs, CHUNK=chunk, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                          GROUP_M=cfg.group_m, FLATTEN=cfg.persistent, WARP_SPECIALIZE=cfg.warp_specialize,
                          num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


XK_SPLIT = [(C(128, 256, 64, 8, 3), 1024), (C(128, 256, 64, 8, 3), 2048), (C(128, 128, 64, 8, 4), 1024),
            (C(128, 128, 64, 8, 4), 2048), (C(64, 128, 64, 4, 4), 1024)]
XK_CHUNKED = [(C(128, 128, 64, 8, 4, **TW), 1024), (C(128, 128, 64, 8, 4, **P), 1024),
              (C(128, 256, 64, 8, 3, **P), 1024), (C(128, 256, 64, 8, 3, **TW), 1024)]
XK_CELLS = [("o", 256), ("qkv", 256), ("down", 256), ("gate_up", 256), ("qkv", 128), ("o", 512)]
XK_LARGE = [("qkv", 4096), ("o", 4096), ("gate_up", 1024), ("down", 1024)]
if SMOKE:
    XK_SPLIT = [(C(1, 32, 32, 4, 1), 64), (C(2, 32, 32, 4, 1), 96)]
    XK_CHUNKED = [(C(1, 32, 32, 4, 1, **P), 64), (C(2, 32, 32, 4, 1, **P), 96)]
    XK_CELLS, XK_LARGE = [("qkv", 20)], [("lm_head", 20)]


def _xk_warm(spec):
    """Compile one experiment kernel variant (prewarm pool)."""
    kind, cfg, chunk = spec[1], cfg_from_t(spec[2]), spec[3]
    x = torch.randn(2, 4096, device=DEV).bfloat16()
    w = torch.randn(64, 4096, device=DEV).bfloat16()
    (xk_split if kind == "split" else xk_chunked)(x, w, cfg, chunk)


# ------------------------------------------------------------------ parallel compile into the disk cache
def _warm_one(job):
    """Compile one (config, dtype, K/N divisibility class, bias) variant into Triton's disk cache."""
    try:
        if job[0] == "xk":
            _xk_warm(job)
            torch.cuda.synchronize()
            return job, "ok"
        cfg, dname, k, n, has_bias = job
        dt = DT[dname]
        x = torch.randn(2, k, device=DEV).to(dt)
        w = torch.randn(n, k, device=DEV).to(dt)
        b = torch.randn(n, device=DEV).to(dt) if has_bias else None
        run_cfg(x, w, cfg_from_t(cfg), b)
        torch.cuda.synchronize()
        return job, "ok"
    except Exception as e:  # OutOfResources (shared memory) and compile errors are data here
        return job, f"{type(e).__name__}: {str(e)[:200]}"


def job(c, dname, even_k=True, has_bias=False, n=64):
    # K = 1024: same divisibility class as the real K (4096, 14336); 1040: masked K tail (4096 + 48)
    return (cfg_t(c), dname, 1024 if even_k else 1040, n, has_bias)


def prewarm(jobs, procs=14):
    """Compile in parallel processes (one compile takes seconds; dozens are needed per run)."""
    if SMOKE:
        return set()
    ctx = mp.get_context("spawn")
    with ctx.Pool(procs) as pool:
        res = pool.map(_warm_one, jobs, chunksize=1)
    broken = set()
    for j, r in res:
        if r != "ok":
            log("compile failed:", j, r)
            broken.add((j[0], j[1]))
    return broken


def bench(fn, warmup, rep, return_mode):
    """Median time in ms (triton's do_bench: CUDA events, L2 flushed before each run)."""
    if SMOKE:
        t = time.time()
        fn()
        return (time.time() - t) * 1e3
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode=return_mode)


def cfg_t(c):
    flags = "".join(f for f, on in (("T", c.tma), ("P", c.persistent), ("W", c.warp_specialize)) if on)
    return (c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages) + ((flags,) if flags else ())


def cfg_from_t(t):
    flags = t[5] if len(t) > 5 else ""
    return C(*t[:5], tma="T" in flags, persistent="P" in flags, warp_specialize="W" in flags)


# ------------------------------------------------------------------------------------------ sections
def ceilings():
    n = 1 << 29  # 1 GiB of bf16
    src = torch.randn(n, device=DEV).bfloat16()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), warmup=20, rep=100, return_mode="median")
    a = torch.randn(8192, 8192, device=DEV).bfloat16()
    b = torch.randn(8192, 8192, device=DEV).bfloat16()
    ms2 = bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    RESULTS["ceilings"] = {"copy_TBps": 2 * n * 2 / ms / 1e9, "cublas_bf16_TFLOPs": 2 * 8192**3 / ms2 / 1e9}
    log("ceilings", RESULTS["ceilings"])


def bits(budget, broken):
    out = RESULTS.setdefault("bits", {})
    for dname, cands in (("bf16", ALL16), ("fp16", FP16_SUBSET), ("fp32", FP32)):
        dt = DT[dname]
        for shape, (k, n) in SHAPES.items():
            if left(budget) < 20:
                log("bits: budget spent, stopping at", dname, shape)
                return
            g = torch.Generator(device=DEV).manual_seed(k + n)
            x = torch.randn(4096, k, device=DEV, generator=g).to(dt)
            w = (torch.randn(n, k, device=DEV, generator=g) / k**0.5).to(dt)
            ok_c = [c for c in cands if (cfg_t(c), dname) not in broken]
            ref = run_cfg(x[:300], w, ok_c[0])
            row = {}
            for c in ok_c:
                ms_ = (1, 7, 16, 64, 300) + ((4096,) if c.block_m >= 64 else ())
                failed = [m for m in ms_ if not torch.equal(run_cfg(x[:m], w, c)[:300], ref[:m])]
                if not torch.equal(run_cfg(x[100:133], w, c), ref[100:133]):
                    failed.append("rows100:133")
                if failed:
                    y = run_cfg(x[:300], w, c)
                    row[str(cfg_t(c))] = f"DIFF at M={failed}; {int((y != ref).sum())} of {y.numel()} at M=300"
                else:
                    row[str(cfg_t(c))] = True
            bad = {c: v for c, v in row.items() if v is not True}
            log(f"bits {dname} {shape}: {len(row) - len(bad)}/{len(row)} configs identical", bad or "")
            out[f"{dname}/{shape}"] = row
        # contract B on one shape (masked-K path of the pointer kernel, out-of-bounds zeros of TMA)
        k, n = SHAPES["qkv"]
        x = torch.randn(64, k, device=DEV).to(dt)
        w = (torch.randn(n, k, device=DEV) / 64).to(dt)
        ref = run_cfg(x, w, cands[0])
        xp = torch.cat([x, torch.zeros(64, 48, device=DEV, dtype=dt)], 1)
        wp = torch.cat([w, torch.zeros(n, 48, device=DEV, dtype=dt)], 1)
        res = {str(cfg_t(c)): torch.equal(run_cfg(xp, wp, c), ref) for c in CONTRACT_B[dname]
               if (cfg_t(c), dname) not in broken}
        log(f"contract B {dname}:", res)
        out[f"{dname}/contractB"] = res
    # bias path: identical across configs
    k, n = SHAPES["qkv"]
    x = torch.randn(300, k, device=DEV).bfloat16()
    w = (torch.randn(n, k, device=DEV) / 64).bfloat16()
    b = torch.randn(n, device=DEV).bfloat16()
    ref = run_cfg(x, w, BIAS[0], b)
    res = {str(cfg_t(c)): torch.equal(run_cfg(x[:m], w, c, b), ref[:m]) for c in BIAS for m in (1, 300)}
    log("bias bf16:", res)
    out["bf16/bias"] = res


def sweep(budget, broken):
    out = RESULTS.setdefault("sweep", {})
    for m in MS:
        cands = DECODE if m <= 16 else (SMALL + DECODE[1:3] if m <= 64 else (
            SMALL + LARGE[:3] + LARGE[5:9] if m <= 256 else LARGE))
        for shape, (k, n) in SHAPES.items():
            if left(budget) < 15:
                log("sweep: budget spent at", shape, m)
                return
            x = torch.randn(m, k, device=DEV).bfloat16()
            w = (torch.randn(n, k, device=DEV) / 64).bfloat16()
            rep = 30 if m <= 256 else 60
            out3 = torch.empty(1, m, n, device=DEV, dtype=torch.bfloat16)
            t_cub = bench(lambda x=x, w=w: F.linear(x, w), warmup=10, rep=rep, return_mode="median")
            cell = {"cublas_us": t_cub * 1e3}
            for c in cands:
                if (cfg_t(c), "bf16") in broken:
                    continue
                fn = lambda c=c, x=x, w=w, o=out3: mm._launch(x.unsqueeze(0), w.t().unsqueeze(0), None, o, c)
                cell[str(cfg_t(c))] = bench(fn, warmup=10, rep=rep,
                                                              return_mode="median") * 1e3
            best = min((v, c) for c, v in cell.items() if c != "cublas_us")
            cell["best"] = best[1]
            out[f"{shape}/M{m}"] = cell
            wb = n * k * 2
            log(f"sweep {shape:8s} M={m:5d} cublas {t_cub * 1e3:9.1f}us best {best[0]:9.1f}us {best[1]} "
                f"ratio {t_cub * 1e3 / best[0]:.3f} wBW {wb / best[0] / 1e6 / 3.0:.2f}")


def fp32_precision(budget, broken):
    out = RESULTS.setdefault("fp32", {})
    m, k, n = FP32_MKN
    g = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(m, k, device=DEV, generator=g)
    w = torch.randn(n, k, device=DEV, generator=g)
    ref = (x.double() @ w.double().t())
    t_cub = bench(lambda: F.linear(x, w), warmup=10, rep=60, return_mode="median")
    out["cublas_us"] = t_cub * 1e3
    for prec in ("ieee",):
        mm.FP32_DOT_PRECISION = prec
        row = {}
        y0 = None
        for c in FP32:
            if (cfg_t(c), "fp32") in broken or left(budget) < 10:
                continue
            y = run_cfg(x, w, c)
            err = ((y.double() - ref).norm() / ref.norm()).item()
            y0 = y if y0 is None else y0
            t = bench(lambda c=c: run_cfg(x, w, c), warmup=10, rep=60, return_mode="median")
            row[str(cfg_t(c))] = {"us": t * 1e3, "rel_err": err, "same_bits": torch.equal(y, y0),
                                  "row_slice_same": torch.equal(run_cfg(x[3:9], w, c), y[3:9])}
        out[prec] = row
        log(f"fp32 {prec} (cuBLAS {t_cub * 1e3:.1f}us):", row)
    mm.FP32_DOT_PRECISION = "ieee"


# --------------------------------------------------------------------- mid-M tuning (writes a table)
def mid(budget, broken, table_path):
    """Time every MID candidate at M in MID_MS on all shapes; the one with the best worst-case ratio
    becomes the 'batch' class of the table written to table_path (DETINFER_MATMUL_CONFIGS format)."""
    out = RESULTS.setdefault("mid", {})
    cands = [c for c in MID if (cfg_t(c), "bf16") not in broken]
    for m in MID_MS:
        for shape, (k, n) in SHAPES.items():
            if left(budget) < 5:
                log("mid: budget spent at", shape, m)
                break
            x = torch.randn(m, k, device=DEV).bfloat16()
            w = (torch.randn(n, k, device=DEV) / 64).bfloat16()
            o3 = torch.empty(1, m, n, device=DEV, dtype=torch.bfloat16)
            t_cub = bench(lambda x=x, w=w: F.linear(x, w), warmup=10, rep=30, return_mode="median")
            cell = {"cublas_us": t_cub * 1e3}
            for c in cands:
                fn = lambda c=c, x=x, w=w, o=o3: mm._launch(x.unsqueeze(0), w.t().unsqueeze(0), None, o, c)
                t = bench(fn, warmup=10, rep=30, return_mode="median")
                cell[str(cfg_t(c))] = t * 1e3
            out[f"{shape}/M{m}"] = cell
            best = max((t_cub * 1e3 / v, c) for c, v in cell.items() if c != "cublas_us")
            log(f"mid {shape:8s} M={m:4d} cublas {t_cub * 1e3:8.1f}us best ratio {best[0]:.3f} {best[1]}")
    # Families of one or two candidates, each cell served by the member the dispatcher's own rule would
    # pick (pick_from_family): the family with the best worst-case ratio wins.
    cells = [(int(key.split("/M")[1]), SHAPES[key.split("/M")[0]][1], cell) for key, cell in out.items()]
    ok = [c for c in cands if all(str(cfg_t(c)) in cell for _, _, cell in cells)]
    fams = [(c,) for c in ok] + [(a, b) for i, a in enumerate(ok) for b in ok[i + 1:]]
    scored = []
    for fam in fams:
        r = [cell["cublas_us"] / cell[str(cfg_t(pick_from_family(fam, m, n, rule="waves")))] for m, n, cell in cells]
        scored.append((min(r), sum(r) / len(r), -len(fam), fam))
    scored.sort(key=lambda t: t[:3], reverse=True)
    for worst, mean, _, fam in scored[:6]:
        log(f"mid family {[cfg_t(c) for c in fam]}: worst {worst:.3f} mean {mean:.3f}")
    winner = scored[0][3]
    table = {"16bit": {"batch": {"configs": [c.spec() for c in winner]}}}
    RESULTS["mid_table"] = table
    if table_path:
        with open(table_path, "w") as f:
            json.dump(table, f)
        log("wrote", table_path, table)


# ------------------------------------------------------------------------- host cost and weak cells
def _timers():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_ops  # noqa: E402  (same folder: the bench's graph timer and input rotation)

    return bench_ops


def _per_call_us(fn, n=3 if SMOKE else 1000):
    """(host us per call with no sync in the loop, us per call including the final sync)."""
    for _ in range(1 if SMOKE else 50):
        fn()
    if not SMOKE:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    if not SMOKE:
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    return round((t1 - t0) / n * 1e6, 2), round((t2 - t0) / n * 1e6, 2)


def _host_case(m, k, n, old):
    x = torch.randn(m, k, device=DEV).to(torch.float16 if SMOKE else torch.bfloat16)
    w = torch.randn(n, k, device=DEV).to(x.dtype)
    o3 = torch.empty(1, m, n, device=DEV, dtype=x.dtype)
    cfg = mm._config(m, n, k, x.dtype, x.device)
    row = {"config": str(cfg_t(cfg)), "F.linear": _per_call_us(lambda: F.linear(x, w)),
           "linear": _per_call_us(lambda: mm.linear(x, w))}
    if old is not None:
        row["previous linear"] = _per_call_us(lambda: old.linear(x, w))
    row["_run(cfg)"] = _per_call_us(lambda: mm._run(x, (0, k, 1), w, (0, 1, k), o3, (0, n, 1), None, 1, m, n, k,
                                                    cfg))
    row["torch.empty"] = _per_call_us(lambda: torch.empty(m, n, device=DEV, dtype=x.dtype))
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    meta = dict(HAS_BIAS=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)
    if cfg.tma and mm._tma_usable(x, w):
        from triton.tools.tensor_descriptor import TensorDescriptor as TD

        row["2 descriptors"] = _per_call_us(lambda: (TD(x, [m, k], [k, 1], [bm, bk]), TD(w, [n, k], [k, 1], [bn, bk])))
        ad, wd = TD(x, [m, k], [k, 1], [bm, bk]), TD(w, [n, k], [k, 1], [bn, bk])
        progs = min(-(-m // bm) * -(-n // bn), mm._num_sms(x.device))
        row["bare triton launch"] = _per_call_us(lambda: mm._matmul_tma_kernel[(progs,)](
            ad, wd, o3, o3, m, n, k, n, 1, progs, FLATTEN=cfg.persistent, WARP_SPECIALIZE=cfg.warp_specialize,
            **meta))
    else:
        grid = (-(-m // bm) * -(-n // bn), 1)
        row["bare triton launch"] = _per_call_us(lambda: mm._matmul_kernel[grid](
            x, w, o3, o3, m, n, k, 0, k, 1, 0, 1, k, 0, n, 1, EVEN_K=k % bk == 0, PRECISION="tf32", **meta))
    return row


def host(budget):
    """Host time per call, no sync inside the timed loop; tiny shapes keep the GPU ahead of the host."""
    import importlib.util

    out = RESULTS.setdefault("host", {})
    old = None
    old_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".devcarry", "old_matmul.py")
    if os.path.exists(old_path):
        spec = importlib.util.spec_from_file_location("old_matmul", old_path)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    # (M, K, N): the first picks the decode pointer config, the second a 128x256 TMA config (run 5 used
    # N = 512 there, which the wave rule now serves with a 64-row pointer config: no TMA row in run 5)
    cases = {"decode cfg (pointer kernel)": (1, 256, 512), "large cfg (TMA kernel)": (1024, 256, 4096)}
    for label, (m, k, n) in ({"smoke": (2, 32, 64)} if SMOKE else cases).items():
        if left(budget) < 5:
            return
        out[label] = _host_case(m, k, n, old)
        log(f"host us per call (no sync, with sync) {label}:", out[label])
    # where the host time of one linear() goes (TMA path): cProfile of 300 calls, top entries by own time
    import cProfile
    import io
    import pstats

    m, k, n = (2, 32, 64) if SMOKE else cases["large cfg (TMA kernel)"]
    x = torch.randn(m, k, device=DEV).to(torch.float16 if SMOKE else torch.bfloat16)
    w = torch.randn(n, k, device=DEV).to(x.dtype)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3 if SMOKE else 300):
        mm.linear(x, w)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
    out["profile linear (TMA path), 300 calls"] = buf.getvalue()
    log("host profile (linear, TMA path, 300 calls):\n" + buf.getvalue()[-3500:])


def cells(budget, broken):
    """Weak cells of the bar: cuBLAS and the dispatcher under both timers; candidates under graphs."""
    bo = _timers()
    out = RESULTS.setdefault("cells", {})
    gms = (lambda fn: bench(fn, 5, 10, "median")) if SMOKE else (lambda fn: bo.graph_ms(fn, rep_ms=8, replays=5))
    ems = (lambda fn: bench(fn, 5, 10, "median")) if SMOKE else bo.eager_ms
    for m, shapes, cls in CELLS:
        for shape in shapes:
            if left(budget) < 10:
                log("cells: budget spent at", shape, m)
                return
            k, n = SHAPES[shape]
            nw = 1 if SMOKE else bo.copies_for(n * k * 2 + m * k * 2)
            sets = [((torch.randn(m, k, device=DEV) * 0.5).to(DT["fp16" if SMOKE else "bf16"]),
                     (torch.randn(n, k, device=DEV) / k**0.5).to(DT["fp16" if SMOKE else "bf16"]))
                    for _ in range(nw)]
            o3 = torch.empty(1, m, n, device=DEV, dtype=sets[0][0].dtype)
            cub, ours = bo.rotated(F.linear, sets), bo.rotated(mm.linear, sets)
            cell = {"dispatch": str(cfg_t(mm._config(m, n, k, sets[0][0].dtype, sets[0][0].device))),
                    "cublas_graph_us": gms(cub) * 1e3, "ours_graph_us": gms(ours) * 1e3,
                    "cublas_eager_us": ems(cub) * 1e3, "ours_eager_us": ems(ours) * 1e3}
            for c in CELL_CANDS[cls]:
                if (cfg_t(c), "bf16") in broken or left(budget) < 10:
                    continue
                fn = bo.rotated(lambda x, w, c=c, o=o3: mm._launch(x.unsqueeze(0), w.t().unsqueeze(0), None, o, c),
                                sets)
                cell[str(cfg_t(c))] = gms(fn) * 1e3
            out[f"{shape}/M{m}"] = cell
            cands = {c: v for c, v in cell.items() if c.startswith("(")}
            best = min(cands, key=cands.get) if cands else "-"
            cg, og, ce, oe = (cell[f"{w}_{t}_us"] for t in ("graph", "eager") for w in ("cublas", "ours"))
            log(f"cell {shape:8s} M={m:5d} graph: cuBLAS {cg:8.1f} ours {og:8.1f} ({cg / og:.3f}) | eager: cuBLAS "
                f"{ce:8.1f} ours {oe:8.1f} ({ce / oe:.3f}) | best {best} {cands.get(best, float('nan')):.1f} "
                f"({cg / cands.get(best, 1e9):.3f})")
            del sets, o3


def cellbits(budget, broken):
    out = RESULTS.setdefault("cellbits", {})
    cands = list(dict.fromkeys(c for cl in CELL_CANDS.values() for c in cl))
    dt = torch.float16 if SMOKE else torch.bfloat16
    for shape, (k, n) in SHAPES.items():
        if left(budget) < 5:
            log("cellbits: budget spent at", shape)
            return
        g = torch.Generator(device=DEV).manual_seed(k + n + 1)
        x = torch.randn(300, k, device=DEV, generator=g).to(dt)
        w = (torch.randn(n, k, device=DEV, generator=g) / k**0.5).to(dt)
        ref = run_cfg(x, w, cands[0])
        bad = {}
        for c in cands:
            if (cfg_t(c), "bf16") in broken:
                continue
            fails = [m for m in (1, 7, 64, 300) if not torch.equal(run_cfg(x[:m], w, c), ref[:m])]
            if not torch.equal(run_cfg(x[100:133], w, c), ref[100:133]):
                fails.append("rows100:133")
            if fails:
                bad[str(cfg_t(c))] = fails
        out[shape] = {"checked": len(cands), "differ": bad}
        log(f"cellbits {shape}: {len(cands) - len(bad)}/{len(cands)} identical", bad or "")


def splitk(budget):
    """Fixed-chunk split-K experiment: bits (split == unsplit chunked, any rows, zero-extended K), then times."""
    bo = None if SMOKE else _timers()
    gms = (lambda fn: bench(fn, 5, 10, "median")) if SMOKE else (lambda fn: bo.graph_ms(fn, rep_ms=8, replays=5))
    out = RESULTS.setdefault("splitk", {})
    dt = torch.float16 if SMOKE else torch.bfloat16
    # bits: every split variant and every chunked variant of one CHUNK against one reference, per shape
    for shape in ("o", "down") if not SMOKE else ("qkv",):
        k, n = SHAPES[shape]
        g = torch.Generator(device=DEV).manual_seed(k + n + 2)
        x = torch.randn(300, k, device=DEV, generator=g).to(dt)
        w = (torch.randn(n, k, device=DEV, generator=g) / k**0.5).to(dt)
        for chunk in sorted({c for _, c in XK_SPLIT + XK_CHUNKED}):
            try:
                ref = xk_chunked(x, w, next(c for c, ch in XK_CHUNKED if ch == chunk) if any(
                    ch == chunk for _, ch in XK_CHUNKED) else C(128, 128, 64, 8, 4, **P), chunk)
                res = {}
                pad = 48
                xp = torch.cat([x, torch.zeros(300, pad, device=DEV, dtype=dt)], 1)
                wp = torch.cat([w, torch.zeros(n, pad, device=DEV, dtype=dt)], 1)
                for cfg, ch in [v for v in XK_SPLIT + XK_CHUNKED if v[1] == chunk]:
                    f = xk_split if (cfg, ch) in XK_SPLIT else xk_chunked
                    fails = [m for m in (1, 7, 256, 300) if not torch.equal(f(x[:m], w, cfg, ch), ref[:m])]
                    if not torch.equal(f(x[100:133].contiguous(), w, cfg, ch), ref[100:133]):
                        fails.append("rows100:133")
                    if not torch.equal(f(xp, wp, cfg, ch), ref):
                        fails.append("K+48 zeros")
                    res[f"{'split' if f is xk_split else 'chunked'} {cfg_t(cfg)}"] = fails or True
                y64 = (x.double() @ w.double().t())
                rel = ((ref.double() - y64).norm() / y64.norm()).item()
                out[f"bits/{shape}/chunk{chunk}"] = {"rel_err_vs_fp64": rel, **{k_: v for k_, v in res.items()}}
                log(f"splitk bits {shape} chunk {chunk}: rel err {rel:.2e}", res)
            except Exception as e:  # an experiment: a failed compile is a result
                out[f"bits/{shape}/chunk{chunk}"] = f"{type(e).__name__}: {str(e)[:300]}"
                log(f"splitk bits {shape} chunk {chunk} FAILED: {type(e).__name__}: {str(e)[:300]}")
    # times: split-K at mid M, chunked unsplit at large M; cuBLAS and the library kernel alongside
    for cells_, variants, f in ((XK_CELLS, XK_SPLIT, xk_split), (XK_LARGE, XK_CHUNKED, xk_chunked)):
        for shape, m in cells_:
            if left(budget) < 8:
                log("splitk: budget spent at", shape, m)
                return
            kind = "split" if f is xk_split else "chunked"
            cell = _xk_cell(shape, m, variants, f, gms, dt, bo)
            out[f"{kind}/{shape}/M{m}"] = cell
            cub = cell["cublas_us"]
            log(f"splitk {kind:7s} {shape:8s} M={m:5d} cuBLAS {cub:8.1f} library {cell['library_us']:8.1f} "
                f"({cub / cell['library_us']:.3f}) | " + " ".join(
                    f"{key}: {v:.1f} ({cub / v:.3f})" if isinstance(v, float) else f"{key}: {v[:80]}"
                    for key, v in cell.items() if "chunk" in key))


def _xk_cell(shape, m, variants, f, gms, dt, bo):
    k, n = SHAPES[shape]
    nw = 1 if SMOKE else bo.copies_for(n * k * 2)
    sets = [((torch.randn(m, k, device=DEV) * 0.5).to(dt), (torch.randn(n, k, device=DEV) / k**0.5).to(dt))
            for _ in range(nw)]
    o = torch.empty(m, n, device=DEV, dtype=dt)
    ws = torch.empty(max(-(-k // ch) for _, ch in variants) * m * n, device=DEV, dtype=torch.float32)

    def rot(fn):
        return (lambda: fn(*sets[0])) if SMOKE else bo.rotated(fn, sets)

    cell = {"cublas_us": gms(rot(F.linear)) * 1e3, "library_us": gms(rot(mm.linear)) * 1e3}
    for cfg, ch in variants:
        key = f"{cfg_t(cfg)} chunk {ch}"
        try:
            if f is xk_split:
                cell[key] = gms(rot(lambda x, w, cfg=cfg, ch=ch: xk_split(x, w, cfg, ch, ws, o))) * 1e3
            else:
                cell[key] = gms(rot(lambda x, w, cfg=cfg, ch=ch: xk_chunked(x, w, cfg, ch, o))) * 1e3
        except Exception as e:  # an experiment: a failed compile is a result
            cell[key] = f"{type(e).__name__}: {str(e)[:200]}"
    return cell


# ------------------------------------------------------------- negative control: where does cuBLAS vary?
def negctl(budget):
    out = RESULTS.setdefault("negctl", {})
    ms_ = [1, 2, 9] if SMOKE else list(range(1, 17)) + [31, 64, 128, 257, 1024, 4096]
    for shape in SHAPES:
        if left(budget) < 5:
            return
        k, n = SHAPES[shape]
        g = torch.Generator(device=DEV).manual_seed(11)
        x = torch.randn(max(ms_), k, device=DEV, generator=g).bfloat16()
        w = (torch.randn(n, k, device=DEV, generator=g) / 64).bfloat16()
        row0 = F.linear(x[:1], w)
        out[shape] = [m for m in ms_ if not torch.equal(F.linear(x[:m], w)[:1], row0)]
        log(f"negctl bf16 {shape}: F.linear row 0 differs from M=1 at M in {out[shape]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=240)
    ap.add_argument("--sections", default="ceilings,negctl,bits,sweep,fp32")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--write-table", default=None, help="mid section: write the tuned table JSON here")
    args = ap.parse_args()
    # `timeout` sends SIGTERM: exit through the finally blocks, so the JSON written so far is kept
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    secs = args.sections.split(",")
    gpu = "interpreter (smoke)" if SMOKE else torch.cuda.get_device_name()
    log("torch", torch.__version__, "triton", triton.__version__, gpu)
    RESULTS["env"] = {"torch": torch.__version__, "triton": triton.__version__, "gpu": gpu}
    jobs = []
    if "bits" in secs or "sweep" in secs:
        jobs += [job(c, "bf16", has_bias=True) for c in BIAS] + [job(c, "bf16") for c in ALL16]
        jobs += [job(c, "fp16") for c in FP16_SUBSET] + [job(c, "fp32") for c in FP32]
        jobs += [job(c, dn, even_k=False) for dn, cands in CONTRACT_B.items() for c in cands]
    if "mid" in secs:
        jobs += [job(c, "bf16") for c in MID]
    if "cells" in secs or "cellbits" in secs:
        jobs += [job(c, "bf16") for cl in CELL_CANDS.values() for c in cl]
    if "splitk" in secs:
        jobs += [("xk", "split", cfg_t(c), ch) for c, ch in XK_SPLIT]
        jobs += [("xk", "chunked", cfg_t(c), ch) for c, ch in XK_CHUNKED]
    if "tests" in secs:  # the variants the GPU tests will launch: every selectable config
        for dn in ("bf16", "fp16", "fp32"):
            for c in gpu_configs(DT[dn]):
                jobs += [job(c, dn), job(c, dn, even_k=False), job(c, dn, has_bias=True)]
                # zero-extended K with bias: K % 16 != 0 (4101) and K % 16 == 8 (5096: TMA-aligned rows)
                jobs += [(cfg_t(c), dn, 1001, 64, True), (cfg_t(c), dn, 1032, 64, True)]
                if dn == "bf16":  # hypothesis: K and N each divisible by 16 or not
                    jobs += [(cfg_t(c), dn, k_, n_, False) for k_, n_ in ((1001, 77), (1024, 77), (1001, 64))]
    broken = prewarm(list(dict.fromkeys(jobs)))
    RESULTS["compile_failed"] = sorted(map(str, broken))
    log(f"prewarmed {len(jobs)} kernels, {len(broken)} failed")
    try:
        if "host" in secs:
            host(args.budget_s)
        if "cells" in secs:
            cells(args.budget_s * 0.8, broken)
        if "cellbits" in secs:
            cellbits(args.budget_s, broken)
        if "splitk" in secs:
            splitk(args.budget_s)
        if "ceilings" in secs and not SMOKE:
            ceilings()
        if "negctl" in secs:
            negctl(args.budget_s * 0.1)
        if "bits" in secs:
            bits(args.budget_s * 0.45, broken)
        if "sweep" in secs:
            sweep(args.budget_s * 0.85, broken)
        if "fp32" in secs:
            fp32_precision(args.budget_s * 0.93, broken)
        if "mid" in secs:
            mid(args.budget_s, broken, args.write_table)
    finally:
        with open(os.path.join(args.out, "landscape.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
    log("summary: best config per cell (bf16), ratio = cuBLAS time / ours")
    for key, cell in RESULTS.get("sweep", {}).items():
        print(f"  {key:16s} cublas {cell['cublas_us']:9.1f}us  ours {cell[cell['best']]:9.1f}us  "
              f"ratio {cell['cublas_us'] / cell[cell['best']]:.3f}  {cell['best']}")


if __name__ == "__main__":
    main()
