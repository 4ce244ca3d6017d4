"""GPU benchmark: the batch-invariant block-scaled FP8 GEMM (kernels/fp8_linear.py) against the stock FP8
paths a serving stack has on this GPU, Qwen3-8B shapes, side by side in one process.

    PYTHONUNBUFFERED=1 python bench/bench_fp8.py [--ms 1,16,64,256,1024,4096] [--json FILE] [--old DIR]
    python bench/bench_fp8.py --sweep 1,64,4096 --configs 64x64p_r1,64x64p_r2 --sweep-only   # tile configs

Columns (microseconds per call, CUDA-graph timer of bench_ops.py, weights rotated past L2):
  ours       linear_fp8 on the tiled weight (what a deterministic CUDA engine holds: fp8_quant.tile_weight):
             activations quantized per token per 128-group + the block-scaled GEMM (from 512 rows the
             warp-specialized kernel of kernels/fp8_prefill_gemm.py where it applies; --sweep configs are
             explicit, so they time the Triton kernel)
  gemm       ours without the quantization (linear_fp8_quantized on activations quantized beforehand)
  nk         ours on the weight in the [N, K] layout (shapes that do not tile; the previous layout)
  quant      the activation quantization's launch alone (ours - gemm: what fusing it elsewhere could save)
  old        (--old DIR: a module `old_fp8_linear` with the previous `linear_fp8`, for an A/B in one run)
  blockwise  torch's block-scaled scaled_mm (cuBLASLt, 1x128 activation and 128x128 weight scales) plus
             the same activation quantization: the stock path of the same numerics, where it runs
  rowwise    torch._scaled_mm with per-token x per-channel scales on pre-quantized activations: cuBLASLt's
             FP8 GEMM without block scales and without the quantization, a lower bound of any stock
             block-scaled kernel's time (vLLM's CUTLASS/DeepGEMM kernels do more work than this)
  bf16       F.linear on the bf16 weight (cuBLAS): what the unquantized model pays
  dequant    fast mode's fallback where blockwise does not run: weight dequantized per call + F.linear
ratio = best stock FP8 path / ours (>= 1: ours faster); HBM = weight bytes / time / 3.0 TB/s; TF/s = 2MNK /
time (H100 dense FP8 peak 1979 TF/s, ~1500 reachable). The `probe` lines first say which blockwise scale
layout torch takes on this build (and why not, where none does).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from bench_ops import PEAK_BW, copies_for, graph_ms, rotated  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}  # (N, K)


def probe_blockwise() -> str | None:
    """The library's probe (kernels/fp8_stock.blockwise_layout), plus each layout's error where it fails."""
    from detinfer.kernels.fp8_quant import BLOCK, quantize_weight_rows
    from detinfer.kernels.fp8_stock import _scaled_mm_blockwise, blockwise_layout

    x = torch.randn(2 * BLOCK, 5 * BLOCK, device="cuda").bfloat16()
    q, s = quantize_weight_rows(torch.randn(3 * BLOCK, 5 * BLOCK, device="cuda"))
    for layout in ("rows", "cols"):
        try:
            _scaled_mm_blockwise(x, q, s, torch.bfloat16, layout)
            print(f"probe: blockwise, weight scales {layout}: runs")
        except Exception as e:  # noqa: BLE001 - reported
            print(f"probe: blockwise, weight scales {layout}: {type(e).__name__}: {str(e)[:400]}")
    layout = blockwise_layout(torch.device("cuda"))
    print(f"probe: fast mode's layout: {layout}")
    return layout


def candidates(layout: str | None, old) -> dict:
    from detinfer.kernels.fp8_linear import linear_fp8, linear_fp8_quantized, quantize_activations_gpu
    from detinfer.kernels.fp8_quant import dequantize_weight
    from detinfer.kernels.fp8_stock import linear_fp8_stock

    def blockwise(x, q, s, *_):
        return linear_fp8_stock(x, q, s)  # fast mode's call: quantization + torch's blockwise scaled_mm

    out = {"ours": lambda x, q, s, *rest: linear_fp8(x, rest[-3], s)}
    out["gemm"] = lambda x, q, s, *rest: linear_fp8_quantized(rest[-2], rest[-1], rest[-3], s, None, x.dtype)
    out["nk"] = lambda x, q, s, *_: linear_fp8(x, q, s)
    out["quant"] = lambda x, *_: quantize_activations_gpu(x)
    if old is not None:
        out["old"] = lambda x, q, s, *_: old.linear_fp8(x, q, s)
    if layout is not None:
        out["blockwise"] = blockwise
    out["rowwise"] = lambda x, q, s, sw_blocks, w, qx, sxr, swr, *_: torch._scaled_mm(
        qx, q.t(), scale_a=sxr, scale_b=swr, out_dtype=torch.bfloat16)
    out["bf16"] = lambda x, q, s, sw_blocks, w, *_: F.linear(x, w)
    out["dequant"] = lambda x, q, s, *_: F.linear(x, dequantize_weight(q, s).to(x.dtype))
    return out


def operand_set(m: int, n: int, k: int, layout: str | None):
    from detinfer.kernels.fp8_quant import FP8_DTYPE, dequantize_weight, quantize_weight_rows, tile_weight

    x = torch.randn(m, k, device="cuda").bfloat16()
    q, s = quantize_weight_rows(torch.randn(n, k, device="cuda") / math.sqrt(k))
    sw_blocks = None
    w = dequantize_weight(q, s).bfloat16()
    amax = x.float().abs().amax(1, keepdim=True).clamp(min=1e-12)
    qx = (x.float() * (448.0 / amax)).clamp(-448, 448).to(FP8_DTYPE)
    swr = torch.ones(1, n, device="cuda")
    from detinfer.kernels.fp8_quant import quantize_activations

    return (x, q, s, sw_blocks, w, qx, (amax / 448.0).float(), swr, tile_weight(q), *quantize_activations(x))


def warm_caches(sets, old=None) -> None:
    """What linear_fp8 derives once per weight-scale tensor, for every rotated set (and, with --old, what the
    previous module derives: its own cache): a set first seen inside the timer's graph capture (no host sync
    allowed there) would run the per-element scale path."""
    from detinfer.kernels.fp8_linear import uniform_block_rows

    for st in sets:
        uniform_block_rows(st[2])
        if old is not None and hasattr(old, "uniform_block_rows"):
            old.uniform_block_rows(st[2])


def bench_gemm(ms: list[int], layout: str | None, old, rows: list) -> None:
    cands = candidates(layout, old)
    names = list(cands)
    print(f"\n{'shape':8s} {'M':>5s} " + " ".join(f"{c:>10s}" for c in names) + "  ratio   HBM  TF/s (ours)")
    for m in ms:
        for shape, (n, k) in SHAPES.items():
            nbytes = n * k * 4 + m * k * 2  # fp8 weight, tiled copy, bf16 copy (rotated together)
            sets = [operand_set(m, n, k, layout) for _ in range(copies_for(nbytes))]
            warm_caches(sets, old)
            row = {"shape": shape, "M": m, "N": n, "K": k}
            for name, fn in cands.items():
                try:
                    row[name] = graph_ms(rotated(fn, sets)) * 1e3
                except Exception as e:  # noqa: BLE001 - a path that does not run here is reported, not fatal
                    row[name] = None
                    print(f"  {name} {shape} M={m}: {type(e).__name__}: {str(e)[:1500]}")
            stock = [row[c] for c in ("blockwise", "rowwise") if row.get(c)]
            if row["ours"] is None:
                continue
            row["ratio"] = min(stock) / row["ours"] if stock else None
            t = row["ours"] * 1e-6
            row["hbm"], row["tflops"] = n * k / t / PEAK_BW, 2 * m * n * k / t / 1e12
            rows.append(row)
            cells = " ".join(f"{row[c]:10.1f}" if row[c] else f"{'-':>10s}" for c in names)
            print(f"{shape:8s} {m:5d} {cells}  {row['ratio'] or 0:5.2f} {row['hbm']:5.0%} {row['tflops']:5.0f}",
                  flush=True)
            del sets


SWEEP = {  # name: kernel_config overrides (BLOCK_K is always the 128-column scale block); p = PAIRED, sN = stages,
    # rN = the two K runs in N programs (1: one program walks both; 2: a program each + the summing launch;
    # unset: the launcher's choice), swap = SWAP (the tile transposed: weight rows x tokens). Only K >= 64 blocks
    # has two runs: down_proj here. Swept on the tiled weight (what the engine holds).
    "16x64p_swap": dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, STAGES=4, TMA=False, PAIRED=True, SWAP=True),
    "16x64_s6_swap": dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, STAGES=6, TMA=False, PAIRED=False, SWAP=True),
    "64x128_s3": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, STAGES=3, TMA=False),
    "64x128_s2": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, STAGES=2, TMA=False),
    "64x64p_s2": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, STAGES=2, TMA=False, PAIRED=True),
    "64x64_s3": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, STAGES=3, TMA=False),
    "64x64tma_s3": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, STAGES=3, TMA=True),
    "64x128tma_s2": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, STAGES=2, TMA=True),
    "64x64p": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, STAGES=4, TMA=False, PAIRED=True),
    "64x64p_r1": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, STAGES=4, TMA=False, PAIRED=True, SPLIT=1),
    "64x64p_r2": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, STAGES=4, TMA=False, PAIRED=True, SPLIT=2),
    "64x64_r2": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, STAGES=4, TMA=False, PAIRED=False, SPLIT=2),
    "64x128tma": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, STAGES=4, TMA=True),
    "64x128tma_r2": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, STAGES=4, TMA=True, SPLIT=2),
    "64x64tma": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, STAGES=4, TMA=True),
    "64x64tma_r2": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, STAGES=4, TMA=True, SPLIT=2),
    "64x128tma_s3": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, STAGES=3, TMA=True),
    "64x128tma_w8": dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, STAGES=4, TMA=True),
    "64x128tmap_w8": dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, STAGES=3, TMA=True, PAIRED=True),
    "128x128tma_w8": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, STAGES=4, TMA=True),
    "128x128tma_w8_s3": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, STAGES=3, TMA=True),
    "128x128tma_w8_s2": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, STAGES=2, TMA=True),
    "128x64tma_w8": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, STAGES=4, TMA=True),
    "64x256tma_w8_s2": dict(BLOCK_M=64, BLOCK_N=256, num_warps=8, STAGES=2, TMA=True),
}


def bench_sweep(ms: list[int], rows: list, names: list[str]) -> None:
    """linear_fp8 under each named SWEEP config, to choose kernel_config's table (every config gives the same
    bits: asserted here too, against the first)."""
    from detinfer.kernels.fp8_linear import linear_fp8

    sweep = {name: SWEEP[name] for name in names}
    print("\nsweep (us, activation quantization included): " + "  ".join(sweep))
    for m in ms:
        for shape, (n, k) in SHAPES.items():
            sets = [operand_set(m, n, k, None) for _ in range(copies_for(n * k * 4 + m * k * 2))]
            warm_caches(sets)
            times, first = [], None
            for cfg in sweep.values():
                cfg = dict(cfg, BLOCK_K=128)
                try:
                    y = linear_fp8(sets[0][0], sets[0][8], sets[0][2], config=cfg)
                except Exception as e:  # noqa: BLE001 - e.g. a config whose stages do not fit shared memory
                    print(f"  {shape} M={m} {cfg}: {type(e).__name__}: {str(e)[:200]}")
                    times.append(float("inf"))
                    continue
                first = y if first is None else first
                if not torch.equal(y, first):
                    raise AssertionError(f"{shape} M={m}: config {cfg} changed the bits")
                fn = rotated(lambda x, q, s, *rest, c=cfg: linear_fp8(x, rest[-3], s, config=c), sets)
                times.append(graph_ms(fn) * 1e3)
            rows.append({"sweep": True, "shape": shape, "M": m, "us": dict(zip(sweep, times))})
            best = min(range(len(times)), key=times.__getitem__)
            print(f"{shape:8s} {m:5d} " + " ".join(f"{t:8.1f}" for t in times) + f"   best {list(sweep)[best]}",
                  flush=True)
            del sets


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="1,16,64,256,1024,4096")
    ap.add_argument("--old", default=None, help="directory holding old_fp8_linear.py (A/B against it)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", default=None, help="M values for a tile-config sweep of ours (e.g. 1,16,256,4096)")
    ap.add_argument("--configs", default=",".join(SWEEP), help="the SWEEP configs to sweep (comma list)")
    ap.add_argument("--sweep-only", action="store_true", help="skip the table against the stock paths")
    args = ap.parse_args()
    unknown = [c for c in args.configs.split(",") if c not in SWEEP]
    if unknown:
        print(f"--configs: unknown {unknown}; known: {', '.join(SWEEP)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_fp8 needs a CUDA GPU", file=sys.stderr)
        return 2
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    layout = probe_blockwise()
    old = None
    if args.old:
        sys.path.insert(0, args.old)
        old = importlib.import_module("old_fp8_linear")
    rows: list = []
    if args.sweep:
        bench_sweep([int(v) for v in args.sweep.split(",")], rows, args.configs.split(","))
    if not args.sweep_only:
        bench_gemm([int(v) for v in args.ms.split(",")], layout, old, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"blockwise_layout": layout, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
