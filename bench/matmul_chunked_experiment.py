"""EXPERIMENT (not used by the library): one fixed-chunk K order for every M of the batch-invariant linear.

The library's kernel walks K from 0 into ONE fp32 accumulator per output, so M = 256 has only 64-128
whole-K tiles for 132 SMs (bench/NOTES.md, "What is left for the linear bar"). Here every kernel uses one
arithmetic instead: out = ((0.0 + S_0) + S_1) + ... in fp32, chunks in order, S_c = the MMA accumulation
FROM ZERO over K in [c*CHUNK, (c+1)*CHUNK) (CHUNK a constant multiple of BLOCK_K; the K tail loads exact
zeros). A row's bits then depend neither on M nor on how the chunks are scheduled:
  chunked  one program per tile: `total = 0; for c: acc = 0; <pipelined K loop into acc>; total += acc`,
           no conditional in the K loop. The first attempt (matmul_gpu_check.py `splitk`) reset acc inside
           one flat loop: compiled offline (triton 3.9, sm_90a) ptxas then SERIALIZES its wgmmas ("non wgmma
           instructions defining accumulator registers"); these kernels get no such warning (section ptxas
           checks it with the GPU's triton). Variant F fuses the chunk and K loops through Triton's own loop
           flattening (one pipelined loop, loads run on across chunk ends; only without a persistent tile
           loop: Triton flattens nests of exactly two loops).
  split    one program per (tile, chunk) writes S_c to an fp32 workspace [n_chunks, M, N]; then a separate
           reduce kernel, or (fused) the LAST program of the tile - an int32 counter per tile, atomic acq_rel -
           adds the tile's partials in chunk order from 0.0, writes the output and resets the counter to 0
           (reusable, also inside CUDA graphs). The atomic picks WHO reduces, never the order.

    PYTHONUNBUFFERED=1 PYTHONPATH=src python bench/matmul_chunked_experiment.py --out $OUT --budget-s 150
    python bench/matmul_chunked_experiment.py --cpu-smoke --out /tmp/smoke   # interpreter, tiny fp16/fp32

Sections (--sections ptxas,bits,time): ptxas = registers / spills / wgmma serialization per variant;
bits = every variant bitwise against one reference (M 1..1024, a row slice alone, K + 48 zero columns,
split == unsplit) and the error vs fp64, failing variants are not timed; time = CUDA-graph timings
(bench_ops' graph timer) of F.linear, detinfer's `linear` and each variant, cells by priority (M=256
first) until --budget-s (timing only) is spent, then a per-shape/CHUNK summary. All kernels are compiled
first in parallel processes (Triton's disk cache). OUT/matmul_chunked.json is rewritten after every cell;
the log goes to OUT/matmul_chunked.log.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import astuple, dataclass

SMOKE = "--cpu-smoke" in sys.argv
if SMOKE:  # before triton is imported: @triton.jit reads it when the kernels are defined
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
from detinfer.kernels import matmul as mm  # noqa: E402  (only its public `linear`, for comparison)

try:  # host-side TMA descriptors (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

DEV = "cpu" if SMOKE else "cuda"
DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
T0 = time.time()
RESULTS: dict = {}
LOG: list = []  # [file] once --out is known


def log(*a):
    line = " ".join(str(x) for x in (f"[{time.time() - T0:6.1f}s]",) + a)
    print(line, flush=True)
    if LOG:
        LOG[0].write(line + "\n")
        LOG[0].flush()


# ------------------------------------------------------------------------------------------------ kernels
@triton.jit
def _tile_coords(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped order (L2 reuse): decides which program computes a tile, never how it is computed."""
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    first_m = (tile // in_group) * GROUP_M
    size_m = min(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    return first_m + (tile % in_group) % size_m, (tile % in_group) // size_m


@triton.jit
def _tile_ptrs(base, pid_m, pid_n, M, N, stride_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pointers to one [BLOCK_M, BLOCK_N] tile of a row-major [M, N] array (unit column stride), and the
    in-bounds mask."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ptrs = base + offs_m.to(tl.int64)[:, None] * stride_m + offs_n[None, :]
    return ptrs, (offs_m[:, None] < M) & (offs_n[None, :] < N)


@triton.jit
def _chunk_sum(a, w, pid_m, pid_n, k0, M, N, K, stride_am, stride_wn, steps, TMA: tl.constexpr,
               EVEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               NUM_STAGES: tl.constexpr):
    """S = A[tile rows, k0 : k0 + steps*BLOCK_K] @ W[tile cols, same K]^T, accumulated from ZERO in fp32.
    A plain pipelined loop: no conditionals, acc used only by the dot, so Triton keeps its MMA pipeline.
    `a` / `w` are TMA descriptors (out-of-range boxes read zeros) or base pointers (masked loads)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:
        for kb in tl.range(0, steps, num_stages=NUM_STAGES):
            k = k0 + kb * BLOCK_K
            acc = tl.dot(a.load([pid_m * BLOCK_M, k]), w.load([pid_n * BLOCK_N, k]).T, acc)
    else:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        n_ok = offs_n < N
        a_ptrs = a + offs_m.to(tl.int64)[:, None] * stride_am + (k0 + offs_k)[None, :]
        w_ptrs = w + (k0 + offs_k)[:, None] + offs_n.to(tl.int64)[None, :] * stride_wn  # W^T tile [BK, BN]
        for kb in tl.range(0, steps, num_stages=NUM_STAGES):
            if EVEN:  # K % CHUNK == 0: masks constant along K (vectorized loads)
                a_t = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
                w_t = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
            else:  # the K tail reads exact zeros: zero products leave the sum unchanged
                k_ok = offs_k < K - (k0 + kb * BLOCK_K)
                a_t = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                w_t = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(a_t, w_t, acc)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    return acc


@triton.jit
def _chunked_tile(a, w, c_ptr, tile, M, N, K, stride_am, stride_wn, stride_cm, chunk, TMA: tl.constexpr,
                  EVEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr, FLATTEN_CHUNKS: tl.constexpr):
    """One output tile: the chunk sums added in order into a second fp32 accumulator. With FLATTEN_CHUNKS
    Triton fuses the chunk and K loops into one pipelined loop (it only fuses a nest of exactly two loops,
    so not inside a persistent tile loop): the next chunk's loads can then overlap this chunk's tail."""
    pid_m, pid_n = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    steps = chunk // BLOCK_K
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for c in tl.range(0, tl.cdiv(K, chunk), flatten=FLATTEN_CHUNKS):
        total += _chunk_sum(a, w, pid_m, pid_n, c * chunk, M, N, K, stride_am, stride_wn, steps, TMA, EVEN,
                            BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES)
    ptrs, mask = _tile_ptrs(c_ptr, pid_m, pid_n, M, N, stride_cm, BLOCK_M, BLOCK_N)
    tl.store(ptrs, total.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "num_programs"])
def _chunked_kernel(a, w, c_ptr, M, N, K, stride_am, stride_wn, stride_cm, chunk, num_programs,
                    TMA: tl.constexpr, EVEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr,
                    PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """Unsplit. PERSISTENT: each program walks tiles num_programs apart (FLATTEN / WARP_SPECIALIZE then
    apply to that tile loop); otherwise one tile per program and FLATTEN flattens the chunk loop."""
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N), num_programs,
                             flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
            _chunked_tile(a, w, c_ptr, tile, M, N, K, stride_am, stride_wn, stride_cm, chunk, TMA, EVEN,
                          BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_STAGES, False)
    else:
        _chunked_tile(a, w, c_ptr, tl.program_id(0), M, N, K, stride_am, stride_wn, stride_cm, chunk, TMA, EVEN,
                      BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_STAGES, FLATTEN)


@triton.jit(do_not_specialize=["M", "num_programs"])
def _split_kernel(a, w, ws_ptr, cnt_ptr, c_ptr, M, N, K, stride_am, stride_wn, stride_cm, chunk, num_programs,
                  TMA: tl.constexpr, EVEN: tl.constexpr, FUSED: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Split: work item = (tile, chunk), chunk fastest (a tile's chunks run side by side, so its partials
    are still in L2 when the last one reduces). ws[c] = S_c of the tile, fp32, layout [n_chunks, M, N]."""
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    n_chunks = tl.cdiv(K, chunk)
    steps = chunk // BLOCK_K
    mn = M.to(tl.int64) * N
    for item in tl.range(tl.program_id(0), num_tiles * n_chunks, num_programs):
        tile = item // n_chunks
        c = item % n_chunks
        pid_m, pid_n = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = _chunk_sum(a, w, pid_m, pid_n, c * chunk, M, N, K, stride_am, stride_wn, steps, TMA, EVEN,
                         BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES)
        ws_tile, mask = _tile_ptrs(ws_ptr, pid_m, pid_n, M, N, N, BLOCK_M, BLOCK_N)
        tl.store(ws_tile + c.to(tl.int64) * mn, acc, mask=mask)
        if FUSED:
            # Every thread's partial store must precede the (one-thread) release of the atomic: CTA barrier
            # first, then acq_rel at GPU scope (the CUTLASS semaphore pattern).
            tl.debug_barrier()
            count = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if count == n_chunks - 1:  # all other chunks of this tile are stored: reduce IN CHUNK ORDER
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                p, pmask = _tile_ptrs(ws_ptr, pid_m, pid_n, M, N, N, BLOCK_M, BLOCK_N)
                for _ in tl.range(0, n_chunks, num_stages=1):  # not pipelined: registers
                    # .cg: read at L2 (partials written by other SMs; L1 is not coherent)
                    total += tl.load(p, mask=pmask, other=0.0, cache_modifier=".cg")
                    p += mn
                tl.store(cnt_ptr + tile, 0)  # no other program touches it again in this launch
                out_ptrs, _ = _tile_ptrs(c_ptr, pid_m, pid_n, M, N, stride_cm, BLOCK_M, BLOCK_N)
                tl.store(out_ptrs, total.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _reduce_kernel(ws_ptr, c_ptr, M, N, n_chunks, BLOCK: tl.constexpr):
    """out = ((0 + ws[0]) + ws[1]) + ..., rounded once to the output dtype (contiguous [M, N] output)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mn = M.to(tl.int64) * N
    mask = offs < mn
    ptrs = ws_ptr + offs
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for _ in range(0, n_chunks):
        total += tl.load(ptrs, mask=mask, other=0.0)
        ptrs += mn
    tl.store(c_ptr + offs, total.to(c_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------- host side
@dataclass(frozen=True)
class V:
    """One kernel variant. split=False: the chunked (unsplit) kernel; fused only matters for split."""
    split: bool
    tma: bool
    bm: int
    bn: int
    bk: int
    warps: int
    stages: int
    persistent: bool = False
    flatten: bool = False
    ws: bool = False  # warp_specialize on the tile loop
    fused: bool = False
    maxnreg: int = 0  # > 0: ptxas register cap (e.g. 128 lets two 8-warp programs share an SM)
    occ: int = 1  # persistent grid = occ x SMs

    @property
    def name(self) -> str:
        kind = ("split-fused" if self.fused else "split-reduce") if self.split else "chunked"
        flags = "".join(f for f, on in (("P", self.persistent), ("F", self.flatten), ("W", self.ws)) if on)
        return (f"{kind}/{'tma' if self.tma else 'ptr'}{flags and '-' + flags} {self.bm}x{self.bn}x{self.bk} "
                f"w{self.warps} s{self.stages}" + (f" r{self.maxnreg}" if self.maxnreg else "")
                + (f" occ{self.occ}" if self.occ > 1 else ""))


RED_BLOCK = 1024
CHECKED: set = set()  # variants the bits section ran at least once
_BUF: dict = {}
_SMS: list = []


def _buf(name: str, numel: int, dtype, device) -> torch.Tensor:
    """Grow-only scratch (workspace, counters), allocated zeroed: the counters must start at 0 and every
    fused launch leaves them at 0 again. Sized by the warm calls before any graph capture."""
    t = _BUF.get((name, str(device)))
    if t is None or t.numel() < numel:
        t = _BUF[(name, str(device))] = torch.zeros(max(numel, 1), dtype=dtype, device=device)
    return t


def _sms() -> int:
    if not _SMS:  # interpreter: 3 programs exercise the persistent walk
        _SMS.append(3 if SMOKE else torch.cuda.get_device_properties(0).multi_processor_count)
    return _SMS[0]


def tma_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned row strides and bases."""
    es = x.element_size()
    return TensorDescriptor is not None and all(t.stride(0) * es % 16 == 0 and t.data_ptr() % 16 == 0
                                                for t in (x, w))


def run(v: V, x: torch.Tensor, w: torch.Tensor, chunk: int, out: torch.Tensor | None = None, warmup=False):
    """x [M, K] @ w [N, K]^T -> [M, N] (x.dtype) with the fixed-chunk order, through variant v. warmup=True
    compiles without launching and returns the compiled kernels (for the ptxas section)."""
    m, k = x.shape
    n = w.shape[0]
    assert x.stride(1) == 1 and w.stride(1) == 1 and chunk % v.bk == 0
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    tiles = -(-m // v.bm) * -(-n // v.bn)
    n_chunks = -(-k // chunk)
    if v.tma:
        a = TensorDescriptor(x, [m, k], [x.stride(0), 1], [v.bm, v.bk])
        b = TensorDescriptor(w, [n, k], [w.stride(0), 1], [v.bn, v.bk])
    else:
        a, b = x, w
    work = tiles * n_chunks if v.split else tiles
    progs = min(work, v.occ * _sms()) if v.persistent else work
    # EVEN only exists for the pointer loads (TMA zero-fills by itself): one TMA binary per K class
    meta = dict(TMA=v.tma, EVEN=(not v.tma) and k % chunk == 0, BLOCK_M=v.bm, BLOCK_N=v.bn, BLOCK_K=v.bk,
                GROUP_M=8, NUM_STAGES=v.stages, num_warps=v.warps, num_stages=v.stages)
    if v.maxnreg:
        meta["maxnreg"] = v.maxnreg

    def launch(kernel, grid, *args, **kw):
        return kernel.warmup(*args, grid=grid, **kw) if warmup else kernel[grid](*args, **kw)

    if not v.split:
        k1 = launch(_chunked_kernel, (progs,), a, b, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), chunk,
                    progs, PERSISTENT=v.persistent, FLATTEN=v.flatten, WARP_SPECIALIZE=v.ws, **meta)
        return [k1] if warmup else out
    assert out.is_contiguous()
    ws = _buf("ws", n_chunks * m * n, torch.float32, x.device)
    cnt = _buf("cnt", tiles, torch.int32, x.device)
    k1 = launch(_split_kernel, (progs,), a, b, ws, cnt, out, m, n, k, x.stride(0), w.stride(0), n, chunk, progs,
                FUSED=v.fused, **meta)
    if not v.fused:  # the reduce kernel is compiled/launched after the split kernel
        launch(_reduce_kernel, (-(-(m * n) // RED_BLOCK),), ws, out, m, n, n_chunks, BLOCK=RED_BLOCK, num_warps=4)
    return [k1] if warmup else out


# ------------------------------------------------------------------------------------------- the plan
SHAPES = {"o": (4096, 4096), "qkv": (4096, 6144), "down": (14336, 4096), "gate_up": (4096, 28672),
          "lm_head": (4096, 128256)}  # (K, N), Llama-3-8B
BITS_SHAPES = {s: SHAPES[s] for s in ("o", "qkv", "down", "gate_up")} | {"k3000": (3000, 512)}
BITS_MS, BITS_ROWS, PAD = (1, 7, 64, 256, 300, 1024), (100, 133, 300), 48  # rows r0:r1 of the first r2
SPLIT_MS, CHUNKED_MS = (128, 256, 512), (256, 1024, 4096, 8192)
# timing order: the cells that decide the question first; lm_head last, only if the budget remains
CELLS = ([(s, m) for m in (256, 1024, 4096, 8192, 512, 128) for s in ("o", "qkv", "down", "gate_up")]
         + [("lm_head", 256), ("lm_head", 1024)])
CHUNKED = [
    V(False, False, 128, 128, 64, 8, 4),  # pointer loads; 2 x 64 fp32 registers per thread for the tile
    V(False, False, 64, 128, 64, 4, 4),
    V(False, True, 128, 128, 64, 8, 4),
    V(False, True, 128, 128, 64, 8, 4, flatten=True),  # chunk + K loops fused: loads run on across chunks
    V(False, True, 128, 128, 64, 8, 4, persistent=True),
    V(False, True, 128, 128, 64, 8, 4, persistent=True, flatten=True, ws=True),  # the library's large-M flags
    V(False, True, 64, 128, 64, 4, 4),
    V(False, True, 64, 128, 64, 4, 4, flatten=True),
    V(False, True, 128, 256, 64, 8, 3, persistent=True),  # 2 x 128 regs/thread: spills (ptxas section)
    V(False, True, 128, 256, 64, 16, 3, persistent=True),  # 2 x 64 regs, but 512 threads cap at 128 regs
]
SPLIT = [
    V(True, True, 64, 128, 64, 4, 4, fused=True),
    V(True, True, 128, 128, 64, 8, 3, fused=True),  # 3 stages: ~96 KB smem; ~240 regs: one program per SM
    V(True, True, 128, 128, 64, 8, 3, fused=True, maxnreg=128),  # ... capped at 128 regs: two per SM
    V(True, True, 128, 256, 64, 8, 3, fused=True),
    V(True, True, 64, 128, 64, 4, 4, persistent=True, fused=True, occ=2),
    V(True, True, 128, 128, 64, 8, 3, persistent=True, fused=True, maxnreg=128, occ=2),
    V(True, True, 128, 256, 64, 8, 3, persistent=True, fused=True),
    V(True, True, 64, 128, 64, 4, 4),
    V(True, True, 128, 128, 64, 8, 3),
    V(True, True, 128, 256, 64, 8, 3),
    V(True, False, 64, 128, 64, 4, 4, fused=True),
    V(True, False, 128, 128, 64, 8, 3, fused=True),
    V(True, False, 128, 256, 64, 8, 3, fused=True),
    V(True, False, 128, 128, 64, 8, 3),
]
REF = CHUNKED[0]  # the bits reference (pointer loads: the simplest kernel)
FP16 = [CHUNKED[0], CHUNKED[3], CHUNKED[4], SPLIT[2], SPLIT[5], SPLIT[8], SPLIT[11]]  # fp16: each kind
if SMOKE:  # BLOCK_M = 1: the interpreter's dot is numpy, whose multi-row results depend on the row position
    BITS_SHAPES, BITS_MS, BITS_ROWS = {"k296": (296, 48), "k300": (300, 40)}, (1, 5, 9), (2, 6, 9)
    SPLIT_MS, CHUNKED_MS, CELLS = (5,), (5, 9), [("k296", 5), ("k296", 9)]
    SHAPES = dict(BITS_SHAPES)
    CHUNKED = [V(False, t, 1, 32, 32, 4, 1, persistent=p, flatten=f) for t, p, f in ((0, 0, 0), (1, 0, 1), (1, 1, 1))]
    SPLIT = [V(True, t, 1, 32, 32, 4, 1, persistent=p, fused=f)
             for t, p, f in ((0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1), (1, 1, 1))]
    REF, FP16 = CHUNKED[0], CHUNKED + SPLIT


# ------------------------------------------------------------------ parallel compile into Triton's disk cache
def _warm_job(job):
    """Compile one (variant, dtype, K class) or the library for one (M, K, N), in a spawned process."""
    try:
        if job[0] == "lib":
            _, m, k, n, dname = job
            mm.linear(torch.randn(m, k, device=DEV).to(DT[dname]), torch.randn(n, k, device=DEV).to(DT[dname]))
        else:
            vt, dname, k, chunk = job
            x = torch.randn(2, k, device=DEV).to(DT[dname])
            run(V(*vt), x, torch.randn(128, k, device=DEV).to(DT[dname]), chunk)
        torch.cuda.synchronize()
        return job, "ok"
    except Exception as e:  # OutOfResources, compile errors: data for this experiment
        return job, f"{type(e).__name__}: {str(e)[:300]}"


def prewarm(chunks) -> dict:
    """K classes: 4096 (K % CHUNK == 0, K % 16 == 0), 4144 (masked tail), 3000 (K % 16 != 0: other int
    specialization). M is not specialized, so a 2-row call compiles the binary every later call uses."""
    jobs = []
    for dname, vs in (("bf16", CHUNKED + SPLIT), ("fp16", FP16)):
        for v in vs:
            for k in (4096, 3000) if v.tma else (4096, 4144, 3000):
                jobs.append((astuple(v), dname, k, chunks[0]))
    lib = [(m, *SHAPES[s], "bf16") for s, m in CELLS] + [(BITS_ROWS[2], k, n, d) for d in ("bf16", "fp16")
                                                         for k, n in BITS_SHAPES.values()]
    jobs += [("lib",) + j for j in dict.fromkeys(lib)]
    log(f"prewarm: compiling {len(jobs)} jobs in parallel processes")
    with mp.get_context("spawn").Pool(min(16, os.cpu_count() or 4)) as pool:
        res = pool.map(_warm_job, jobs, chunksize=1)
    broken = {}
    for j, r in res:
        if r != "ok":
            name = "library" if j[0] == "lib" else V(*j[0]).name
            broken.setdefault(name, []).append(f"{j[1:]}: {r}")
            log("compile FAILED:", name, j[1:], r[:200])
    return broken


# -------------------------------------------------------------------------------------------------- ptxas
def _ptxas(ptx: str, bins: list, arch: str):
    """Run a ptxas binary with -v on Triton's PTX -> registers, spill bytes, wgmma serialization warning."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    err = "no ptxas found"
    for b in bins:
        r = subprocess.run([b, "-v", f"--gpu-name={arch}", f.name, "-o", os.devnull], capture_output=True, text=True)
        if r.returncode == 0:
            regs, spill = re.search(r"Used (\d+) registers", r.stderr), re.search(r"(\d+) bytes spill stores", r.stderr)
            return {"regs": regs and int(regs[1]), "spill_store_bytes": spill and int(spill[1]),
                    "wgmma_serialized": "serialized" in r.stderr, "ptxas": os.path.basename(b)}
        err = r.stderr.strip()[-200:]  # e.g. a ptxas too old for Triton's PTX version: try the next one
    return "ptxas failed: " + err


def ptxas_report(chunk: int) -> None:
    """Per variant, from the PTX Triton generated here: registers, spills, and whether ptxas serializes the
    wgmma pipeline ("... serialized due to non wgmma instructions defining accumulator registers ..."),
    the first attempt's kernel included (offline, triton 3.9 / sm_90a: it is serialized, these are not)."""
    import triton.backends.nvidia as nv

    nvbin = os.path.join(os.path.dirname(nv.__file__), "bin")
    bins = [b for b in (os.environ.get("TRITON_PTXAS_PATH", ""), os.path.join(nvbin, "ptxas"),
                        os.path.join(nvbin, "ptxas-blackwell")) if b and os.path.exists(b)]
    maj, mnr = torch.cuda.get_device_capability()
    arch = f"sm_{maj}{mnr}{'a' if maj >= 9 else ''}"
    x, w = torch.randn(2, 4096, device=DEV).bfloat16(), torch.randn(128, 4096, device=DEV).bfloat16()
    ptx, res = {}, {}
    for v in CHUNKED + SPLIT:  # compile (from the disk cache) in this thread; ptxas in parallel below
        try:
            ptx[v.name] = run(v, x, w, chunk, warmup=True)[0].asm["ptx"]
        except Exception as e:
            res[v.name] = f"not compiled: {type(e).__name__}: {str(e)[:200]}"
    try:  # the first attempt, for comparison
        sys.path.insert(0, HERE)
        import matmul_gpu_check as first

        for ws_ in (True, False):
            k1 = first._xk_chunked.warmup(
                TensorDescriptor(x, [2, 4096], [4096, 1], [128, 64]), TensorDescriptor(w, [128, 4096], [4096, 1],
                [128, 64]), x.new_empty(2, 128), 2, 128, 4096, 128, 1, CHUNK=1024, BLOCK_M=128, BLOCK_N=128,
                BLOCK_K=64, GROUP_M=8, FLATTEN=True, WARP_SPECIALIZE=ws_, num_warps=8, num_stages=4, grid=(1,))
            ptx[f"FIRST ATTEMPT _xk_chunked 128x128x64 w8 s4 flatten{' ws' if ws_ else ''}"] = k1.asm["ptx"]
    except Exception as e:
        log(f"ptxas: first attempt not compiled: {type(e).__name__}: {str(e)[:200]}")
    with ThreadPoolExecutor(8) as pool:
        res.update(zip(ptx, pool.map(lambda t: _ptxas(t, bins, arch), ptx.values())))
    RESULTS["ptxas"] = res
    for name, r in res.items():
        log(f"ptxas {name:48s} {r}")


# --------------------------------------------------------------------------------------------------- bits
def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (stricter than torch.equal: -0.0 vs 0.0 and NaN payloads count)."""
    it = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.shape == b.shape and torch.equal(a.view(it), b.view(it))


def _err(y: torch.Tensor, y64: torch.Tensor) -> float:
    """max |y - y64| / max |y64| (normwise; an elementwise max blows up on outputs near 0)."""
    return ((y.double() - y64).abs().max() / y64.abs().max()).item()


def _check(v, x, w, xp, wp, chunk, ref) -> list:
    fails = [f"M={m}" for m in BITS_MS if not _same_bits(run(v, x[:m], w, chunk), ref[:m])]
    r0, r1, mz = BITS_ROWS
    if not _same_bits(run(v, x[r0:r1].contiguous(), w, chunk), ref[r0:r1]):
        fails.append(f"rows {r0}:{r1} alone")
    if not _same_bits(run(v, xp, wp, chunk), ref[:mz]):
        fails.append(f"K+{PAD} zeros")
    if v.split and v.fused and int(_BUF[("cnt", str(x.device))].count_nonzero()):
        fails.append("counters not reset to 0")
    return fails


def bits(chunks, budget_s, excluded) -> dict:
    """-> {variant name: [failures]}. Every variant against one reference on the same inputs (itself included,
    across M). Interpreter, fp32 only: numpy's BLAS sums a block differently for the TMA path's transposed
    W tile than for the pointer path's gathered one, so there TMA variants get a TMA reference (the logic
    under test - chunking, masks, reduction order - is the same)."""
    out = RESULTS.setdefault("bits", {})
    bad: dict = {}
    ref_v = next((v for v in [REF] + CHUNKED if v.name not in excluded), None)
    ref_tma = next((v for v in CHUNKED if v.tma and v.name not in excluded), None) if SMOKE else None
    if ref_v is None:
        log("bits: no reference variant compiled")
        return bad
    t_end = time.time() + budget_s
    for dname in ("fp16", "fp32") if SMOKE else ("bf16", "fp16"):
        dt = DT[dname]
        for shape, (k, n) in BITS_SHAPES.items():
            if dname == "fp16" and not SMOKE and shape not in ("o", "k3000"):
                continue
            if time.time() > t_end:
                log(f"bits: budget spent before {dname} {shape}: rest NOT checked")
                return bad
            g = torch.Generator(device=DEV).manual_seed(1000 + k + n)
            x = torch.randn(max(BITS_MS), k, device=DEV, generator=g).to(dt)
            w = (torch.randn(n, k, device=DEV, generator=g) / k**0.5).to(dt)
            mz = BITS_ROWS[2]
            xp = torch.cat([x[:mz], x.new_zeros(mz, PAD)], 1)
            wp = torch.cat([w, w.new_zeros(n, PAD)], 1)
            y64 = x[:mz].double() @ w.double().t()
            lib = mm.linear(x[:mz], w)
            can_tma = tma_ok(x, w) and tma_ok(xp, wp)
            for chunk in chunks:
                key = f"{dname}/{shape}/chunk{chunk}"
                ref = run(ref_v, x, w, chunk)
                refs = {False: ref, True: run(ref_tma, x, w, chunk) if dname == "fp32" and ref_tma and can_tma
                        else ref}
                res = {}
                for v in [ref_v] + [v for v in (CHUNKED + SPLIT if dname != "fp16" or SMOKE else FP16) if v != ref_v]:
                    if v.name in excluded:
                        res[v.name] = "not run (compile failed)"
                        continue
                    if v.tma and not can_tma:
                        res[v.name] = "skipped (TMA needs 16-byte aligned rows)"
                        continue
                    try:
                        fails = _check(v, x, w, xp, wp, chunk, refs[v.tma])
                    except Exception as e:  # an experiment: a failed compile/launch is a result
                        fails = [f"{type(e).__name__}: {str(e)[:300]}"]
                    res[v.name] = fails or "PASS"
                    CHECKED.add(v.name)
                    if fails:
                        bad.setdefault(v.name, []).append(f"{key}: {fails}")
                        log(f"  FAIL bits {key} {v.name}: {fails}")
                npass = sum(r == "PASS" for r in res.values())
                info = {"reference": ref_v.name, "err_chunked_vs_fp64": _err(ref[:mz], y64),
                        "err_library_vs_fp64": _err(lib, y64),
                        "library_differs_frac": (lib != ref[:mz]).float().mean().item(), "variants": res}
                out[key] = info
                log(f"bits {key}: {npass}/{len(res)} PASS ({len(res) - npass} fail/skip); max err / max|y| vs "
                    f"fp64 {info['err_chunked_vs_fp64']:.2e} (library {info['err_library_vs_fp64']:.2e}); "
                    f"library bits differ in {info['library_differs_frac']:.0%} of outputs")
            _save()
    return bad


# --------------------------------------------------------------------------------------------------- time
def _timer():
    """(ms-per-call timer, input rotation, copies_for): bench_ops' CUDA-graph timer (n calls captured in
    one graph, median over replays: device time only, as the speed bar is judged)."""
    if SMOKE:
        def wall(fn):
            fn()
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        return wall, lambda fn, sets: (lambda: fn(*sets[0])), lambda nbytes: 1
    sys.path.insert(0, HERE)
    import bench_ops as bo

    return (lambda fn: bo.graph_ms(fn, rep_ms=6.0, replays=5)), bo.rotated, bo.copies_for


def time_cells(chunks, budget_s, bad) -> None:
    gms, rotated, copies_for = _timer()
    out = RESULTS.setdefault("time", {})
    t_end = time.time() + budget_s
    dt = torch.float16 if SMOKE else torch.bfloat16
    log("time: ratio = cuBLAS time / ours (>= 1: ours faster); lib = the library's linear, same cell")
    for shape, m in CELLS:
        if time.time() > t_end - 3:
            log(f"time: budget spent before {shape} M={m}; remaining cells not timed")
            break
        k, n = SHAPES[shape]
        sets = [((torch.randn(m, k, device=DEV) * 0.5).to(dt), (torch.randn(n, k, device=DEV) / k**0.5).to(dt))
                for _ in range(copies_for((m + n) * k * 2))]  # rotate inputs that fit in L2
        vs = [v for v in (SPLIT if m in SPLIT_MS else []) + (CHUNKED if m in CHUNKED_MS else []) if v.name not in bad]
        cell = out[f"{shape}/M{m}"] = {"shape": shape, "M": m, "K": k, "N": n, "variants": {}}
        try:
            cell["cublas_us"] = [gms(rotated(F.linear, sets)) * 1e3]
            cell["library_us"] = gms(rotated(mm.linear, sets)) * 1e3
        except Exception as e:
            log(f"time {shape} M={m}: baseline failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        for v in vs:
            for ch in chunks:
                if time.time() > t_end:
                    break
                try:
                    t = gms(rotated(lambda x, w, v=v, ch=ch: run(v, x, w, ch), sets)) * 1e3
                except Exception as e:
                    t = f"{type(e).__name__}: {str(e)[:200]}"
                cell["variants"][f"{v.name} | chunk {ch}"] = t
        cell["cublas_us"].append(gms(rotated(F.linear, sets)) * 1e3)  # before and after: drift shows
        cub = sum(cell["cublas_us"]) / 2
        lib_r = cub / cell["library_us"]
        log(f"{shape} M={m}: cuBLAS {cell['cublas_us'][0]:.1f} / {cell['cublas_us'][1]:.1f} us, library "
            f"{cell['library_us']:.1f} us (ratio {lib_r:.3f})")
        for key, t in cell["variants"].items():
            if isinstance(t, float):
                log(f"  {shape:7s} M={m:5d} {key:52s} {t:9.1f} us  cuBLAS {cub:9.1f}  ratio {cub / t:.3f}  "
                    f"lib {lib_r:.3f}")
            else:
                log(f"  {shape:7s} M={m:5d} {key:52s} ERROR {t[:150]}")
        del sets
        _save()


def summary(chunks) -> None:
    """Per shape and CHUNK: the best variant per M (split or chunked, same CHUNK) and the worst case of
    that combination across M, against the bar (>= 0.85 at M = 256, >= 0.95 at M >= 1024)."""
    cells = RESULTS.get("time", {}).values()
    out = RESULTS.setdefault("summary", {})
    log("SUMMARY (ratio = cuBLAS / ours; per M the best variant of that CHUNK; lib = library's linear)")
    for shape in dict.fromkeys(c["shape"] for c in cells):
        rows = sorted((c for c in cells if c["shape"] == shape and len(c.get("cublas_us", [])) == 2),
                      key=lambda c: c["M"])
        for ch in chunks:
            per_m = {}
            for c in rows:
                cub = sum(c["cublas_us"]) / 2
                cand = {key.split(" | ")[0]: t for key, t in c["variants"].items()
                        if key.endswith(f"chunk {ch}") and isinstance(t, float)}
                if cand:
                    best = min(cand, key=cand.get)
                    per_m[c["M"]] = (round(cub / cand[best], 3), best, round(cub / c["library_us"], 3))
            if not per_m:
                continue
            worst = min(r for r, _, _ in per_m.values())
            judged = [r >= (0.85 if m < 1024 else 0.95) for m, (r, _, _) in per_m.items() if m >= 256]
            bar = all(judged) if judged else None
            out[f"{shape}/chunk{ch}"] = {"per_M": per_m, "worst": worst, "meets_bar_on_measured_M": bar}
            verdict = "n/a" if bar is None else "MET" if bar else "missed"
            log(f"{shape} CHUNK {ch}: worst {worst:.3f} (library worst {min(x for _, _, x in per_m.values()):.3f});"
                f" bar (>=0.85 @256, >=0.95 @>=1024) {verdict} on measured M")
            for m, (r, best, lr) in per_m.items():
                log(f"    M={m:5d} best {r:.3f} ({best})  lib {lr:.3f}")


def _save() -> None:
    if RESULTS.get("_path"):
        with open(RESULTS["_path"], "w") as f:
            json.dump({k: v for k, v in RESULTS.items() if k != "_path"}, f, indent=1, default=str)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="ptxas,bits,time")
    ap.add_argument("--budget-s", type=float, default=150, help="wall budget of the time section")
    ap.add_argument("--bits-budget-s", type=float, default=120, help="wall budget of the bits section")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--chunks", default=None, help="comma-separated CHUNK sizes (default 1024,2048; smoke 64,96)")
    ap.add_argument("--cpu-smoke", action="store_true", help="Triton interpreter, tiny fp16/fp32 shapes")
    ap.add_argument("--no-prewarm", action="store_true", help="compile lazily in this process instead")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: leave through the finally below
    chunks = [int(c) for c in (args.chunks or ("64,96" if SMOKE else "1024,2048")).split(",")]
    secs = args.sections.split(",")
    os.makedirs(args.out, exist_ok=True)
    RESULTS["_path"] = os.path.join(args.out, "matmul_chunked.json")
    LOG.append(open(os.path.join(args.out, "matmul_chunked.log"), "w"))
    dev = "interpreter" if SMOKE else torch.cuda.get_device_name()
    RESULTS["env"] = {"torch": torch.__version__, "triton": triton.__version__, "device": dev, "chunks": chunks}
    log(f"torch {torch.__version__} triton {triton.__version__} {dev}; chunks {chunks}; sections {secs}")
    try:
        broken = {} if SMOKE or args.no_prewarm else prewarm(chunks)
        RESULTS["compile_failed"] = broken
        log(f"prewarm done: {len(broken)} variant(s) failed to compile: {sorted(broken)}")
        bad = dict(broken)
        if "ptxas" in secs and not SMOKE:
            ptxas_report(chunks[0])
        if "bits" in secs:
            failed = bits(chunks, args.bits_budget_s, broken)
            RESULTS["bits_failed"] = failed
            bad.update(failed)
            for name in (v.name for v in CHUNKED + SPLIT):
                verdict = ("FAIL -> not timed: " + str(bad[name])[:300] if name in bad else
                           "PASS" if name in CHECKED else "NOT CHECKED (bits budget)")
                log(f"bits verdict {name}: {verdict}")
        if "time" in secs:
            time_cells(chunks, args.budget_s, bad)
            summary(chunks)
    finally:
        _save()
    log("done")


if __name__ == "__main__":
    main()
