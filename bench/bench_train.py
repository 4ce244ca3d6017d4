"""GPU benchmark: a training step (forward + backward) on the engine's model, deterministic vs fast, and
each backward kernel against its stock counterpart.

    PYTHONUNBUFFERED=1 python bench/bench_train.py [--layers 2] [--seqs 8] [--seq-len 1024]
                                                   [--sections step,kernels] [--json FILE]

step     Qwen3-8B shapes truncated to --layers layers (full vocab 151936), bf16 weights, random ids,
         --seqs x --seq-len tokens packed: TrainableModel.score + backward of a weighted sum, in
         deterministic mode (engine kernels + fixed-order backward) and fast mode (F.linear / cuBLAS,
         SDPA, stock autograd). Reports ms per step and det / fast.
kernels  each backward kernel vs the stock op it replaces, at the step's shapes (T = seqs x seq_len):
         dW (weight_grad) vs dY^T @ X (cuBLAS), dX (invariant matmul) vs dY @ W (cuBLAS), attention
         backward vs SDPA's backward (flash; fwd+bwd minus fwd), RMSNorm / SiLU*mul / RoPE /
         log_softmax+gather / embedding backward vs stock autograd. Compute-bound kernels report the
         fraction of PEAK_FLOPS, memory-bound ones of PEAK_BW (bytes that must move: inputs read once,
         outputs written once).
Times: medians of triton.testing.do_bench (CUDA events, L2 flushed before each call).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

PEAK_BW = 3.0e12  # bytes/s, H100 SXM measured copy rate
PEAK_FLOPS = 770e12  # dense bf16 tensor-core FLOP/s reachable on the H100 (cuBLAS-class large GEMMs)


def bench(fn, warmup=3, rep=20) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def training_step(args) -> dict:
    from detinfer.train import TrainableModel
    from detinfer.train.testing import random_model

    model, cfg = random_model("qwen3-8b", layers=args.layers, device="cuda", dtype=torch.bfloat16, seed=0)
    g = torch.Generator(device="cuda").manual_seed(0)
    t = args.seqs * args.seq_len
    ids = torch.randint(0, cfg.vocab_size, (t,), device="cuda", generator=g)
    cu = [i * args.seq_len for i in range(args.seqs + 1)]
    w = torch.randn(t, device="cuda", generator=g)
    out = {}
    for mode in ("deterministic", "fast"):
        trainer = TrainableModel(model, mode=mode)

        def step():
            trainer.zero_grad()
            (trainer.score(ids, cu) * w).sum().backward()

        def fwd():
            with torch.no_grad():
                trainer.score(ids, cu)
        out[mode] = {"step_ms": bench(step, rep=10), "forward_ms": bench(fwd, rep=10)}
        print(f"step {mode:13s}: fwd+bwd {out[mode]['step_ms']:8.2f} ms   fwd only {out[mode]['forward_ms']:8.2f} "
              f"ms   ({args.layers} layers, {t} tokens)", flush=True)
        del trainer
        for p in model.parameters():
            p.grad = None
        torch.cuda.empty_cache()
    out["det_over_fast"] = out["deterministic"]["step_ms"] / out["fast"]["step_ms"]
    print(f"step det / fast = {out['det_over_fast']:.2f}x", flush=True)
    return out


def _row(name, ours_ms, stock_ms, flops=None, nbytes=None) -> dict:
    r = {"name": name, "ours_ms": ours_ms, "stock_ms": stock_ms, "stock_over_ours": stock_ms / ours_ms}
    extra = ""
    if flops:
        r["ours_flops_frac"] = flops / (ours_ms * 1e-3) / PEAK_FLOPS
        r["stock_flops_frac"] = flops / (stock_ms * 1e-3) / PEAK_FLOPS
        extra = f"  {r['ours_flops_frac']:.0%} / {r['stock_flops_frac']:.0%} of {PEAK_FLOPS / 1e12:.0f} TFLOP/s"
    if nbytes:
        r["ours_bw_frac"] = nbytes / (ours_ms * 1e-3) / PEAK_BW
        r["stock_bw_frac"] = nbytes / (stock_ms * 1e-3) / PEAK_BW
        extra = f"  {r['ours_bw_frac']:.0%} / {r['stock_bw_frac']:.0%} of {PEAK_BW / 1e12:.1f} TB/s"
    print(f"{name:34s} ours {ours_ms:8.3f} ms  stock {stock_ms:8.3f} ms  stock/ours {r['stock_over_ours']:5.2f}"
          + extra, flush=True)
    return r


def _grad_time(f, inputs, gout) -> float:
    """Time of autograd backward of f(*inputs) alone (forward done once, graph retained)."""
    out = f(*inputs)
    return bench(lambda: torch.autograd.grad(out, inputs, gout, retain_graph=True))


def kernels(args) -> list[dict]:
    from detinfer.kernels.attention import paged_attention  # noqa: F401  (import check: engine kernels present)
    from detinfer.kernels.attention_backward import attention_backward
    from detinfer.kernels.embedding_backward import embedding_backward_ref
    from detinfer.kernels.linear_backward import matmul_det, weight_grad
    from detinfer.kernels.log_softmax_backward import log_softmax_gather_backward_ref
    from detinfer.kernels.rmsnorm_backward import rms_norm_backward_ref
    from detinfer.kernels.rope_backward import rope_angles, rope_backward_ref
    from detinfer.kernels.silu_mul_backward import silu_mul_backward_ref

    dev, bf = "cuda", torch.bfloat16
    t = args.seqs * args.seq_len
    rows = []
    rn = lambda *s: torch.randn(*s, device=dev, dtype=bf)  # noqa: E731
    for name, (k, n) in {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576),
                         "down": (12288, 4096)}.items():
        dy, x, wt = rn(t, n), rn(t, k), rn(n, k)
        fl = 2.0 * t * n * k
        rows.append(_row(f"dW {name} [{n}x{k}] T={t}", bench(lambda: weight_grad(dy, x)),
                         bench(lambda: dy.t() @ x), flops=fl))
        rows.append(_row(f"dX {name} [{t}x{k}]", bench(lambda: matmul_det(dy, wt)), bench(lambda: dy @ wt), flops=fl))
        del dy, x, wt
    hq, hkv, d = 32, 8, 128
    q, do = rn(t, hq, d), rn(t, hq, d)
    k_, v_ = rn(t, hkv, d), rn(t, hkv, d)
    cu = [i * args.seq_len for i in range(args.seqs + 1)]
    scale = d ** -0.5
    qb = q.view(args.seqs, args.seq_len, hq, d).transpose(1, 2).detach().requires_grad_()
    kb = k_.view(args.seqs, args.seq_len, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, 1).detach() \
        .requires_grad_()
    vb = v_.view(args.seqs, args.seq_len, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, 1).detach() \
        .requires_grad_()
    ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
    out = ob.detach().transpose(1, 2).reshape(t, hq, d).contiguous()
    gb = do.view(args.seqs, args.seq_len, hq, d).transpose(1, 2)
    sdpa_bwd = bench(lambda: torch.autograd.grad(ob, (qb, kb, vb), gb, retain_graph=True))
    fwd_flops = 2 * 2 * args.seqs * args.seq_len ** 2 / 2 * d * hq  # causal: half of QK^T and PV
    rows.append(_row(f"attention bwd {args.seqs}x{args.seq_len} Hq{hq}/Hkv{hkv} D{d}",
                     bench(lambda: attention_backward(do, q, k_, v_, out, cu, scale)), sdpa_bwd,
                     flops=2.5 * fwd_flops))
    del qb, kb, vb, ob, gb
    h = 4096
    x, r, dy, dh = rn(t, h), rn(t, h), rn(t, h), rn(t, h)
    wn = (1 + 0.1 * torch.randn(h, device=dev)).to(bf)
    xs, rs, ws = (z.detach().requires_grad_() for z in (x, r, wn))

    def rms_stock(x, r, w):
        hh = x + r
        hf = hh.float()
        return w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(bf), hh
    ys = rms_stock(xs, rs, ws)
    rows.append(_row(f"rmsnorm+residual bwd [{t}x{h}]",
                     bench(lambda: rms_norm_backward_ref(dy, dh, x, r, wn, 1e-6)),
                     bench(lambda: torch.autograd.grad(ys, (xs, rs, ws), (dy, dh), retain_graph=True)),
                     nbytes=2 * t * h * 5))
    inter = 12288
    gt, up, dout = rn(t, inter), rn(t, inter), rn(t, inter)
    gs, us = gt.detach().requires_grad_(), up.detach().requires_grad_()
    rows.append(_row(f"silu*mul bwd [{t}x{inter}]", bench(lambda: silu_mul_backward_ref(dout, gt, up)),
                     _grad_time(lambda a, b: F.silu(a) * b, (gs, us), dout), nbytes=2 * t * inter * 5))
    pos = torch.arange(t, device=dev) % args.seq_len
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=dev).float() / d))
    cos, sin = rope_angles(pos, inv_freq)
    qs = q.detach().requires_grad_()

    def rope_stock(x):
        x1, x2 = x.float().chunk(2, -1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).to(bf)
    rows.append(_row(f"rope bwd [{t}x{hq}x{d}]", bench(lambda: rope_backward_ref(do, cos, sin, bf)),
                     _grad_time(rope_stock, (qs,), do), nbytes=2 * t * hq * d * 2))
    vocab = 151936
    logits = torch.randn(t, vocab, device=dev, dtype=torch.float32)
    tg = torch.randint(0, vocab, (t,), device=dev)
    lp_full = torch.log_softmax(logits, -1)
    gl = torch.randn(t, device=dev)
    ls = logits.detach().requires_grad_()
    rows.append(_row(f"log_softmax+gather bwd [{t}x{vocab}]",
                     bench(lambda: log_softmax_gather_backward_ref(gl, lp_full, tg)),
                     _grad_time(lambda z: torch.log_softmax(z, -1).gather(1, tg[:, None])[:, 0], (ls,), gl),
                     nbytes=t * vocab * 4 * 2))
    del logits, lp_full, ls
    emb = rn(vocab, h).requires_grad_()
    ids = torch.randint(0, vocab, (t,), device=dev)
    rows.append(_row(f"embedding bwd [{t} ids, {vocab}x{h}]", bench(lambda: embedding_backward_ref(dy, ids, vocab)),
                     _grad_time(lambda e: F.embedding(ids, e), (emb,), dy), nbytes=t * h * 2 + vocab * h * 4))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--sections", default="step,kernels")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_train.py needs a CUDA GPU")
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    result = {"args": vars(args)}
    sections = args.sections.split(",")
    if "step" in sections:
        result["step"] = training_step(args)
    if "kernels" in sections:
        result["kernels"] = kernels(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
