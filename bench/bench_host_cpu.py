"""CPU-side microbenchmark of the drop-in mode's host path, up to the kernel launch (no GPU needed).

    python bench/bench_host_cpu.py [--calls 3000] [--src PATH]

Every Triton kernel (and every launch cache) is replaced by a stub that only counts launches, so what is
timed is detinfer's Python from the aten override to the launch: dispatch into the override, `AtenImpls`,
`Ops`, the launcher's checks, allocation and launch-key work. Tensors are small fp32 CPU ones run
"through the kernels" (`batch_invariant(cpu_triton=True)` under TRITON_INTERPRET=1), so the CPU-only
checks (the interpreter switch, CPU-device validation) are included: the numbers bound the CUDA path's
Python from above, they are not its cost. Triton's own launch (`JITFunction.run` or a direct launch) is
excluded: measure it on the GPU (`bench_ops.py --sections host`). Process CPU time, best of 7 repeats.
`--src` times another checkout's sources (to compare before and after a change in one session).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import timeit

os.environ["TRITON_INTERPRET"] = "1"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--src", default=os.path.join(os.path.dirname(__file__), "..", "src"))
    args = ap.parse_args()
    sys.path.insert(0, args.src)
    import torch
    import torch.nn.functional as F

    import detinfer
    from detinfer.kernels import matmul, reduce, rmsnorm, softmax
    from detinfer.ops import Ops

    torch.set_num_threads(1)
    launches = [0]

    class Stub:
        def __getitem__(self, grid):
            def launch(*a, **k):
                launches[0] += 1
            return launch

    for mod in (matmul, reduce, rmsnorm, softmax):
        for name in dir(mod):
            obj = getattr(mod, name)
            if name.endswith("_kernel") and hasattr(obj, "__getitem__"):
                setattr(mod, name, Stub())
            elif hasattr(obj, "try_launch") and hasattr(obj, "kernel"):  # a launch cache (newer sources)
                obj.kernel = Stub()

    def per_call_us(fn) -> float:
        fn()
        return min(timeit.repeat(fn, number=args.calls, repeat=7, timer=time.process_time)) / args.calls * 1e6

    x, w, b = torch.randn(4, 64), torch.randn(96, 64), torch.randn(96)
    x3, s, h = torch.randn(1, 4, 64), torch.randn(1, 9, 4, 4), torch.randn(1, 4, 64)
    ops, wn = Ops("deterministic", "cpu", cpu_triton=True), torch.randn(64)
    cases = {
        "mode: F.linear 3-D (mm)": lambda: F.linear(x3, w),
        "mode: F.linear + bias (addmm)": lambda: F.linear(x, w, b),
        "mode: torch.mm": lambda: torch.mm(x, w.t()),
        "mode: softmax fp32": lambda: torch.softmax(s, -1, dtype=torch.float32),
        "mode: mean(-1, keepdim)": lambda: h.pow(2).mean(-1, keepdim=True),
        "Ops.linear": lambda: ops.linear(x, w),
        "Ops.rms_norm": lambda: ops.rms_norm(h[0], wn, 1e-6),
    }
    print(f"sources {os.path.abspath(args.src)}; torch {torch.__version__}")
    print(f"{'call':32s} {'stock us':>9s} {'detinfer us':>12s} {'launches':>9s}")
    for name, fn in cases.items():
        stock = per_call_us(fn) if name.startswith("mode:") else float("nan")
        with detinfer.batch_invariant(cpu_triton=True):
            before = launches[0]
            fn()
            n = launches[0] - before
            ours = per_call_us(fn)
        print(f"{name:32s} {stock:9.2f} {ours:12.2f} {n:9d}", flush=True)


if __name__ == "__main__":
    main()
