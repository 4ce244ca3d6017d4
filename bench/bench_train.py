"""GPU benchmark: a training step (forward + backward) on the engine's model, deterministic vs fast, and
each backward kernel against its stock counterpart; or (--memory) the peak memory of a whole step.

    PYTHONUNBUFFERED=1 python bench/bench_train.py [--layers 2] [--seqs 8] [--seq-len 1024] [--ragged]
                                                   [--sections step,kernels] [--json FILE]
    PYTHONUNBUFFERED=1 python bench/bench_train.py --memory [--random-model qwen3-4b] [--tokens 8x1024]
        [--score-fraction 1.0] [--no-checkpointing] [--offload-optimizer] [--mode deterministic] [--layers N]

memory   a random model of a real shape (all its layers unless --layers), bf16 weights with fp32 masters:
         score (only each sequence's scored tail) + backward + clip_grad_norm_ + AdamW (fused, or
         OffloadedAdamW) + push_weights + the weights fingerprint, --memory-steps times; prints the
         prediction of `predict_memory` (from shapes alone), the measured peak allocated / reserved
         bytes, and the headroom left on the GPU. Goal: Qwen3-4B shapes at 8 x 1024 tokens with >= 10%
         headroom on one 80 GB H100 (docs/training.md, "Memory").

step     Qwen3-8B shapes truncated to --layers layers (full vocab 151936), bf16 weights, random ids,
         --seqs x --seq-len tokens packed: TrainableModel.score + backward of a weighted sum, in
         deterministic mode (engine kernels + fixed-order backward, the output layer in row chunks
         recomputed in backward), fast mode (F.linear / cuBLAS, stock autograd including the output layer
         over all rows, attention over the whole packed batch in one call: torch's varlen flash attention
         where available), fast mode with TrainableModel's default chunked output layer (the memory saving;
         its cost: a recompute of the output layer's forward and a read-modify-write of the fp32 [V, H] dW
         per 512-row chunk) and fast mode with one SDPA call per sequence (the old, weaker baseline).
         Also deterministic with the unchunked head (logprob_chunk_rows=None: the [M, V] logits kept for
         backward, as the fast arm keeps them): the like-for-like det / fast.
         Reports ms per step, det / fast, per-sequence / batched and chunked head / stock head. RL-shaped
         batches: --seqs 128 --seq-len 64 --ragged.
kernels  each backward kernel vs the stock op it replaces, at the step's shapes (T = seqs x seq_len):
         dW (weight_grad) vs dY^T @ X (cuBLAS), dX (invariant matmul) vs dY @ W (cuBLAS), attention
         backward vs SDPA's backward (flash; fwd+bwd minus fwd), RMSNorm / SiLU*mul / RoPE /
         log_softmax+gather / embedding backward vs stock autograd (RMSNorm, SiLU*mul and embedding: the
         Triton kernels, each followed by a "torch ref" row timing its pure-torch reference against the
         same stock time). Compute-bound kernels report the
         fraction of PEAK_FLOPS, memory-bound ones of PEAK_BW (bytes that must move: inputs read once,
         outputs written once).
Times: medians of triton.testing.do_bench (CUDA events, L2 flushed before each call).

Prediction (written before any GPU run), H100, defaults (2 layers, 8 x 1024 tokens): the step is
matmul-bound (~17 TFLOP forward, ~33 backward, the 151936-wide lm_head being 60% of it); fast ~90-110 ms;
deterministic 1.3-1.6x fast: the invariant forward matmul runs at ~80-90% of cuBLAS, `weight_grad` (a
plain non-persistent 128x128x64 tile loop) at ~60-75% of cuBLAS, the attention backward (8 tile matmuls
per tile pair vs FA2's 5, two kernels) at ~40-60% of SDPA's, and the elementwise backwards in pure torch
(fold_sum passes) at 20-50% of HBM bandwidth.
Prediction for the Triton elementwise backwards (written before their first GPU run): SiLU*mul 70-85% of
PEAK_BW (one pass, 16-byte accesses), RMSNorm+residual 55-75% (one pass, but one program walks 16 rows in
turn and writes dx twice), embedding 60-80% (its time is mostly the zero fill of the fp32 [V, D] dW).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

DEV, DT = "cuda", torch.bfloat16
# Qwen3-8B: hidden, intermediate, q heads, kv heads, head_dim, vocab (--smoke: a tiny CPU stand-in)
SHAPE = dict(h=4096, inter=12288, hq=32, hkv=8, d=128, vocab=151936)
PEAK_BW = 3.0e12  # bytes/s, H100 SXM measured copy rate
PEAK_FLOPS = 770e12  # dense bf16 tensor-core FLOP/s reachable on the H100 (cuBLAS-class large GEMMs)


def bench(fn, warmup=3, rep=20) -> float:
    if DEV != "cuda":  # --smoke on CPU: one call, wall clock (checks the code runs, not the speed)
        import time

        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def training_step(args) -> dict:
    from detinfer.train import TrainableModel
    from detinfer.train.testing import random_model

    model, cfg = random_model(args.shape, layers=args.layers, device=DEV, dtype=DT, seed=0)
    g = torch.Generator(device=DEV).manual_seed(0)
    lens = [args.seq_len] * args.seqs
    if args.ragged:  # RL-like: completions end early; lengths uniform in [seq_len / 2, seq_len], seeded
        lens = torch.randint(args.seq_len // 2, args.seq_len + 1, (args.seqs,), generator=torch.Generator()
                             .manual_seed(0)).tolist()
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    t = cu[-1]
    ids = torch.randint(0, cfg.vocab_size, (t,), device=DEV, generator=g)
    w = torch.randn(t, device=DEV, generator=g)
    out = {}
    # fast: stock autograd throughout (the stock output layer over all rows: logprob_chunk_rows=None) and
    # stock attention over the whole packed batch in one call (varlen flash attention where torch has it);
    # fast-chunked-head: fast with TrainableModel's default output layer (row chunks recomputed in backward,
    # the memory saving deterministic mode always runs); fast-per-sequence: one SDPA call per sequence, the
    # baseline measured before the batched one
    # deterministic-unchunked-head: deterministic with logprob_chunk_rows=None (the [M, V] logits kept for
    # backward as the fast arm keeps them; the chunked head's bits): det / fast like for like
    arms = {"deterministic": {}, "deterministic-unchunked-head": {"logprob_chunk_rows": None},
            "fast": {"mode": "fast", "logprob_chunk_rows": None},
            "fast-chunked-head": {"mode": "fast"},
            "fast-per-sequence": {"mode": "fast", "fast_attention": "per-sequence", "logprob_chunk_rows": None}}
    for arm, kwargs in arms.items():
        trainer = TrainableModel(model, **kwargs)

        def step(trainer=trainer):
            trainer.zero_grad()
            (trainer.score(ids, cu) * w).sum().backward()

        def fwd(trainer=trainer):
            with torch.no_grad():
                trainer.score(ids, cu)
        out[arm] = {"step_ms": bench(step, rep=10), "forward_ms": bench(fwd, rep=10),
                    "attention": trainer.fast_attention or "paged (engine kernels)"}
        print(f"step {arm:28s}: fwd+bwd {out[arm]['step_ms']:8.2f} ms   fwd only {out[arm]['forward_ms']:8.2f} "
              f"ms   ({args.layers} layers, {args.seqs} seqs, {t} tokens, attention "
              f"{out[arm]['attention']})", flush=True)
        trainer.close()
        del trainer
        for p in model.parameters():
            p.grad = None
        torch.cuda.empty_cache()
    out["det_over_fast"] = out["deterministic"]["step_ms"] / out["fast"]["step_ms"]
    out["det_unchunked_over_fast"] = out["deterministic-unchunked-head"]["step_ms"] / out["fast"]["step_ms"]
    out["per_sequence_over_batched"] = out["fast-per-sequence"]["step_ms"] / out["fast"]["step_ms"]
    out["chunked_head_over_stock"] = out["fast-chunked-head"]["step_ms"] / out["fast"]["step_ms"]
    print(f"step det / fast (batched) = {out['det_over_fast']:.2f}x, unchunked heads both "
          f"{out['det_unchunked_over_fast']:.2f}x (goal <= 1.10)   fast per-sequence / batched = "
          f"{out['per_sequence_over_batched']:.2f}x   fast chunked head / stock head = "
          f"{out['chunked_head_over_stock']:.2f}x", flush=True)
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


def _rn(*shape):
    return torch.randn(*shape, device=DEV, dtype=DT)


def _linear_rows(t: int) -> list[dict]:
    from detinfer.kernels.linear_backward import matmul_det, weight_grad

    rows = []
    h, i, q, kv = SHAPE["h"], SHAPE["inter"], SHAPE["hq"] * SHAPE["d"], SHAPE["hkv"] * SHAPE["d"]
    for name, (k, n) in {"qkv": (h, q + 2 * kv), "o": (q, h), "gate_up": (h, 2 * i), "down": (i, h)}.items():
        dy, x, wt = _rn(t, n), _rn(t, k), _rn(n, k)
        fl = 2.0 * t * n * k
        rows.append(_row(f"dW {name} [{n}x{k}] T={t}", bench(lambda dy=dy, x=x: weight_grad(dy, x)),
                         bench(lambda dy=dy, x=x: dy.t() @ x), flops=fl))
        rows.append(_row(f"dX {name} [{t}x{k}]", bench(lambda dy=dy, wt=wt: matmul_det(dy, wt)),
                         bench(lambda dy=dy, wt=wt: dy @ wt), flops=fl))
    return rows


def _attention_rows(seqs: int, seq_len: int) -> list[dict]:
    """The backward recomputing the row LSEs, and reading the forward's (what the trainer runs)."""
    from detinfer.kernels.attention_backward import attention_backward

    t, hq, hkv, d = seqs * seq_len, SHAPE["hq"], SHAPE["hkv"], SHAPE["d"]
    q, do, k, v = _rn(t, hq, d), _rn(t, hq, d), _rn(t, hkv, d), _rn(t, hkv, d)
    cu = [i * seq_len for i in range(seqs + 1)]
    scale = d ** -0.5

    def heads_first(x, expand):
        x = x.view(seqs, seq_len, x.shape[1], d).transpose(1, 2)
        return (x.repeat_interleave(hq // hkv, 1) if expand else x).detach().requires_grad_()
    qb, kb, vb = heads_first(q, False), heads_first(k, True), heads_first(v, True)
    ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
    out = ob.detach().transpose(1, 2).reshape(t, hq, d).contiguous()
    gb = do.view(seqs, seq_len, hq, d).transpose(1, 2)
    stock = bench(lambda: torch.autograd.grad(ob, (qb, kb, vb), gb, retain_graph=True))
    fwd_flops = 2 * 2 * seqs * seq_len ** 2 / 2 * d * hq  # causal: half of QK^T and of PV
    # The forward's LSE (log2 units of the scaled scores, paged_attention's lse_out), one sequence at a time.
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).tril()
    lse = torch.cat([torch.logsumexp(((qb[i].float() @ kb[i].float().transpose(1, 2)) * scale)
                                     .masked_fill(~causal, float("-inf")), -1).T / math.log(2)
                     for i in range(seqs)]).detach().contiguous()
    name = f"attention bwd {seqs}x{seq_len} Hq{hq}/Hkv{hkv} D{d}"
    return [_row(f"{name} (LSE recomputed)", bench(lambda: attention_backward(do, q, k, v, out, cu, scale)),
                 stock, flops=2.5 * fwd_flops),
            _row(f"{name} (forward's LSE)", bench(lambda: attention_backward(do, q, k, v, out, cu, scale, lse=lse)),
                 stock, flops=2.5 * fwd_flops)]


def _norm_act_rope_rows(t: int, seq_len: int) -> list[dict]:
    from detinfer.kernels.rmsnorm_backward import rms_norm_backward, rms_norm_backward_ref
    from detinfer.kernels.rope_backward import rope_angles, rope_backward_ref
    from detinfer.kernels.silu_mul_backward import silu_mul_backward, silu_mul_backward_ref

    bf, h, inter, hq, d = DT, SHAPE["h"], SHAPE["inter"], SHAPE["hq"], SHAPE["d"]
    x, r, dy, dh = _rn(t, h), _rn(t, h), _rn(t, h), _rn(t, h)
    wn = (1 + 0.1 * torch.randn(h, device=DEV)).to(bf)
    xs, rs, ws = (z.detach().requires_grad_() for z in (x, r, wn))
    hh = xs + rs
    hf = hh.float()
    ys = (ws * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(bf), hh)
    # bytes that must move: dy, dh, x, residual read, dx written once (the kernel also writes dresidual,
    # a separate tensor, so its ceiling is 5/6 of PEAK_BW)
    rms_stock = bench(lambda: torch.autograd.grad(ys, (xs, rs, ws), (dy, dh), retain_graph=True))
    rows = [_row(f"rmsnorm+residual bwd [{t}x{h}]", bench(lambda: rms_norm_backward(dy, dh, x, r, wn, 1e-6)),
                 rms_stock, nbytes=2 * t * h * 5),
            _row(f"  torch ref [{t}x{h}]", bench(lambda: rms_norm_backward_ref(dy, dh, x, r, wn, 1e-6)),
                 rms_stock, nbytes=2 * t * h * 5)]
    gt, up, dout = _rn(t, inter), _rn(t, inter), _rn(t, inter)
    gs, us = gt.detach().requires_grad_(), up.detach().requires_grad_()
    silu_stock = _grad_time(lambda a, b: F.silu(a) * b, (gs, us), dout)
    rows.append(_row(f"silu*mul bwd [{t}x{inter}]", bench(lambda: silu_mul_backward(dout, gt, up)), silu_stock,
                     nbytes=2 * t * inter * 5))
    rows.append(_row(f"  torch ref [{t}x{inter}]", bench(lambda: silu_mul_backward_ref(dout, gt, up)), silu_stock,
                     nbytes=2 * t * inter * 5))
    pos = torch.arange(t, device=DEV) % seq_len
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=DEV).float() / d))
    cos, sin = rope_angles(pos, inv_freq)
    dq = _rn(t, hq, d)
    qs = _rn(t, hq, d).requires_grad_()

    def rope_stock(z):
        z1, z2 = z.float().chunk(2, -1)
        return torch.cat((z1 * cos - z2 * sin, z2 * cos + z1 * sin), -1).to(bf)
    rows.append(_row(f"rope bwd [{t}x{hq}x{d}]", bench(lambda: rope_backward_ref(dq, cos, sin, bf)),
                     _grad_time(rope_stock, (qs,), dq), nbytes=2 * t * hq * d * 2))
    return rows


