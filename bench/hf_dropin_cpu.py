"""The drop-in mode's CPU cost: HF `generate()` on a batch of left-padded prompts, stock kernels vs
`detinfer.batch_invariant()`, side by side in one process.

Each repeat times both, in ABBA order over consecutive repeats (stock, mode, then mode, stock, ...) so a
machine that slows down or speeds up during the run weighs on both alike; one untimed warm-up of each
first. Reports every time, each side's median and the ratio of the medians (mode / stock), with the
machine's load average before and after (shared cores show up there).

    PYTHONPATH=src python bench/hf_dropin_cpu.py --model tests/data/stories260k   # the tests' tiny model
    PYTHONPATH=src python bench/hf_dropin_cpu.py --random-llama    # a small random LlamaConfig model instead
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

import detinfer

PROMPTS = ["Tell me about Richard Feynman", "Hi", "Once upon a time there was a little dog who",
           "The sun was hot and the children wanted to play in the", "Lily had a red ball.",
           "What is the capital of France?", "One day, Tom went to the park with his mom and",
           "The cat sat on the mat and"]


def load(model_dir: str | None, random_llama: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if random_llama:
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=172, num_hidden_layers=5,
                             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
        tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left") if model_dir else None
        return LlamaForCausalLM(config).eval(), tok
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    return AutoModelForCausalLM.from_pretrained(model_dir).eval(), tok


def batch_inputs(tok, batch: int) -> dict[str, torch.Tensor]:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    if tok is None:  # random model without a tokenizer: byte ids, left-padded with 0
        rows = [list(p.encode())[:64] for p in prompts]
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        return {"input_ids": ids, "attention_mask": mask}
    tok.pad_token = tok.pad_token or tok.eos_token
    return dict(tok(prompts, return_tensors="pt", padding=True))


def timed_generate(model, inputs, new_tokens: int, invariant: bool) -> float:
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=model.config.eos_token_id or 0)
    started = time.perf_counter()
    with torch.no_grad():
        if invariant:
            with detinfer.batch_invariant():
                model.generate(**inputs, **kwargs)
        else:
            model.generate(**inputs, **kwargs)
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--model", default=None, help="HF model directory (tokenizer and weights)")
    p.add_argument("--random-llama", action="store_true", help="a small random LlamaConfig model (the tiny "
                   "model's shape); --model then only supplies the tokenizer")
    p.add_argument("--batch", type=int, default=8, help="prompts per generate() (default: 8)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt (default: 64)")
    p.add_argument("--repeats", type=int, default=9, help="timed generate() calls per side (default: 9)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: 1; shared cores "
                   "make a second thread wait on a descheduled one)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    if args.model is None and not args.random_llama:
        p.error("give --model DIR or --random-llama")
    torch.set_num_threads(args.threads)
    model, tok = load(args.model, args.random_llama)
    inputs = batch_inputs(tok, args.batch)
    load_before = os.getloadavg()
    for invariant in (False, True):  # warm-up: first-call costs (allocations, caches) stay out of the timings
        timed_generate(model, inputs, args.new_tokens, invariant)
    times: dict[str, list[float]] = {"stock": [], "mode": []}
    for r in range(args.repeats):
        order = (False, True) if r % 2 == 0 else (True, False)
        for invariant in order:
            times["mode" if invariant else "stock"].append(timed_generate(model, inputs, args.new_tokens, invariant))
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "model": "random LlamaConfig (stories260k shape)" if args.random_llama else args.model,
        "batch": args.batch, "new_tokens": args.new_tokens, "prompt_width": inputs["input_ids"].shape[1],
        "repeats": args.repeats, "threads": args.threads, "cpus": os.cpu_count(),
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.processor() or
        platform.machine(), "seconds": times, "median_s": med, "mode_over_stock": med["mode"] / med["stock"],
    }
    for k in ("stock", "mode"):
        print(f"{k:>5}: median {med[k]:.3f} s  ({', '.join(f'{t:.3f}' for t in times[k])})")
    print(f"mode / stock: {result['mode_over_stock']:.2f}x  (batch {args.batch}, {args.new_tokens} new tokens, "
          f"{args.threads} thread(s), {os.cpu_count()} CPUs, load average {load_before[0]:.2f} before, "
          f"{result['load_average_after'][0]:.2f} after)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
