"""CPU-side microbenchmark of the engine's per-step host work at large batch (no GPU needed).

    python bench/bench_engine_host.py [--seqs 256] [--steps 200] [--profile 25] [--src PATH]

What a decode step costs the host besides the model: scheduling, the step layout, sampling's bookkeeping,
resolving the sampled tokens, and the `RequestOutput`s `step()` returns. With overlapped scheduling this work
runs while the device computes the previous step, so it is free only while it is shorter than the device step:
at TP=2 and 256 sequences the device step shrinks towards it (docs/performance.md, "... the 256-sequence
decode step"). Here the model is replaced by a stub that returns zero logits at once (tiny vocabulary), so the time
measured is the engine's Python around it. `--seqs` sequences with 100-token prompts are prefilled, then
`--steps` decode steps are timed (process CPU time, best of 3); `--profile N` adds a cProfile table (top N by
own time). `--src` times another checkout's sources (before / after a change, in one session).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time


def build_engine(seqs: int, steps: int, vocab: int, output_kind: str = "cumulative"):
    import torch

    from detinfer.engine import EngineConfig, LLMEngine, SamplingParams
    from detinfer.models.config import ModelConfig
    from detinfer.models.testing import tiny_config_dict
    from detinfer.models.weight_sources import random_model as build_random

    cfg = ModelConfig.from_dict(tiny_config_dict(vocab_size=vocab, max_position_embeddings=1024))
    model = build_random(cfg, seed=0, mode="fast", device=torch.device("cpu"), dtype=torch.float32)
    config = EngineConfig(mode="fast", max_num_seqs=seqs, max_model_len=1024, max_num_batched_tokens=8192,
                          enforce_eager=True)
    engine = LLMEngine.from_model(model, cfg, config)
    logits, ids = torch.zeros(seqs, vocab), torch.zeros(seqs, dtype=torch.int64)

    def stub_execute(batch, input_ids=None, argmax_only=False):
        return (ids if argmax_only else logits)[:len(batch.layout.logit_rows)]

    engine.runner.execute = stub_execute
    warm = 4 + seqs * 100 // config.max_num_batched_tokens
    for i in range(seqs):
        engine.add_request(f"r{i}", [3 + (i * 7 + j) % (vocab - 3) for j in range(100)],
                           SamplingParams(temperature=0.0, max_tokens=warm + 4 * steps + 8, ignore_eos=True,
                                          output_kind=output_kind))
    for _ in range(warm):
        engine.step()
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--output-kind", default="cumulative", help="the requests' SamplingParams.output_kind")
    ap.add_argument("--profile", type=int, default=0, help="also print cProfile's top N functions by own time")
    ap.add_argument("--src", default=os.path.join(os.path.dirname(__file__), "..", "src"))
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.src))
    import torch

    torch.set_num_threads(1)
    engine = build_engine(args.seqs, args.steps, args.vocab, args.output_kind)
    best = float("inf")
    for _ in range(3):
        start = time.process_time()
        for _ in range(args.steps):
            engine.step()
        best = min(best, (time.process_time() - start) / args.steps)
    print(f"{args.seqs} sequences, output_kind {args.output_kind}: {best * 1e3:.3f} ms of host CPU time per decode "
          f"step (best of 3 x {args.steps})")
    if args.profile:
        prof = cProfile.Profile()
        prof.runcall(lambda: [engine.step() for _ in range(args.steps // 4)])
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.profile)
        print(out.getvalue())


if __name__ == "__main__":
    main()
