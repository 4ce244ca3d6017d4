"""GPU benchmark: detinfer's batch-invariant ops against the stock torch ops, side by side in one process.

    PYTHONUNBUFFERED=1 python bench/bench_ops.py [--sections linear,rmsnorm,log_softmax] [--json FILE]
                                                 [--timer events|graph]

linear       bf16 Llama-3-8B shapes x M in {1, 4, 16, 64, 256, 1024, 4096, 8192}: ours vs F.linear (cuBLAS)
rmsnorm      detinfer.kernels.rmsnorm.rms_norm vs torch's F.rms_norm, hidden 4096, rows {1, 64, 1024, 8192}
log_softmax  detinfer.kernels.softmax.log_softmax vs torch.log_softmax (bf16 in, fp32 out), vocab 128256 /
             151936, rows {1, 64, 1024, 8192}
A section whose module is missing is skipped with a message. Times are medians of triton.testing.do_bench
(CUDA events; it also flushes the L2 before each timed call); on top of that, inputs that fit in L2 are
rotated over several copies so that no repeated call can be served from cache. ratio = stock time / ours
(>= 1: ours is faster). Bandwidth fractions are of PEAK_BW (3.0 TB/s, the measured H100 copy rate).

--timer events (default) is do_bench: the host is in the loop, so for a kernel shorter than its own
launch cost on the host (plus do_bench's ~85 us L2 flush) the time includes host overhead; that is what
eager serving pays. --timer graph captures the calls in a CUDA graph (triton's do_bench_cudagraph,
no L2 flush; the rotation above keeps small inputs out of L2) and times replays: device time only, what
a CUDA-graph decode loop pays.
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

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

PEAK_BW = 3.0e12  # bytes/s: the H100's measured device-to-device copy rate (read + write)
LINEAR_SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
                 "lm_head": (4096, 128256)}  # (K, N) of Llama-3-8B
LINEAR_MS = [1, 4, 16, 64, 256, 1024, 4096, 8192]
ROWS = [1, 64, 1024, 8192]


def l2_bytes() -> int:
    return getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)


def copies_for(nbytes: int) -> int:
    """How many copies of an input set to rotate over: enough to cover 2x L2, or 1 if one set is bigger."""
    return 1 if nbytes >= l2_bytes() else min(32, math.ceil(2 * l2_bytes() / max(nbytes, 1)))


TIMER = {"mode": "events"}


def median_ms(fn) -> float:
    import triton

    if TIMER["mode"] == "graph":
        return triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median")
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def rotated(fn, sets):
    """A closure calling fn(*sets[i]) with i cycling, so consecutive calls touch different buffers."""
    state = {"i": 0}

    def call():
        args = sets[state["i"] % len(sets)]
        state["i"] += 1
        return fn(*args)
    return call


def try_import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as e:
        print(f"  (section skipped: cannot import {name}: {e})")
        return None


# ------------------------------------------------------------------------------------------- sections
def bench_linear(rows_out: list) -> None:
    mm = try_import("detinfer.kernels.matmul")
    if mm is None:
        return
    print("\n## linear, bf16 (ratio = F.linear time / ours; wBW = weight bytes / time / 3.0 TB/s)")
    print(f"{'shape':8s} {'M':>5s} {'ours us':>10s} {'cuBLAS us':>10s} {'ratio':>6s} {'ours wBW':>8s} "
          f"{'cub wBW':>8s} {'ours TF/s':>9s} {'cub TF/s':>9s}")
    for m in LINEAR_MS:
        for shape, (k, n) in LINEAR_SHAPES.items():
            w_bytes, x_bytes = n * k * 2, m * k * 2
            nw = copies_for(w_bytes + x_bytes)
            sets = [((torch.randn(m, k, device="cuda") * 0.5).bfloat16(),
                     (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()) for _ in range(nw)]
            y_ours, y_ref = mm.linear(*sets[0]), F.linear(*sets[0])
            rel = ((y_ours.float() - y_ref.float()).norm() / y_ref.float().norm()).item()
            if not rel < 1e-2:
                raise AssertionError(f"linear {shape} M={m}: ours differs from F.linear by {rel:.3g} (relative)")
            t_ours = median_ms(rotated(mm.linear, sets))
            t_ref = median_ms(rotated(F.linear, sets))
            flop = 2 * m * n * k
            row = {"section": "linear", "shape": shape, "M": m, "ours_us": t_ours * 1e3, "stock_us": t_ref * 1e3,
                   "ratio": t_ref / t_ours, "ours_wbw": w_bytes / (t_ours * 1e-3) / PEAK_BW,
                   "stock_wbw": w_bytes / (t_ref * 1e-3) / PEAK_BW, "ours_tflops": flop / t_ours / 1e9,
                   "stock_tflops": flop / t_ref / 1e9, "copies": nw}
            rows_out.append(row)
            bw = (f"{row['ours_wbw']:8.2f} {row['stock_wbw']:8.2f}" if m <= 64 else f"{'':8s} {'':8s}")
            print(f"{shape:8s} {m:5d} {row['ours_us']:10.1f} {row['stock_us']:10.1f} {row['ratio']:6.3f} {bw} "
                  f"{row['ours_tflops']:9.1f} {row['stock_tflops']:9.1f}", flush=True)
            del sets, y_ours, y_ref


def bench_rmsnorm(rows_out: list) -> None:
    rn = try_import("detinfer.kernels.rmsnorm")
    if rn is None:
        return
    h, eps = 4096, 1e-6
    print("\n## rms_norm, bf16, hidden 4096 (BW = (x read + y write) / time / 3.0 TB/s)")
    print(f"{'rows':>5s} {'ours us':>9s} {'torch us':>9s} {'ratio':>6s} {'ours BW':>8s} {'torch BW':>8s}")
    for r in ROWS:
        nbytes = 2 * r * h * 2
        sets = [(torch.randn(r, h, device="cuda").bfloat16(), torch.rand(h, device="cuda").bfloat16())
                for _ in range(copies_for(nbytes))]
        ours = lambda x, w: rn.rms_norm(x, w, eps)
        stock = lambda x, w: F.rms_norm(x, (h,), w, eps)
        t_o, t_s = median_ms(rotated(ours, sets)), median_ms(rotated(stock, sets))
        row = {"section": "rmsnorm", "rows": r, "ours_us": t_o * 1e3, "stock_us": t_s * 1e3, "ratio": t_s / t_o,
               "ours_bw": nbytes / (t_o * 1e-3) / PEAK_BW, "stock_bw": nbytes / (t_s * 1e-3) / PEAK_BW}
        rows_out.append(row)
        print(f"{r:5d} {row['ours_us']:9.1f} {row['stock_us']:9.1f} {row['ratio']:6.3f} {row['ours_bw']:8.2f} "
              f"{row['stock_bw']:8.2f}", flush=True)


def bench_log_softmax(rows_out: list) -> None:
    sm = try_import("detinfer.kernels.softmax")
    if sm is None:
        return
    print("\n## log_softmax, bf16 in / fp32 out (BW = (2 + 4 bytes per element) / time / 3.0 TB/s)")
    print(f"{'vocab':>7s} {'rows':>5s} {'ours us':>9s} {'torch us':>9s} {'ratio':>6s} {'ours BW':>8s} "
          f"{'torch BW':>8s}")
    for v in (128256, 151936):
        for r in ROWS:
            nbytes = r * v * (2 + 4)
            sets = [((torch.randn(r, v, device="cuda") * 4).bfloat16(),) for _ in range(copies_for(nbytes))]
            ours = lambda x: sm.log_softmax(x, dim=-1, dtype=torch.float32)
            stock = lambda x: torch.log_softmax(x, dim=-1, dtype=torch.float32)
            t_o, t_s = median_ms(rotated(ours, sets)), median_ms(rotated(stock, sets))
            row = {"section": "log_softmax", "vocab": v, "rows": r, "ours_us": t_o * 1e3, "stock_us": t_s * 1e3,
                   "ratio": t_s / t_o, "ours_bw": nbytes / (t_o * 1e-3) / PEAK_BW,
                   "stock_bw": nbytes / (t_s * 1e-3) / PEAK_BW}
            rows_out.append(row)
            print(f"{v:7d} {r:5d} {row['ours_us']:9.1f} {row['stock_us']:9.1f} {row['ratio']:6.3f} "
                  f"{row['ours_bw']:8.2f} {row['stock_bw']:8.2f}", flush=True)
            del sets


SECTIONS = {"linear": bench_linear, "rmsnorm": bench_rmsnorm, "log_softmax": bench_log_softmax}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--json", default=None, help="also write every row to this JSON file")
    ap.add_argument("--timer", choices=("events", "graph"), default="events",
                    help="events: do_bench (host in the loop); graph: CUDA-graph replays (device time only)")
    args = ap.parse_args()
    TIMER["mode"] = args.timer
    if not torch.cuda.is_available():
        sys.exit("bench_ops.py needs a CUDA GPU (it times kernels against cuBLAS / torch's fused kernels)")
    import triton

    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}, "
          f"L2 {l2_bytes() >> 20} MiB, timer {args.timer}")
    rows: list = []
    try:
        for name in args.sections.split(","):
            if name not in SECTIONS:
                sys.exit(f"unknown section {name!r}; choose from {', '.join(SECTIONS)}")
            SECTIONS[name](rows)
    finally:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    lin = [r for r in rows if r["section"] == "linear"]
    if lin:
        worst = min(lin, key=lambda r: r["ratio"])
        print(f"\nlinear: worst ratio {worst['ratio']:.3f} ({worst['shape']} M={worst['M']}); "
              f"cells < 0.95: {sum(r['ratio'] < 0.95 for r in lin)}, < 0.85: {sum(r['ratio'] < 0.85 for r in lin)} "
              f"of {len(lin)}")


if __name__ == "__main__":
    main()