def _vocab_rows(t: int) -> list[dict]:
    from detinfer.kernels.embedding_backward import embedding_backward, embedding_backward_ref
    from detinfer.kernels.log_softmax_backward import log_softmax_gather_backward_ref

    vocab, h = SHAPE["vocab"], SHAPE["h"]
    logits = torch.randn(t, vocab, device=DEV, dtype=torch.float32)
    tg = torch.randint(0, vocab, (t,), device=DEV)
    lp_full = torch.log_softmax(logits, -1)
    gl = torch.randn(t, device=DEV)
    ls = logits.requires_grad_()
    rows = [_row(f"log_softmax+gather bwd [{t}x{vocab}]",
                 bench(lambda: log_softmax_gather_backward_ref(gl, lp_full, tg)),
                 _grad_time(lambda z: torch.log_softmax(z, -1).gather(1, tg[:, None])[:, 0], (ls,), gl),
                 nbytes=t * vocab * 4 * 2)]
    emb = _rn(vocab, h).requires_grad_()
    ids = torch.randint(0, vocab, (t,), device=DEV)
    dy = _rn(t, h)
    emb_stock, emb_bytes = _grad_time(lambda e: F.embedding(ids, e), (emb,), dy), t * h * 2 + vocab * h * 4
    rows.append(_row(f"embedding bwd [{t} ids, {vocab}x{h}]", bench(lambda: embedding_backward(dy, ids, vocab)),
                     emb_stock, nbytes=emb_bytes))
    rows.append(_row(f"  torch ref [{t} ids]", bench(lambda: embedding_backward_ref(dy, ids, vocab)), emb_stock,
                     nbytes=emb_bytes))
    return rows


