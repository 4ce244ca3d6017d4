"""GPU landscape of the batch-invariant matmul: which launch configs give identical bits, and how fast
each one is against cuBLAS, on the Llama-3-8B linear shapes. Used offline to fill matmul_configs.py.

    PYTHONUNBUFFERED=1 python bench/matmul_gpu_check.py --out DIR [--budget-s 240] [--sections ...]

Sections (each stops early once the time budget is spent, and says so):
  ceilings  device-to-device copy bandwidth and a cuBLAS bf16 8192^3 product (the two roofs)
  bits      every candidate config against one reference config, bitwise, per dtype and shape;
            zero extension of K (contract B) for a few configs
  sweep     bf16 time of every candidate config per (shape, M) cell vs F.linear; best per cell
  fp32      IEEE vs tf32x3 dot for fp32 inputs: time, error vs fp64, bits across configs
  splitk    decode-only experiment: fixed 1024-wide K chunks run in parallel + ordered fix-up kernel
Writes DIR/landscape.json (all numbers) and prints a summary table last. `--smoke` runs every section on
tiny shapes in Triton's CPU interpreter (numbers meaningless; only checks that the script runs).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from detinfer.kernels import matmul as mm  # noqa: E402
from detinfer.kernels.matmul_configs import MatmulConfig as C  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
          "lm_head": (4096, 128256)}  # (K, N)
MS = [1, 4, 16, 64, 256, 1024, 4096, 8192]
DECODE = [C(16, 16, 256, 2, 4), C(16, 32, 256, 4, 4), C(16, 64, 256, 4, 4), C(16, 32, 128, 4, 6),
          C(16, 64, 128, 4, 6), C(16, 32, 512, 4, 3), C(16, 128, 128, 4, 4), C(16, 16, 512, 2, 3),
          C(16, 32, 64, 4, 8), C(16, 64, 64, 4, 8), C(16, 16, 64, 2, 8)]
SMALL = [C(32, 32, 256, 4, 4), C(32, 64, 128, 4, 5), C(64, 32, 256, 4, 4), C(64, 64, 128, 4, 4),
         C(64, 128, 64, 4, 4), C(128, 64, 64, 4, 4)]
LARGE = [C(128, 128, 64, 4, 4), C(128, 128, 64, 8, 4), C(128, 256, 64, 8, 3), C(256, 128, 64, 8, 3),
         C(64, 256, 64, 4, 4), C(128, 256, 64, 8, 4), C(128, 128, 128, 8, 3)]
ALL16 = DECODE + SMALL + LARGE
FP16_SUBSET = [DECODE[1], DECODE[8], SMALL[3], SMALL[4], LARGE[1], LARGE[2]]
FP32 = [C(16, 32, 32, 4, 3), C(16, 64, 32, 4, 3), C(32, 64, 32, 4, 3), C(64, 64, 32, 4, 3),
        C(64, 128, 32, 8, 3), C(128, 128, 32, 8, 3), C(32, 32, 64, 4, 3)]
DEV = "cpu" if SMOKE else "cuda"
if SMOKE:
    SHAPES = {"qkv": (64, 96), "lm_head": (32, 200)}
    MS = [1, 20]
    DECODE, SMALL, LARGE = DECODE[:2], SMALL[:1], LARGE[:1]
    ALL16 = DECODE + SMALL + LARGE
    FP16_SUBSET, FP32 = ALL16[:2], FP32[:2]
FP32_MKN = (20, 64, 64) if SMOKE else (1024, 4096, 4096)
SPLITK = {"shapes": ("qkv",), "chunks": ((32, 64, 32),)} if SMOKE else {
    "shapes": ("o", "down", "qkv"), "chunks": ((1024, 64, 128), (1024, 128, 128), (2048, 64, 256))}
DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

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


# ------------------------------------------------------------------ parallel compile into the disk cache
def _warm_one(job):
    cfg, dname, even_k, has_bias, precision = job
    try:
        mm.FP32_DOT_PRECISION = precision
        dt = DT[dname]
        k = 1024 if even_k else 1040  # same divisibility classes as the real K (4096/14336; 4096 + 48)
        x = torch.randn(2, k, device=DEV).to(dt)
        w = torch.randn(64, k, device=DEV).to(dt)
        b = torch.randn(64, device=DEV).to(dt) if has_bias else None
        run_cfg(x, w, C(*cfg), b)
        torch.cuda.synchronize()
        return job, "ok"
    except Exception as e:  # OutOfResources (shared memory) and compile errors are data here
        return job, f"{type(e).__name__}: {str(e)[:200]}"


def prewarm(jobs, procs=12):
    if SMOKE:
        return {}
    ctx = mp.get_context("spawn")
    with ctx.Pool(procs) as pool:
        res = pool.map(_warm_one, jobs, chunksize=1)
    bad = {str(j): r for j, r in res if r != "ok"}
    for j, r in bad.items():
        log("compile failed:", j, r)
    return bad


def bench(fn, warmup, rep, return_mode):
    """Median time in ms (triton's do_bench: CUDA events, L2 flushed before each run)."""
    if SMOKE:
        t = time.time()
        fn()
        return (time.time() - t) * 1e3
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode=return_mode)


def cfg_t(c):
    return (c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages)


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
            ok_c = [c for c in cands if str((cfg_t(c), dname, True, False, "ieee")) not in broken]
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
        # contract B on one shape for three configs (masked-K path)
        k, n = SHAPES["qkv"]
        x = torch.randn(64, k, device=DEV).to(dt)
        w = (torch.randn(n, k, device=DEV) / 64).to(dt)
        ref = run_cfg(x, w, cands[0])
        xp = torch.cat([x, torch.zeros(64, 48, device=DEV, dtype=dt)], 1)
        wp = torch.cat([w, torch.zeros(n, 48, device=DEV, dtype=dt)], 1)
        res = {str(cfg_t(c)): torch.equal(run_cfg(xp, wp, c), ref) for c in (cands[0], cands[1], cands[-1])
               if str((cfg_t(c), dname, False, False, "ieee")) not in broken}
        log(f"contract B {dname}:", res)
        out[f"{dname}/contractB"] = res


