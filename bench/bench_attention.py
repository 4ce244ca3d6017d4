"""Attention speed on the GPU: the decode and prefill tables of docs/performance.md ("Attention").

    PYTHONPATH=src python bench/bench_attention.py [--decode] [--prefill] [--sweep] [--json FILE]

Decode: q_len = 1, batch {1, 8, 64, 256} x kv_len {512, 4096, 32768}, 32 query / 8 kv heads, head_dim 128,
bf16, block_size 16 with shuffled physical blocks. Invariant `paged_attention` vs `paged_attention_fast`
(same kernel, split size picked per batch) vs F.scaled_dot_product_attention on contiguous KV. Times are
CUDA-graph replays (the engine captures decode), each replay running the op over R copies of the KV
(R * KV bytes >= 256 MB, so L2 does not serve repeat reads); bandwidth counts K and V bytes once.
Prefill: causal, sequences of 512..8k, 1k..16k tokens per step, vs SDPA's flash backend on the same
tokens (paged K/V already written; write_kv timed separately); CUDA-graph replays too (GPU time), plus
the invariant kernel timed eagerly (with the host's launch overhead).
--sweep adds the candidate configs (split size, split grouping) next to the defaults.
--quant adds, for an FP8 o_proj, the invariant kernel followed by the activation quantization launch o_proj
would run (`inv+q`) and the kernel quantizing its rows in its own store (`invq`, kernels/attention_quant.py).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch
import torch.nn.functional as F

from detinfer.kernels import attention as A
from detinfer.kernels.attention_quant import paged_attention_quantized
from detinfer.kernels.fp8_linear import quantize_activations_gpu
from detinfer.kernels.kv_write import write_kv

HQ, HKV, D, BS = 32, 8, 128, 16
PEAK_BW = 3.0e12
DTYPE = torch.bfloat16
SCALE = 1 / math.sqrt(D)


def graph_ms(fn, reps_per_graph: int, replays: int = 15) -> float:
    """Median ms per op call: fn(i) for i in range(reps_per_graph) captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(reps_per_graph):  # warm-up: compiles, allocates
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps_per_graph):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps_per_graph)
    del g
    return statistics.median(times)


