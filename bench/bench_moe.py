"""GPU benchmark: the batch-invariant fused MoE layer (kernels/moe.py `fused_moe`, deterministic mode) against
the stock path (`moe_stock`: HF-style loop, bf16 router, torch.topk, F.linear per hit expert, index_add_) and
fast mode's `moe_fast` (stock routing, the grouped GEMMs with a tile height chosen from M), on one
Qwen3-30B-A3B MoE layer (128 experts, top-8, hidden 2048, expert intermediate 768, bf16).

    PYTHONUNBUFFERED=1 python bench/bench_moe.py [--ms 1,4,16,64,2048,4096,8192] [--sweep] [--json FILE]

Times are medians of triton.testing.do_bench (CUDA events, L2 flushed before each call; the expert weights,
1.2 GB, do not fit in L2 anyway). Both sides are timed eagerly: the stock loop reads the hit experts on the
host, so it cannot be captured in a CUDA graph (ours can; its graph time is shown too). ratio = stock /
ours (>= 1: ours faster); fast_ratio = moe_fast / ours. Roofs (H100): decode reads the weights of the
experts the batch hits, E * (1 - (1 - k/E)^M) experts of 3 * I * H * 2 bytes, at 3.0 TB/s; prefill does
2 * M * k * 3 * I * H FLOPs at 770 TFLOP/s. `frac` = roof time / measured time.

Every row also checks the contract on the GPU: ours(x)[:1] == ours(x[:1]) and ours(x)[-5:] == ours(x[-5:])
bitwise. `--sweep` times other fixed (never M-dependent) tile configs, by replacing `expert_config`, and
reports whether their bits equal the default config's (the GPU's MMA order claim of matmul_configs.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from detinfer.kernels import moe  # noqa: E402

PEAK_BW, PEAK_FLOPS = 3.0e12, 770e12
E, H, INTER, TOP_K = 128, 2048, 768, 8
SWEEP = [(64, 64, 64, 4, 3), (64, 128, 64, 8, 3), (128, 64, 64, 8, 3), (32, 64, 128, 4, 4), (16, 64, 128, 4, 4),
         (128, 128, 64, 8, 3)]


def eager_ms(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def graph_ms(fn, n: int = 20) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / n)
    return sorted(times)[2]


def roof_ms(m: int) -> tuple[float, str]:
    hit = E * (1 - (1 - TOP_K / E) ** m)
    bw = hit * 3 * INTER * H * 2 / PEAK_BW * 1e3
    flops = 2 * m * TOP_K * 3 * INTER * H / PEAK_FLOPS * 1e3
    return (bw, "HBM") if bw >= flops else (flops, "FLOP")


def layer(seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = torch.bfloat16
    router = (torch.randn(E, H, generator=g, device="cuda") / H ** 0.5).to(dt)
    w13 = (torch.randn(E, 2 * INTER, H, generator=g, device="cuda") / H ** 0.5).to(dt)
    w2 = (torch.randn(E, H, INTER, generator=g, device="cuda") / INTER ** 0.5).to(dt)
    return router, w13, w2


def bench_row(m: int, weights, graph: bool) -> dict:
    router, w13, w2 = weights
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    ours = moe.fused_moe(x, router, w13, w2, TOP_K, True)
    invariant = torch.equal(ours[:1], moe.fused_moe(x[:1], router, w13, w2, TOP_K, True)) and torch.equal(
        ours[-5:], moe.fused_moe(x[-5:], router, w13, w2, TOP_K, True))
    stock = moe.moe_stock(x, router, w13, w2, TOP_K, True)
    err = (ours.float() - stock.float()).abs().max().item()
    t_ours = eager_ms(lambda: moe.fused_moe(x, router, w13, w2, TOP_K, True))
    t_stock = eager_ms(lambda: moe.moe_stock(x, router, w13, w2, TOP_K, True))
    t_fast = eager_ms(lambda: moe.moe_fast(x, router, w13, w2, TOP_K, True))
    roof, bound = roof_ms(m)
    row = {"M": m, "ours_ms": t_ours, "stock_ms": t_stock, "ratio": t_stock / t_ours, "fast_ms": t_fast,
           "fast_ratio": t_fast / t_ours, "roof_ms": roof,
           "bound": bound, "frac_ours": roof / t_ours, "frac_stock": roof / t_stock, "invariant": invariant,
           "max_abs_diff_vs_stock": err}
    if graph:
        row["ours_graph_ms"] = graph_ms(lambda: moe.fused_moe(x, router, w13, w2, TOP_K, True))
        row["frac_ours_graph"] = roof / row["ours_graph_ms"]
    return row


def sweep(ms: list[int], weights) -> list[dict]:
    router, w13, w2 = weights
    default = moe.expert_config
    rows = []
    for m in ms:
        x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
        ref = moe.fused_moe(x, router, w13, w2, TOP_K, True)
        for cfg in SWEEP:
            moe.expert_config = lambda n, k, dtype, device, c=cfg: moe.ExpertConfig(c)
            try:
                out = moe.fused_moe(x, router, w13, w2, TOP_K, True)
                t = eager_ms(lambda x=x: moe.fused_moe(x, router, w13, w2, TOP_K, True))
                rows.append({"M": m, "config": cfg, "ms": t, "same_bits_as_default": torch.equal(out, ref)})
            except Exception as e:  # a config that does not compile (registers, shared memory) is reported
                rows.append({"M": m, "config": cfg, "error": f"{type(e).__name__}: {str(e)[:120]}"})
            finally:
                moe.expert_config = default
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ms", default="1,4,16,64,2048,4096,8192")
    p.add_argument("--sweep", action="store_true", help="also time other fixed tile configs")
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph time of ours")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_moe needs a CUDA GPU")
    ms = [int(v) for v in args.ms.split(",")]
    weights = layer()
    print(f"{torch.cuda.get_device_name(0)}; Qwen3-30B-A3B MoE layer E={E} top-{TOP_K} H={H} I={INTER} bf16")
    print(f"{'M':>6} {'ours ms':>9} {'stock ms':>9} {'ratio':>6} {'fast ms':>9} {'f.ratio':>7} {'roof ms':>8} "
          f"{'bound':>5} {'frac ours':>9} {'frac stock':>10} {'graph ms':>9} {'inv':>4}")
    rows = []
    for m in ms:
        r = bench_row(m, weights, graph=not args.no_graph)
        rows.append(r)
        print(f"{m:>6} {r['ours_ms']:>9.4f} {r['stock_ms']:>9.4f} {r['ratio']:>6.2f} {r['fast_ms']:>9.4f} "
              f"{r['fast_ratio']:>7.2f} {r['roof_ms']:>8.4f} "
              f"{r['bound']:>5} {r['frac_ours']:>9.2f} {r['frac_stock']:>10.2f} "
              f"{r.get('ours_graph_ms', float('nan')):>9.4f} {'yes' if r['invariant'] else 'NO':>4}", flush=True)
    sweep_rows = sweep([64, 2048, 8192], weights) if args.sweep else []
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "rows": rows, "sweep": sweep_rows}, f, indent=1)
    if not all(r["invariant"] for r in rows):
        sys.exit("fused_moe was NOT batch-invariant on this GPU (see the inv column)")


if __name__ == "__main__":
    main()