def sweep(budget, broken):
    out = RESULTS.setdefault("sweep", {})
    for m in MS:
        cands = DECODE if m <= 16 else (SMALL + DECODE[:3] + LARGE[:2] if m <= 256 else LARGE + SMALL[4:])
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
                if str((cfg_t(c), "bf16", True, False, "ieee")) in broken:
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
    for prec in ("ieee", "tf32x3"):
        mm.FP32_DOT_PRECISION = prec
        row = {}
        y0 = None
        for c in FP32:
            if str((cfg_t(c), "fp32", True, False, prec)) in broken or left(budget) < 10:
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


# ------------------------------------------------ split-K experiment (decode): parallel chunks + fix-up
@triton.jit
def _splitk_partial(a_ptr, b_ptr, p_ptr, M, N, K, stride_am, stride_bn, CHUNK: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    c = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = c * CHUNK + tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for _ in range(0, CHUNK // BLOCK_K):
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :])
        b = tl.load(b_ptr + offs_k[:, None] + offs_n[None, :] * stride_bn)
        acc = tl.dot(a, b, acc)
        offs_k += BLOCK_K
    om = tl.arange(0, BLOCK_M)
    on = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(p_ptr + c * M * N + om[:, None] * N + on[None, :], acc, mask=(om[:, None] < M) & (on[None, :] < N))


@triton.jit
def _splitk_fixup(p_ptr, c_ptr, MN, NCHUNK: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    msk = offs < MN
    tot = tl.zeros((BLOCK,), tl.float32)
    for c in range(0, NCHUNK):
        tot += tl.load(p_ptr + c * MN + offs, mask=msk, other=0.0)
    tl.store(c_ptr + offs, tot.to(c_ptr.dtype.element_ty), mask=msk)


def splitk(budget):
    out = RESULTS.setdefault("splitk", {})
    for shape in SPLITK["shapes"]:
        k, n = SHAPES[shape]
        for m in (1, 16):
            if left(budget) < 10:
                return
            x = torch.randn(m, k, device=DEV).bfloat16()
            w = (torch.randn(n, k, device=DEV) / 64).bfloat16()
            t_cub = bench(lambda x=x, w=w: F.linear(x, w), warmup=10, rep=30, return_mode="median")
            cell = {"cublas_us": t_cub * 1e3}
            for chunk, bn, bk in SPLITK["chunks"]:
                nch = k // chunk
                part = torch.empty(nch, m, n, device=DEV, dtype=torch.float32)
                y = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)

                def fn(chunk=chunk, bn=bn, bk=bk, nch=nch, part=part, y=y, x=x, w=w, m=m, n=n, k=k):
                    _splitk_partial[(triton.cdiv(n, bn), nch)](x, w, part, m, n, k, k, k, CHUNK=chunk,
                                                               BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk,
                                                               num_warps=4, num_stages=4)
                    _splitk_fixup[(triton.cdiv(m * n, 1024),)](part, y, m * n, NCHUNK=nch, BLOCK=1024)
                cell[f"chunk{chunk}_bn{bn}_bk{bk}"] = bench(
                    fn, warmup=10, rep=30, return_mode="median") * 1e3
            out[f"{shape}/M{m}"] = cell
            log(f"splitk {shape} M={m}:", {c: round(v, 1) for c, v in cell.items()})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=240)
    ap.add_argument("--sections", default="ceilings,bits,sweep,fp32,splitk")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    secs = args.sections.split(",")
    gpu = "interpreter (smoke)" if SMOKE else torch.cuda.get_device_name()
    log("torch", torch.__version__, "triton", triton.__version__, gpu)
    RESULTS["env"] = {"torch": torch.__version__, "triton": triton.__version__, "gpu": gpu}
    jobs = []
    for c in ALL16:
        jobs.append((cfg_t(c), "bf16", True, False, "ieee"))
    for c in FP16_SUBSET:
        jobs.append((cfg_t(c), "fp16", True, False, "ieee"))
    for c in FP32:
        jobs += [(cfg_t(c), "fp32", True, False, p) for p in ("ieee", "tf32x3")]
    for cands, dn in ((ALL16, "bf16"), (FP16_SUBSET, "fp16"), (FP32, "fp32")):
        jobs += [(cfg_t(c), dn, False, False, "ieee") for c in (cands[0], cands[1], cands[-1])]
    broken = prewarm(jobs)
    RESULTS["compile_failed"] = broken
    log(f"prewarmed {len(jobs)} kernels, {len(broken)} failed")
    try:
        if "ceilings" in secs and not SMOKE:
            ceilings()
        if "bits" in secs:
            bits(args.budget_s * 0.45, broken)
        if "sweep" in secs:
            sweep(args.budget_s * 0.85, broken)
        if "fp32" in secs:
            fp32_precision(args.budget_s * 0.93, broken)
        if "splitk" in secs:
            splitk(args.budget_s)
    finally:
        with open(os.path.join(args.out, "landscape.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
    log("summary: best config per cell (bf16), ratio = cuBLAS time / ours")
    for key, cell in RESULTS.get("sweep", {}).items():
        print(f"  {key:16s} cublas {cell['cublas_us']:9.1f}us  ours {cell[cell['best']]:9.1f}us  "
              f"ratio {cell['cublas_us'] / cell[cell['best']]:.3f}  {cell['best']}")


if __name__ == "__main__":
    main()
