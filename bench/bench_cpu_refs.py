"""CPU benchmark: the deterministic reference ops (`linear_ref`, `paged_attention_ref`) against stock torch.

    PYTHONUNBUFFERED=1 python bench/bench_cpu_refs.py [--sections linear,attention] [--threads N] [--repeat R]
                                                      [--before]

linear     SmolLM2-135M shapes (hidden 576, intermediate 1536, 9 x 64 query heads, 3 kv heads, vocab 49152),
           M in {1, 128}: `detinfer.kernels.matmul.linear_ref` vs `F.linear` (MKL / oneDNN).
attention  the same heads: a decode step of 20 sequences (kv lengths 64..160) and a 128-token prefill:
           `paged_attention_ref` vs `F.scaled_dot_product_attention` per sequence (stock has no paged
           kernel on CPU; the stock side is given contiguous keys, so it is an upper bound on stock speed).
ratio = stock time / ours (1 = as fast as stock). Times are medians of R timed calls after a warm-up call
(`linear_ref` rounds and caches a weight on its first call: that one-time cost is reported separately).
The machine's load average is printed: on shared cores these numbers move by 2x or more.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 576, 1536, 9, 3, 64, 49152
LINEAR_SHAPES = {"q/o": (HIDDEN, HIDDEN), "k/v": (HIDDEN, KV_HEADS * HEAD_DIM), "gate/up": (HIDDEN, INTER),
                 "down": (INTER, HIDDEN), "lm_head": (HIDDEN, VOCAB)}  # (K, N)


def median_s(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_linear(repeat: int, before: bool = False) -> None:
    from detinfer.kernels.matmul_ref import _ref_bnk, linear_ref

    print(f"{'shape':<10}{'M':>5}{'stock us':>11}{'ours us':>11}{'ratio':>8}{'first call ms':>15}"
          + (f"{'fold path us':>14}{'ratio':>8}" if before else ""))
    totals: dict[int, list[float]] = {}
    for name, (k, n) in LINEAR_SHAPES.items():
        w = torch.randn(n, k) * 0.05
        t0 = time.perf_counter()
        linear_ref(torch.randn(1, k), w)  # rounds and caches the weight
        first = time.perf_counter() - t0
        for m in (1, 128):
            x = torch.randn(m, k)
            stock = median_s(lambda x=x, w=w: F.linear(x, w), repeat)
            ours = median_s(lambda x=x, w=w: linear_ref(x, w), repeat)
            if name != "lm_head":
                totals.setdefault(m, [0.0, 0.0])
                mult = 2 if "/" in name else 1  # q and o, k and v, gate and up
                totals[m][0] += mult * stock
                totals[m][1] += mult * ours
            line = (f"{name:<10}{m:>5}{stock * 1e6:>11.0f}{ours * 1e6:>11.0f}{stock / ours:>8.2f}"
                    f"{first * 1e3 if m == 1 else float('nan'):>15.1f}")
            if before and not (name == "lm_head" and m > 1):
                # the previous CPU path (elementwise products + pairwise folds), still the float64 path
                fold = median_s(lambda x=x, w=w: _ref_bnk(x[None], w[None], None), max(1, repeat // 5))
                line += f"{fold * 1e6:>14.0f}{stock / fold:>8.3f}"
            print(line)
    for m, (stock, ours) in totals.items():
        print(f"one layer's 7 linears, M={m}: stock {stock * 1e3:.2f} ms, ours {ours * 1e3:.2f} ms, "
              f"ratio {stock / ours:.2f}")


def _paged(kv_lens, q_lens, block=16):
    blocks = [-(-kv // block) for kv in kv_lens]
    tables = torch.zeros(len(kv_lens), max(blocks), dtype=torch.int32)
    at = 0
    for s, nb in enumerate(blocks):
        tables[s, :nb] = torch.arange(at, at + nb, dtype=torch.int32)
        at += nb
    kc = torch.randn(at, block, KV_HEADS, HEAD_DIM)
    vc = torch.randn(at, block, KV_HEADS, HEAD_DIM)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), HEADS, HEAD_DIM)
    return q, kc, vc, tables, torch.tensor(kv_lens, dtype=torch.int32), cu


def _stock_attention(q, kc, vc, tables, kvl, cu):
    """F.scaled_dot_product_attention per sequence on contiguous keys gathered beforehand (not timed)."""
    bs = kc.shape[1]
    per_seq = []
    for s, kv in enumerate(kvl.tolist()):
        slots = (tables[s].long()[:, None] * bs + torch.arange(bs)).reshape(-1)[:kv]
        k = kc.reshape(-1, KV_HEADS, HEAD_DIM)[slots].repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
        v = vc.reshape(-1, KV_HEADS, HEAD_DIM)[slots].repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
        per_seq.append((int(cu[s]), int(cu[s + 1]), k.contiguous(), v.contiguous()))

    def run():
        for q0, q1, k, v in per_seq:
            qs = q[q0:q1].transpose(0, 1)
            mask = None if q1 - q0 == 1 else torch.ones(q1 - q0, k.shape[1], dtype=torch.bool).tril(
                k.shape[1] - (q1 - q0))
            F.scaled_dot_product_attention(qs, k, v, attn_mask=mask)
    return run


def bench_attention(repeat: int) -> None:
    from detinfer.kernels.attention_ref import paged_attention_ref

    cases = {"decode x20": ([64 + 5 * i for i in range(20)], [1] * 20), "prefill 128": ([128], [128])}
    print(f"{'case':<14}{'stock ms':>10}{'ours ms':>10}{'ratio':>8}")
    for name, (kv_lens, q_lens) in cases.items():
        args = _paged(kv_lens, q_lens)
        stock = median_s(_stock_attention(*args), repeat)
        ours = median_s(lambda args=args: paged_attention_ref(*args, HEAD_DIM ** -0.5), repeat)
        print(f"{name:<14}{stock * 1e3:>10.2f}{ours * 1e3:>10.2f}{stock / ours:>8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--sections", default="linear,attention")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--before", action="store_true", help="also time the previous fold-based linear path")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    for section in args.sections.split(","):
        print(f"\n== {section}")
        if section == "linear":
            bench_linear(args.repeat, args.before)
        else:
            bench_attention(args.repeat)


if __name__ == "__main__":
    main()