def kernels(args) -> list[dict]:
    t = args.seqs * args.seq_len
    rows = _linear_rows(t)
    torch.cuda.empty_cache()
    rows += _attention_rows(args.seqs, args.seq_len)
    torch.cuda.empty_cache()
    rows += _norm_act_rope_rows(t, args.seq_len)
    torch.cuda.empty_cache()
    rows += _vocab_rows(t)
    return rows


def predict_memory(cfg, params: int, seqs: int, seq_len: int, scored: int, checkpointing: bool,
                   offload: bool) -> dict:
    """The peak of one fwd + bwd + AdamW step, from shapes alone (bytes; bf16 engine, fp32 masters):
    state = bytes/param x params; saved = what autograd keeps from the forward for the backward;
    backward = the larger of one chunk of the output layer and one layer's recompute + its gradient
    temporaries; tied = the output layer's fp32 dW, held by autograd until the embedding's own gradient
    joins it at the end of the backward (tied embeddings only)."""
    from detinfer.train.logprobs import LOGPROB_CHUNK_ROWS
    from detinfer.train.optim import state_bytes_per_param

    t, h, i = seqs * seq_len, cfg.hidden_size, cfg.intermediate_size
    q, kv, layers, vocab = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, \
        cfg.num_hidden_layers, cfg.vocab_size
    # bytes per token that one layer's ops save (bf16): the norms' inputs and residuals (2 x 2H), the
    # qkv/gate_up inputs (2H), the qkv output (q + 2kv), the rotated q and k, the attention output (2q + kv),
    # gate_up's output (2I) and down's input (I). Checked against autograd's saved tensors on small models:
    # exact per layer, plus at most 4H bytes per token for the final norm and the output layer's input.
    per_layer = 2 * (6 * h + 3 * q + 3 * kv + 3 * i)
    layer_inputs = 2 * 2 * h  # h and residual: all a checkpointed layer keeps
    saved = t * (layers * (layer_inputs if checkpointing else per_layer) + 4 * h)
    chunk = min(scored, LOGPROB_CHUNK_ROWS) * vocab * 20  # bf16 + fp32 logits, log-dist, exp temp, dz, bf16 dy
    layer_bwd = 2 * t * per_layer if checkpointing else t * per_layer  # recomputed activations + grad temps
    tied = vocab * h * 4 if cfg.tie_word_embeddings else 0
    state = state_bytes_per_param(torch.bfloat16, offload_optimizer=offload) * params
    parts = {"state": state, "saved_activations": saved, "backward_transient": max(chunk, layer_bwd),
             "tied_output_grad": tied}
    parts["total"] = sum(parts.values())
    return parts


