"""`python -m detinfer.demo`: measure, on this machine, why LLM inference is nondeterministic and that
detinfer's batch-invariant mode fixes it. Every number printed is measured now, never quoted.

1. Order changes a floating-point sum: eight values, 10,000 shuffles, count the distinct sums.
2. The same row through a matmul alone vs inside a batch (the "1669" demo): stock vs invariant mode.
3. A linear layer over batch sizes M: does row 0 change with M? stock vs invariant mode.
"""

from __future__ import annotations

import argparse
import random
import struct

import torch
import torch.nn.functional as F

import detinfer
from detinfer.cli_util import Parser

SHUFFLE_VALUES = [1e-10, 1e-5, 1e-2, 1.0, -1e-10, -1e-5, -1e-2, -1.0]


def shuffled_sums(n_shuffles: int = 10_000, seed: int = 42) -> dict[str, int]:
    """Distinct left-to-right sums of the 8 values over `n_shuffles` in-place shuffles.

    An explicit loop is used, not Python's built-in sum(): since Python 3.12 sum() of floats uses
    compensated (Neumaier) summation, which hides exactly the order dependence this demo is about.
    """
    def to_f32(x: float) -> float:
        return struct.unpack("f", struct.pack("f", x))[0]

    random.seed(seed)
    vals = list(SHUFFLE_VALUES)
    seen64, seen32 = set(), set()
    for _ in range(n_shuffles):
        random.shuffle(vals)
        acc64, acc32 = 0.0, 0.0
        for v in vals:
            acc64 += v
            acc32 = to_f32(acc32 + to_f32(v))  # round after every add, as float32 hardware does
        seen64.add(acc64)
        seen32.add(acc32)
    return {"float64": len(seen64), "float32": len(seen32)}


def _matmul_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.mm(a[:1], b) - torch.mm(a, b)[:1]).abs().max().item()


def matmul_demo(device: torch.device) -> tuple[tuple[int, int, int], float, float]:
    """|mm(a[:1], b) - mm(a, b)[:1]|.max(), stock and under the mode (fp32 linspace inputs)."""
    # Full size on a GPU; on a CPU the invariant path is a fold of elementwise products, so keep it small.
    m, k, n = (2048, 4096, 4096) if device.type == "cuda" else (64, 512, 512)
    a = torch.linspace(-1000, 1000, m * k, device=device).reshape(m, k)
    b = torch.linspace(-1000, 1000, k * n, device=device).reshape(k, n)
    stock = _matmul_gap(a, b)
    with detinfer.batch_invariant():
        ours = _matmul_gap(a, b)
    return (m, k, n), stock, ours


def linear_table(device: torch.device, dtype: torch.dtype, in_f: int, out_f: int, ms: list[int]):
    """Rows: (M, max|row0 in batch M - row0 alone| with stock kernels, the same under the mode)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(max(ms), in_f, generator=g).to(device, dtype)
    w = (torch.randn(out_f, in_f, generator=g) / in_f**0.5).to(device, dtype)

    def sweep():
        ref = F.linear(x[:1], w)
        return [(F.linear(x[:m], w)[:1] - ref).abs().max().item() for m in ms]

    stock = sweep()
    with detinfer.batch_invariant():
        ours = sweep()
    return list(zip(ms, stock, ours))


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="detinfer demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--shuffles", type=int, default=10_000, help="shuffles in the sum-order demo")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda requested but CUDA is not available")
    if args.shuffles < 1:
        p.error("--shuffles must be >= 1")
    print(f"detinfer {detinfer.__version__} demo on {device} (torch {torch.__version__})\n")

    counts = shuffled_sums(args.shuffles)
    print(f"1. Sum order. {args.shuffles:,} shuffles of {SHUFFLE_VALUES}, each summed left to right:")
    print(f"   distinct float64 sums: {counts['float64']}   distinct float32 sums: {counts['float32']}")
    print("   (Python >= 3.12's built-in sum() would print 1: it uses compensated summation.)\n")

    (m, k, n), stock, ours = matmul_demo(device)
    print(f"2. One row alone vs inside a batch: a=linspace(-1000,1000) [{m}x{k}], b [{k}x{n}], fp32")
    print(f"   |mm(a[:1], b) - mm(a, b)[:1]|.max()   stock: {stock:g}   batch_invariant: {ours:g}\n")

    if device.type == "cuda":
        dtype, in_f, out_f, ms = torch.bfloat16, 4096, 6144, [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]
    else:
        dtype, in_f, out_f, ms = torch.float32, 576, 1536, [1, 2, 4, 8, 16, 32, 64]
    print(f"3. F.linear {in_f}->{out_f} ({str(dtype).replace('torch.', '')}): max |row 0 in batch M - row 0 alone|")
    print(f"   {'M':>6} {'stock':>12} {'batch_invariant':>16}")
    for mm_, s, o in linear_table(device, dtype, in_f, out_f, ms):
        print(f"   {mm_:>6} {s:>12.3g} {o:>16.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
