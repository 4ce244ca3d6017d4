"""GPU: every candidate launch config of the batch-invariant matmul, timed at a model's per-rank decode shapes.

    PYTHONUNBUFFERED=1 python bench/sweep_matmul.py [--preset qwen3-8b] [--tp 1,2] [--ms 1,64] [--jobs 8]
                                                    [--shapes qkv,o,gate_up,down,lm_head] [--json FILE]

Shapes per rank at TP size t (H hidden, I intermediate, Hq / Hkv heads of width d, V vocab): qkv [K = H,
N = (Hq + 2 Hkv) d / t], o [K = Hq d / t, N = H], gate_up (the fused gate_up + SiLU*mul kernel, [K = H,
2I / t]), down [K = I / t, N = H], lm_head [K = H, N = V / t]. At t > 1, o and down write fp32 partials, as
the row-parallel layers do (at decode batch 1 those run on the pointer kernel: a TMA config does not apply
there, see kernels/peer_push.py).

For each (t, shape, M): the dispatcher's config, then every candidate of M's class (`candidates`), each as
microseconds per call (bench_ops.py's CUDA-graph timer, weights rotated past L2) and weight bytes / time as
a fraction of 3.0 TB/s; cuBLAS (F.linear, bf16 out) beside it for the plain shapes. Every candidate's output
is compared with the default config's bits (torch.equal): matmul_configs.py claims no config changes a bit,
and a candidate that does is reported and fails the run. What a table change is judged on is the whole
decode step (bench_e2e.py / bench_tp.py), not these isolated calls.

--jobs N: N processes first compile every candidate (into Triton's cache), so the timed pass does not compile.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from bench_ops import PEAK_BW, copies_for, graph_ms, rotated  # noqa: E402
from detinfer.kernels import linear_silu_mul as lsm  # noqa: E402
from detinfer.kernels import matmul as mm  # noqa: E402
from detinfer.kernels.matmul_configs import MatmulConfig as C  # noqa: E402
from detinfer.repro.random_model import preset_config  # noqa: E402

SMEM_LIMIT = 200 << 10  # bytes of pipelined operand tiles a candidate may stage (H100: 227 KB per SM)


def shapes(preset: str, tp: int) -> dict:
    """{name: (K, N, kind)} per rank; kind "linear" (bf16 out), "parts" (fp32 out), "swiglu" (N = 2I / t)."""
    c = preset_config(preset)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    row = "parts" if tp > 1 else "linear"
    return {"qkv": (c.hidden_size, (q + 2 * kv) // tp, "linear"), "o": (q // tp, c.hidden_size, row),
            "gate_up": (c.hidden_size, 2 * c.intermediate_size // tp, "swiglu"),
            "down": (c.intermediate_size // tp, c.hidden_size, row),
            "lm_head": (c.hidden_size, c.vocab_size // tp, "linear")}


def _staged(c: C, n_tiles: int) -> int:
    return c.num_stages * (c.block_m + n_tiles * c.block_n) * c.block_k * 2


def candidates(m: int, kind: str) -> list[C]:
    """The configs tried for M rows (decode class: 16-row tiles; small class: 64-row tiles and a few
    shorter ones); for "swiglu" each is the fused kernel's own config (BLOCK_N per accumulator, two)."""
    out = []
    if m <= 16:
        out += [C(16, bn, bk, 4, st) for bn in (16, 32, 64, 128) for bk in (128, 256, 512) for st in (3, 4, 6, 8)]
        out += [C(16, bn, 256, 4, st, tma=True) for bn in (32, 64) for st in (4, 6)]
        out += [C(16, bn, 256, w, 6) for bn in (32, 64) for w in (2, 8)]
    else:
        out += [C(64, bn, bk, 4, st, tma=t) for bn in (32, 64, 128) for bk in (64, 128, 256) for st in (3, 4, 5)
                for t in (True, False)]
        out += [C(32, 64, 256, 4, 4, tma=True), C(32, 32, 256, 4, 6), C(16, 64, 256, 4, 6), C(16, 32, 256, 4, 6)]
    n_tiles = 2 if kind == "swiglu" else 1
    return [c for c in out if _staged(c, n_tiles) <= SMEM_LIMIT]


def _inputs(m: int, k: int, n: int) -> list:
    return [((torch.randn(m, k, device="cuda") * 0.5).bfloat16(), (torch.randn(n, k, device="cuda") / k**0.5)
             .bfloat16()) for _ in range(copies_for(n * k * 2 + m * k * 2))]


def _call(kind: str, cfg: C | None):
    """fn(x, w) -> output for one config (None: the dispatcher's, through the cached launch path)."""
    if kind == "swiglu":
        return lambda x, w: lsm.linear_silu_mul(x, w, config=cfg)
    out_dtype = torch.float32 if kind == "parts" else torch.bfloat16

    def run(x, w):
        out = torch.empty(x.shape[0], w.shape[0], dtype=out_dtype, device=x.device)
        mm._launch(x[None], w.t()[None], None, out[None], cfg)
        return out
    return run