def eager_ms(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def decode_cell(bs: int, kv: int, variants: dict) -> dict:
    kv_bytes = 2 * bs * kv * HKV * D * 2
    copies = max(1, min(16, math.ceil(256e6 / kv_bytes)))
    blocks_per_seq = kv // BS
    nblocks = copies * bs * blocks_per_seq
    gen = torch.Generator(device="cuda").manual_seed(0)
    k_cache = torch.randn((nblocks, BS, HKV, D), device="cuda", dtype=DTYPE, generator=gen)
    v_cache = torch.randn((nblocks, BS, HKV, D), device="cuda", dtype=DTYPE, generator=gen)
    perm = torch.randperm(nblocks, device="cuda", generator=gen).to(torch.int32)
    tables = perm.view(copies, bs, blocks_per_seq)
    q = torch.randn((bs, HQ, D), device="cuda", dtype=DTYPE, generator=gen)
    kv_lens = torch.full((bs,), kv, dtype=torch.int32, device="cuda")
    cu = torch.arange(bs + 1, dtype=torch.int32, device="cuda")
    row = {"bs": bs, "kv": kv, "copies": copies, "gbytes": kv_bytes / 1e9}
    common = dict(max_q_len=1, max_kv_len=kv, validate=False)
    for name, (fn, kw, tune) in variants.items():
        saved = dict(A._TUNE)
        A._TUNE.update(tune)
        try:
            row[name] = graph_ms(lambda i, fn=fn, kw=kw: fn(q, k_cache, v_cache, tables[i], kv_lens, cu, SCALE,
                                                          **common, **kw), copies)
        except Exception as e:  # keep the table going; the log says what failed
            print(f"  {name} bs={bs} kv={kv}: {type(e).__name__}: {str(e)[:200]}")
            row[name] = float("nan")
        finally:
            A._TUNE.clear()
            A._TUNE.update(saved)
    if kv_bytes * copies <= 20e9:
        q4 = q.view(bs, HQ, 1, D)
        kc = [torch.randn((bs, HKV, kv, D), device="cuda", dtype=DTYPE, generator=gen) for _ in range(copies)]
        vc = [torch.randn((bs, HKV, kv, D), device="cuda", dtype=DTYPE, generator=gen) for _ in range(copies)]
        try:
            row["sdpa"] = graph_ms(lambda i: F.scaled_dot_product_attention(q4, kc[i], vc[i], scale=SCALE,
                                                                            enable_gqa=True), copies)
        except Exception as e:
            print(f"  sdpa bs={bs} kv={kv}: {type(e).__name__}: {str(e)[:200]}")
            row["sdpa"] = float("nan")
    else:
        row["sdpa"] = float("nan")  # a contiguous copy would not fit next to the paged pool
    return row


def attention_then_quantize(*args, **kw):
    """What an FP8 o_proj got before kernels/attention_quant.py: the 16-bit rows, then its own quantization."""
    out = A.paged_attention(*args, **kw)
    return quantize_activations_gpu(out.view(out.shape[0], -1))


def decode_variants(sweep: bool, quant: bool) -> dict:
    v = {"inv": (A.paged_attention, {}, {}), "fast": (A.paged_attention_fast, {}, {})}
    if quant:
        v.update({"inv+q": (attention_then_quantize, {}, {}), "invq": (paged_attention_quantized, {}, {})})
    if sweep:
        v.update({
            "inv512": (A.paged_attention, {"split_size": 512}, {}),
            "inv_pp4": (A.paged_attention, {}, {"programs_per_sm": 4}),
            "inv_pp16": (A.paged_attention, {}, {"programs_per_sm": 16}),
        })
    return v


def print_decode(rows: list[dict], names: list[str]) -> None:
    print("\n| bs | kv_len | " + " | ".join(f"{n} us" for n in names) + " | sdpa us | inv BW frac | "
          "fast/inv | sdpa/inv |")
    print("|" + "---|" * (len(names) + 6))
    for r in rows:
        frac = r["gbytes"] * 1e9 / (r["inv"] * 1e-3) / PEAK_BW
        cells = " | ".join(f"{r[n] * 1e3:.1f}" for n in names)
        print(f"| {r['bs']} | {r['kv']} | {cells} | {r['sdpa'] * 1e3:.1f} | {frac:.2f} | "
              f"{r['fast'] / r['inv']:.2f} | {r['sdpa'] / r['inv']:.2f} |")


def prefill_cell(n: int, length: int, sweep: bool, quant: bool) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(1)
    t = n * length
    k = torch.randn((t, HKV, D), device="cuda", dtype=DTYPE, generator=gen)
    v = torch.randn((t, HKV, D), device="cuda", dtype=DTYPE, generator=gen)
    q = torch.randn((t, HQ, D), device="cuda", dtype=DTYPE, generator=gen)
    nblocks = t // BS
    k_cache = torch.empty((nblocks, BS, HKV, D), device="cuda", dtype=DTYPE)
    v_cache = torch.empty_like(k_cache)
    perm = torch.randperm(nblocks, device="cuda", generator=gen).to(torch.int32)
    tables = perm.view(n, length // BS)
    slots = (tables.to(torch.int64)[:, :, None] * BS + torch.arange(BS, device="cuda")).reshape(-1)
    kv_lens = torch.full((n,), length, dtype=torch.int32, device="cuda")
    cu = torch.arange(0, t + 1, length, dtype=torch.int32, device="cuda")
    row = {"n": n, "len": length, "tflop": 4 * n * HQ * D * length * (length + 1) / 2 / 1e12}
    row["write_kv"] = graph_ms(lambda i: write_kv(k, v, k_cache, v_cache, slots, validate=False), 1, 10)
    kw = dict(max_q_len=length, max_kv_len=length, validate=False)
    inv = lambda i: A.paged_attention(q, k_cache, v_cache, tables, kv_lens, cu, SCALE, **kw)  # noqa: E731
    row["inv"] = graph_ms(inv, 1, 10)
    row["inv_eager"] = eager_ms(lambda: inv(0))  # includes host launch overhead
    row["fast"] = graph_ms(lambda i: A.paged_attention_fast(q, k_cache, v_cache, tables, kv_lens, cu, SCALE,
                                                            **kw), 1, 10)
    for name, fn in (("inv+q", attention_then_quantize), ("invq", paged_attention_quantized)) if quant else ():
        row[name] = graph_ms(lambda i, fn=fn: fn(q, k_cache, v_cache, tables, kv_lens, cu, SCALE, **kw), 1, 10)
    if sweep:
        row["inv512"] = graph_ms(lambda i: A.paged_attention(q, k_cache, v_cache, tables, kv_lens, cu, SCALE,
                                                             split_size=512, **kw), 1, 10)
    q4 = q.view(n, length, HQ, D).transpose(1, 2)
    k4 = k.view(n, length, HKV, D).transpose(1, 2)
    v4 = v.view(n, length, HKV, D).transpose(1, 2)
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def flash(i):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=SCALE, enable_gqa=True)

        row["sdpa_flash"] = graph_ms(flash, 1, 10)
    except Exception as e:
        print(f"  sdpa flash n={n} len={length}: {type(e).__name__}: {str(e)[:200]}")
        row["sdpa_flash"] = float("nan")
    return row


def print_prefill(rows: list[dict], names: list[str]) -> None:
    print("\n| seqs x len | tokens | " + " | ".join(f"{n} ms" for n in names) + " | sdpa flash ms | "
          "inv TFLOP/s | flash/inv | fast/inv | write_kv ms |")
    print("|" + "---|" * (len(names) + 7))
    for r in rows:
        cells = " | ".join(f"{r[n]:.3f}" for n in names)
        print(f"| {r['n']} x {r['len']} | {r['n'] * r['len']} | {cells} | {r['sdpa_flash']:.3f} | "
              f"{r['tflop'] / (r['inv'] * 1e-3):.0f} | {r['sdpa_flash'] / r['inv']:.2f} | "
              f"{r['fast'] / r['inv']:.2f} | {r['write_kv']:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("--prefill", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time candidate configs")
    ap.add_argument("--quant", action="store_true", help="also the rows quantized for an FP8 o_proj")
    ap.add_argument("--json", help="write all numbers here")
    args = ap.parse_args()
    both = not (args.decode or args.prefill)
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"split_size {A.DEFAULT_SPLIT_SIZE}, tune {A._TUNE}")
    out = {}
    if args.decode or both:
        variants = decode_variants(args.sweep, args.quant)
        rows = []
        for bs in (1, 8, 64, 256):
            for kv in (512, 4096, 32768):
                rows.append(decode_cell(bs, kv, variants))
                torch.cuda.empty_cache()
                print(f"  decode bs={bs} kv={kv}: " + ", ".join(
                    f"{k}={v * 1e3:.1f}us" for k, v in rows[-1].items() if k in variants or k == "sdpa"),
                    flush=True)
        out["decode"] = rows
        print_decode(rows, list(variants))
    if args.prefill or both:
        rows = []
        for n, length in ((2, 512), (8, 512), (1, 1024), (4, 1024), (16, 1024), (2, 2048), (1, 4096),
                          (4, 4096), (2, 8192)):
            rows.append(prefill_cell(n, length, args.sweep, args.quant))
            torch.cuda.empty_cache()
            print(f"  prefill {n}x{length}: " + ", ".join(f"{k}={v:.3f}" for k, v in rows[-1].items()
                                                          if isinstance(v, float)), flush=True)
        out["prefill"] = rows
        names = ["inv", "inv_eager", "fast"] + (["inv+q", "invq"] if args.quant else []) + \
            (["inv512"] if args.sweep else [])
        print_prefill(rows, names)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
