"""Issue-8 experiment: HF `generate()` on a real chat model, the target prompt inside random left-padded
batches, stock kernels vs `detinfer.batch_invariant()`.

For each run r: a batch size B ~ U[1, max_batch] (seeded), B-1 companion prompts drawn from a fixed pool, the
target at a random position; greedy, `new_tokens` tokens. Reports per mode: unique target completions, runs
that differ from the target generated alone (B = 1), the first divergent token, and median seconds per run.

    python bench/hf_generate_experiment.py --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf --runs 100
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

import detinfer

TARGET = "Tell me about Richard Feynman"
COMPANIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis simply.",
    "Give me three tips for learning to code.", "Who was Marie Curie?", "What causes rain?",
    "Summarize the plot of Hamlet.", "How do airplanes fly?", "Tell me a joke about cats.",
    "What is a black hole?", "Describe the water cycle.", "Why is the sky blue?",
    "What is machine learning?", "Write a short poem about autumn.", "How does a computer work?",
    "Tell me about the Roman Empire.", "What are prime numbers?", "How do vaccines work?",
    "Suggest a name for a pet turtle.", "What is the speed of light?", "Tell me about Albert Einstein.",
    "Explain gravity to a child.", "What is the tallest mountain?", "Describe a sunset in two sentences.",
    "How do bees make honey?", "What is democracy?", "Write a limerick about a frog.",
    "What is the largest ocean?", "Explain what DNA is.", "Tell me about the Moon landing.",
]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def build_batches(runs: int, max_batch: int, seed: int) -> list[tuple[list[str], int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(runs):
        b = rng.randint(1, max_batch)
        companions = [rng.choice(COMPANIONS) for _ in range(b - 1)]
        pos = rng.randint(0, b - 1)
        out.append((companions[:pos] + [TARGET] + companions[pos:], pos))
    return out


def chat_ids(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                  tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def generate_target(model, tok, prompts: list[str], pos: int, new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """The target row's generated ids and its raw logits at every step ([new_tokens, vocab], on the CPU)."""
    seqs = [chat_ids(tok, p) for p in prompts]
    width = max(map(len, seqs))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):], mask[i, width - len(s):] = torch.tensor(s), 1
    out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                         max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad, eos_token_id=None,
                         return_dict_in_generate=True, output_logits=True)
    logits = torch.stack([step[pos] for step in out.logits]).cpu()
    return out.sequences[pos, width:].tolist(), logits


def logits_divergence(logits: torch.Tensor, alone: torch.Tensor) -> dict:
    """Bitwise comparison of a run's per-step logits with the target's alone (the steps both have): a
    stronger negative control than the tokens, which agree while the logits already differ."""
    n = min(len(logits), len(alone))
    same = [torch.equal(logits[i], alone[i]) for i in range(n)]
    first = next((i for i, eq in enumerate(same) if not eq), None)
    return {"logits_equal": first is None, "logits_first_diff_step": first,
            "logits_max_abs_diff": float((logits[:n].float() - alone[:n].float()).abs().max()) if n else 0.0}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_mode(model, tok, batches, new_tokens: int, invariant: bool, indices: list[int]) -> dict:
    """Generate the target alone, then inside batches[i] for i in `indices`: the raw per-run records."""
    ctx = detinfer.batch_invariant() if invariant else contextlib.nullcontext()
    label = "invariant" if invariant else "stock"
    runs = []
    with torch.no_grad(), ctx:
        generate_target(model, tok, [TARGET], 0, 4)  # warm-up (compile / autotune)
        alone, alone_logits = generate_target(model, tok, [TARGET], 0, new_tokens)
        for i in indices:
            prompts, pos = batches[i]
            _sync()
            t0 = time.perf_counter()
            comp, logits = generate_target(model, tok, prompts, pos, new_tokens)
            _sync()
            runs.append({"run": i, "batch": len(prompts), "tokens": comp, "s": time.perf_counter() - t0,
                         **logits_divergence(logits, alone_logits)})
            if len(runs) % 10 == 0:  # partial progress survives a time limit
                print(f"  [{label}] {len(runs)} runs, {len({tuple(r['tokens']) for r in runs})} unique, "
                      f"{runs[-1]['s']:.2f} s last run", flush=True)
    return {"alone": alone, "runs": runs}


def summarize(tok, alone: list[int], runs: list[dict], wall_s: float) -> dict:
    comps = [r["tokens"] for r in sorted(runs, key=lambda r: r["run"])]
    times = [r["s"] for r in runs]
    counts = Counter(tuple(c) for c in comps)
    differing = [d for d in (first_divergence(c, alone) for c in comps) if d is not None]
    return {
        "unique": len(counts), "most_common": counts.most_common(1)[0][1], "runs": len(comps),
        "differ_from_alone": len(differing),
        "first_divergence_min": min(differing) if differing else None,
        "first_divergence_max": max(differing) if differing else None,
        "logits_differ_from_alone": sum(not r["logits_equal"] for r in runs),
        "logits_first_diff_step_min": min((r["logits_first_diff_step"] for r in runs if not r["logits_equal"]),
                                          default=None),
        "logits_max_abs_diff": max(r["logits_max_abs_diff"] for r in runs),
        "median_s_per_run": statistics.median(times), "sum_s": sum(times), "wall_s": wall_s,
        "alone_text": tok.decode(alone),
        "variants": [tok.decode(list(c)) for c, _ in counts.most_common(4)],
    }