def _parse_tokens(text: str) -> tuple[int, int]:
    try:
        seqs, seq_len = (int(x) for x in text.lower().split("x"))
    except ValueError:
        sys.exit(f"--tokens takes SEQSxLEN, e.g. 8x1024, got {text!r}")
    if seqs < 1 or seq_len < 2:
        sys.exit(f"--tokens needs at least 1 sequence of at least 2 tokens, got {text!r}")
    return seqs, seq_len


def memory(args) -> dict:
    """Peak device memory of fwd + bwd + clip + AdamW + push_weights + fingerprint at the given shapes."""
    from detinfer.rl.metrics import weights_fingerprint
    from detinfer.train import TrainableModel
    from detinfer.train.optim import OffloadedAdamW, adamw
    from detinfer.train.testing import random_model

    seqs, seq_len = _parse_tokens(args.tokens)
    model, cfg = random_model(args.random_model, layers=args.layers, device=DEV, dtype=DT, seed=0)
    params = sum(p.numel() for p in model.parameters())
    trainer = TrainableModel(model, mode=args.mode, activation_checkpointing=not args.no_checkpointing)
    opt = (OffloadedAdamW if args.offload_optimizer else adamw)(trainer.parameters(), lr=1e-6)
    g = torch.Generator(device=DEV).manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (seqs * seq_len,), device=DEV, generator=g)
    cu = [k * seq_len for k in range(seqs + 1)]
    completion = max(1, int(round(args.score_fraction * (seq_len - 1))))  # scored: each sequence's tail
    positions = torch.tensor([a + seq_len - 1 - completion + j for a in cu[:-1] for j in range(completion)])
    w = torch.randn(positions.numel(), device=DEV, generator=g)
    predicted = predict_memory(cfg, params, seqs, seq_len, positions.numel(), not args.no_checkpointing,
                               args.offload_optimizer)
    gib = 2 ** 30
    print(f"memory {args.random_model} ({cfg.num_hidden_layers} layers, {params / 1e9:.3f}B params), "
          f"{seqs}x{seq_len} tokens, {positions.numel()} scored, {args.mode}, checkpointing "
          f"{'off' if args.no_checkpointing else 'on'}, optimizer {'offloaded' if args.offload_optimizer else 'adamw'}",
          flush=True)
    print("  predicted: " + ", ".join(f"{k} {v / gib:.2f} GiB" for k, v in predicted.items()), flush=True)
    cuda = DEV == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    out = {"params": params, "predicted_bytes": predicted, "steps": []}
    try:
        for step in range(args.memory_steps):
            trainer.zero_grad()
            (trainer.score(ids, cu, positions=positions) * w).sum().backward()
            torch.nn.utils.clip_grad_norm_(list(trainer.parameters()), 1.0)
            opt.step()
            trainer.push_weights()
            fp = weights_fingerprint(trainer.named_parameters())
            peak = torch.cuda.max_memory_allocated() if cuda else None
            out["steps"].append({"peak_allocated": peak, "fingerprint": fp})
            print(f"  step {step}: peak allocated {peak / gib if cuda else float('nan'):.2f} GiB  weights {fp}",
                  flush=True)
    except torch.OutOfMemoryError as e:
        out["error"] = f"out of memory: {str(e).splitlines()[0]}"
        print("  " + out["error"], flush=True)
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        reserved = torch.cuda.max_memory_reserved()
        out.update(total=total, peak_reserved=reserved, headroom=1 - reserved / total)
        print(f"  peak reserved {reserved / gib:.2f} GiB of {total / gib:.2f} GiB: headroom "
              f"{out['headroom']:.1%} (goal >= 10%)", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=None,
                    help="truncate the model to this many layers (default: 2 for step/kernels, all for --memory)")
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--ragged", action="store_true",
                    help="step: sequence lengths uniform in [seq-len / 2, seq-len] (seeded) instead of all equal")
    ap.add_argument("--sections", default="step,kernels")
    ap.add_argument("--json", default=None)
    ap.add_argument("--memory", action="store_true",
                    help="only the memory section: peak of fwd + bwd + AdamW at --random-model / --tokens")
    ap.add_argument("--random-model", default="qwen3-4b",
                    help="--memory: a shape of detinfer.train.testing.SHAPES (qwen3-4b, qwen3-1.7b, llama-3.2-3b, ...)")
    ap.add_argument("--tokens", default="8x1024", help="--memory: SEQSxLEN packed tokens")
    ap.add_argument("--score-fraction", type=float, default=1.0,
                    help="--memory: the scored tail of each sequence (RL: the completion), as a fraction")
    ap.add_argument("--mode", default="deterministic", choices=("deterministic", "fast"))
    ap.add_argument("--no-checkpointing", action="store_true", help="--memory: keep every layer's activations")
    ap.add_argument("--offload-optimizer", action="store_true", help="--memory: AdamW state in host memory")
    ap.add_argument("--memory-steps", type=int, default=2)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on the CPU in fp32 (TRITON_INTERPRET=1): checks the script runs; no timings")
    args = ap.parse_args()
    args.shape = "qwen3-8b"
    if args.smoke:
        global DEV, DT
        DEV, DT = "cpu", torch.float32
        SHAPE.update(h=64, inter=96, hq=4, hkv=2, d=16, vocab=320)
        args.shape, args.layers, args.seqs, args.seq_len = "tiny", 1, 2, 24
        args.random_model, args.tokens = "tiny", "2x24"
        from detinfer.train.testing import SHAPES

        SHAPES["tiny"] = dict(SHAPES["qwen3-8b"], vocab_size=320, hidden_size=64, intermediate_size=96,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=2,
                              tie_word_embeddings=True)
    elif not torch.cuda.is_available():
        sys.exit("bench_train.py needs a CUDA GPU (or --smoke)")
    else:
        print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    result = {"args": vars(args)}
    if args.memory:
        result["memory"] = memory(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return
    if args.layers is None:
        args.layers = 2
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