def default_config(kind: str, m: int, k: int, n: int) -> C:
    dev = torch.device("cuda")
    if kind == "swiglu":
        return lsm.fused_config(m, n // 2, k, torch.bfloat16, dev)
    cfg = mm._config(m, n, k, torch.bfloat16, dev)
    return mm.fit_to_output(cfg, 4 if kind == "parts" else 2, 2)


def cells(args) -> list:
    return [(tp, name, m) for tp in args.tp for name in args.shapes for m in args.ms]


def compile_part(args, part: int) -> None:
    """Run every (cell, candidate) of this part once: fills Triton's cache for the timed pass."""
    jobs = [(tp, name, m, c) for tp, name, m in cells(args)
            for c in candidates(m, shapes(args.preset, tp)[name][2])]
    for i, (tp, name, m, c) in enumerate(jobs):
        if i % args.jobs != part:
            continue
        k, n, kind = shapes(args.preset, tp)[name]
        x = torch.randn(m, k, device="cuda").bfloat16()
        w = torch.randn(n, k, device="cuda").bfloat16()
        _call(kind, c)(x, w)
    torch.cuda.synchronize()


def sweep_cell(tp: int, name: str, m: int, preset: str) -> dict:
    k, n, kind = shapes(preset, tp)[name]
    sets = _inputs(m, k, n)
    w_bytes = n * k * 2
    dflt = default_config(kind, m, k, n)
    want = _call(kind, None)(*sets[0])
    us = lambda fn: graph_ms(rotated(fn, sets), rep_ms=10.0, replays=5) * 1e3
    rows = [("default", dflt, us(_call(kind, None)))]
    mismatched = []
    for c in candidates(m, kind):
        if not torch.equal(_call(kind, c)(*sets[0]), want):
            mismatched.append(c.spec())
        rows.append(("candidate", c, us(_call(kind, c))))
    cublas = us(F.linear) if kind != "swiglu" else None
    best = min(rows[1:], key=lambda r: r[2])
    cell = {"tp": tp, "shape": name, "M": m, "K": k, "N": n, "kind": kind, "default": dflt.spec(),
            "default_us": rows[0][2], "best": best[1].spec(), "best_us": best[2], "cublas_us": cublas,
            "mismatched": mismatched,
            "all": [[c.spec(), t] for _, c, t in rows[1:]]}
    frac = lambda t: w_bytes / (t * 1e-6) / PEAK_BW
    top = sorted(rows[1:], key=lambda r: r[2])[:5]
    print(f"tp{tp} {name:8s} M={m:3d} K={k:5d} N={n:6d} {kind:6s} default {dflt.spec()} {rows[0][2]:7.1f} us "
          f"({frac(rows[0][2]):.2f}) | best {best[1].spec()} {best[2]:7.1f} us ({frac(best[2]):.2f})"
          + (f" | cuBLAS bf16 {cublas:7.1f} ({frac(cublas):.2f})" if cublas else ""), flush=True)
    print("      top 5: " + "; ".join(f"{c.spec()} {t:.1f}" for _, c, t in top), flush=True)
    if mismatched:
        print(f"      BITS DIFFER from the default for {mismatched}", flush=True)
    return cell


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--tp", default="1,2", help="TP sizes whose per-rank shapes are swept")
    ap.add_argument("--ms", default="1,64", help="rows per call (decode batch sizes)")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down,lm_head")
    ap.add_argument("--jobs", type=int, default=8, help="compile processes run before timing (0: none)")
    ap.add_argument("--compile-part", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.tp = [int(t) for t in args.tp.split(",")]
    args.ms = [int(m) for m in args.ms.split(",")]
    args.shapes = args.shapes.split(",")
    if not torch.cuda.is_available():
        sys.exit("sweep_matmul.py needs a CUDA GPU")
    if args.compile_part is not None:
        compile_part(args, args.compile_part)
        return
    if args.jobs > 0:
        base = [sys.executable, __file__, "--preset", args.preset, "--tp", ",".join(map(str, args.tp)),
                "--ms", ",".join(map(str, args.ms)), "--shapes", ",".join(args.shapes), "--jobs", str(args.jobs)]
        procs = [subprocess.Popen(base + ["--compile-part", str(p)]) for p in range(args.jobs)]
        if any(p.wait() for p in procs):
            sys.exit("a compile process failed (its error is above)")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; us per call, (weight bytes / time / "
          "3.0 TB/s)", flush=True)
    out, failed = [], False
    try:
        for tp, name, m in cells(args):
            out.append(sweep_cell(tp, name, m, args.preset))
            failed |= bool(out[-1]["mismatched"])
    finally:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    if failed:
        sys.exit("some candidate configs gave other bits than the default (listed above)")


if __name__ == "__main__":
    main()