def run_workers(args, mode: str, tmp: Path) -> tuple[list[int], list[dict], float]:
    """Run one mode's runs in `args.workers` processes sharing the GPU (HF generate on a 135M model is
    bound by the host's per-op dispatch, so processes scale with CPU cores). Worker w takes runs
    w, w + W, ...; every worker also generates the target alone, and those must agree."""
    t0 = time.perf_counter()
    procs = []
    for w in range(args.workers):
        cmd = [sys.executable, __file__, "--gguf", str(args.gguf), "--runs", str(args.runs),
               "--max-batch", str(args.max_batch), "--new-tokens", str(args.new_tokens), "--seed", str(args.seed),
               "--dtype", args.dtype, "--device", args.device, "--modes", mode, "--workers", str(args.workers),
               "--shard", str(w), "--json", str(tmp / f"{mode}_{w}.json")]
        procs.append(subprocess.Popen(cmd))
    if any(p.wait() for p in procs):
        raise SystemExit(f"a {mode} worker failed (exit codes {[p.returncode for p in procs]})")
    wall = time.perf_counter() - t0
    parts = [json.loads((tmp / f"{mode}_{w}.json").read_text())[mode] for w in range(args.workers)]
    alones = {tuple(p["alone"]) for p in parts}
    if len(alones) != 1:
        print(f"[{mode}] WARNING: the target alone differs between worker processes ({len(alones)} versions)")
    return parts[0]["alone"], [r for p in parts for r in p["runs"]], wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True, type=Path)
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="stock,invariant")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--workers", type=int, default=1,
                   help="processes per mode sharing the device (runs split round-robin)")
    p.add_argument("--shard", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.workers < 1 or (args.shard is not None and not 0 <= args.shard < args.workers):
        p.error("--workers must be >= 1 (and --shard in [0, workers))")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.gguf.parent, gguf_file=args.gguf.name)
    model = None
    if args.workers == 1 or args.shard is not None:  # a parent of workers only merges and decodes
        model = AutoModelForCausalLM.from_pretrained(args.gguf.parent, gguf_file=args.gguf.name,
                                                     dtype=getattr(torch, args.dtype)).to(args.device).eval()
    batches = build_batches(args.runs, args.max_batch, args.seed)
    modes = args.modes.split(",")
    if args.shard is not None:  # one worker of run_workers: raw records only
        idx = list(range(args.shard, args.runs, args.workers))
        raw = {m: run_mode(model, tok, batches, args.new_tokens, m == "invariant", idx) for m in modes}
        args.json.write_text(json.dumps(raw))
        return
    results = {}
    for mode in modes:
        if args.workers > 1:
            with tempfile.TemporaryDirectory() as tmp:
                alone, runs, wall = run_workers(args, mode, Path(tmp))
        else:
            t0 = time.perf_counter()
            raw = run_mode(model, tok, batches, args.new_tokens, mode == "invariant", list(range(args.runs)))
            alone, runs, wall = raw["alone"], raw["runs"], time.perf_counter() - t0
        results[mode] = r = summarize(tok, alone, runs, wall)
        print(f"[{mode}] unique={r['unique']}/{r['runs']} most_common={r['most_common']} "
              f"differ_from_alone={r['differ_from_alone']} first_div=[{r['first_divergence_min']},"
              f"{r['first_divergence_max']}] logits_differ_from_alone={r['logits_differ_from_alone']} "
              f"(max |diff| {r['logits_max_abs_diff']:.3g}) median_s/run={r['median_s_per_run']:.3f} wall_s={wall:.1f} "
              f"(workers={args.workers})", flush=True)
        for k, v in enumerate(r["variants"]):
            print(f"  variant {k}: {v[:160]!r}")
    if "stock" in results and "invariant" in results:
        ratio = results["invariant"]["median_s_per_run"] / results["stock"]["median_s_per_run"]
        wall = results["invariant"]["wall_s"] / results["stock"]["wall_s"]
        print(f"slowdown invariant/stock: median s per run {ratio:.2f}x, wall {wall:.2f}x")
        same = results["stock"]["alone_text"] == results["invariant"]["alone_text"]
        print(f"target alone: stock and invariant {'agree' if same else 'differ'}")
    print("alone:", results[modes[0]]["alone_text"][:300].replace("\n", " "))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **results}, indent=1))


if __name__ == "__main__":
    main()
