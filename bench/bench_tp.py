"""Tensor-parallel benchmark: decode step time at TP=1 vs TP=N, the collectives' share of a TP step, and the
cost of the fixed-order reductions against NCCL's all-reduce.

Model: the qwen3-8b preset's shape (random bf16 weights on the GPU, `--layers` to scale it down). Engines:
deterministic TP=1 (CUDA graphs, and eager: TP>1 steps run eagerly), deterministic TP=N (gather + ordered
tree), deterministic TP=1 and TP=N with --tp-invariant-reduction, fast TP=1 and TP=N (NCCL all-reduce).
For each, B sequences decode together (every step: one token each) and the mean step time is taken over
`--steps` steps after a warm-up. For TP>1 it then times every collective on rank 0 (synchronized before and
after, so it includes waiting for the other ranks) over the same number of steps: the collectives' share of
an (instrumented) decode step. `--collectives` also times, on 2 GPUs, one row-parallel reduction of [M, 4096]
fp32 partials as all-gather + tree (deterministic) against NCCL all_reduce (fp32 and bf16) for several M.

    python bench/bench_tp.py --tp 2 --layers 36 --batch-sizes 1,8,32,128 --collectives
    python bench/bench_tp.py --tp 2 --layers 4 --steps 20        # quick
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_e2e import qwen3_8b_config, random_model  # noqa: E402
from detinfer.distributed.group import TPGroup, connect, free_port  # noqa: E402
from detinfer.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from detinfer.models.config import ModelConfig  # noqa: E402
from detinfer.models.transformer import Transformer  # noqa: E402
from detinfer.ops import Ops  # noqa: E402


def build_model(layers: int, max_len: int) -> tuple[Transformer, ModelConfig]:
    """bench_e2e's random Qwen3-8B-shaped bf16 model on GPU 0 (the same shapes and weights as there)."""
    cfg = qwen3_8b_config(layers, max_len)
    return random_model(cfg, torch.device("cuda", 0), seed=0), cfg


class CommTimer:
    """Wraps TPGroup's collectives in this process (rank 0) with synchronized wall-clock timing."""

    def __init__(self):
        self.seconds, self.enabled = 0.0, False
        self._orig = {name: getattr(TPGroup, name) for name in ("all_gather", "all_reduce_sum")}
        for name, fn in self._orig.items():
            setattr(TPGroup, name, self._wrap(fn))

    def _wrap(self, fn):
        def timed(group, t):
            if not self.enabled:
                return fn(group, t)
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = fn(group, t)
            torch.cuda.synchronize()
            self.seconds += time.perf_counter() - start
            return out
        return timed


def decode_step_ms(engine: LLMEngine, batch: int, steps: int, vocab: int, timer: CommTimer | None) -> dict:
    rng = random.Random(batch)
    params = SamplingParams(temperature=0.0, max_tokens=2 * steps + 16, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", [rng.randrange(vocab) for _ in range(32)], params)
    while engine.scheduler.waiting or any(not s.output_token_ids for s in engine.scheduler.running):
        engine.step()  # prefill (in chunks) until every sequence decodes
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()  # returns after the sampled ids reached the host
        times.append(time.perf_counter() - start)
    result = {"batch": batch, "step_ms": 1e3 * statistics.median(times)}
    if timer is not None:
        timer.seconds, timer.enabled = 0.0, True
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - start
        timer.enabled = False
        result.update(instrumented_step_ms=1e3 * total / steps, comm_ms=1e3 * timer.seconds / steps,
                      comm_share=timer.seconds / total)
    for i in range(batch):
        engine.abort_request(f"b{batch}-{i}")
    while engine.has_unfinished_requests():
        engine.step()
    return result


def bench_engines(args) -> list[dict]:
    rows, timer = [], CommTimer()
    # (mode, tp, tp_invariant_reduction, enforce_eager); TP=1 with the flag comes last because it swaps the
    # o_proj/down_proj modules of the model it is given in place.
    runs = [("deterministic", 1, False, False), ("deterministic", 1, False, True),
            ("deterministic", args.tp, False, True), ("fast", 1, False, False), ("fast", args.tp, False, True),
            ("deterministic", args.tp, True, True), ("deterministic", 1, True, True)]
    model, cfg = build_model(args.layers, args.max_len)
    for mode, tp, invariant, eager in runs:
        model.set_ops(model.ops.replace(mode=mode))
        config = EngineConfig(mode=mode, tensor_parallel_size=tp, tp_invariant_reduction=invariant,
                              enforce_eager=eager, max_num_seqs=max(args.batch_sizes),
                              max_num_batched_tokens=max(2048, max(args.batch_sizes)), max_model_len=args.max_len,
                              gpu_memory_utilization=args.gpu_memory_utilization)
        engine = LLMEngine.from_model(model, cfg, config)
        try:
            for b in args.batch_sizes:
                row = {"mode": mode, "tp": tp, "tp_invariant_reduction": invariant, "eager": eager,
                       **decode_step_ms(engine, b, args.steps, cfg.vocab_size, timer if tp > 1 else None)}
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            engine.close()
    return rows


def _collective_worker(rank: int, port: int, sizes: list[int], iters: int, out) -> None:
    dev = torch.device("cuda", rank)
    group = connect(rank, 2, port, dev)
    ops = Ops("deterministic", dev, torch.float32)
    res = []
    for m in sizes:
        part = torch.randn(m, 4096, device=dev)
        cases = {"gather_tree_fp32": lambda part=part: ops.tree_sum(group.all_gather(part)),
                 "all_reduce_fp32": lambda part=part: group.all_reduce_sum(part.clone()),
                 "all_reduce_bf16": lambda part=part: group.all_reduce_sum(part.to(torch.bfloat16))}
        for name, fn in cases.items():
            for _ in range(5):
                fn()
            torch.cuda.synchronize(dev)
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            torch.cuda.synchronize(dev)
            res.append({"m": m, "case": name, "us": 1e6 * (time.perf_counter() - start) / iters})
    if rank == 0:
        out.put(res)


def bench_collectives(iters: int) -> list[dict]:
    ctx = torch.multiprocessing.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    sizes = [1, 8, 64, 512, 4096]
    procs = [ctx.Process(target=_collective_worker, args=(r, port, sizes, iters, queue)) for r in range(2)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=600)
    for p in procs:
        p.join()
    for row in rows:
        print(json.dumps({"collective": row}), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    p.add_argument("--collectives", action="store_true", help="also time gather+tree vs all_reduce (2 GPUs)")
    p.add_argument("--out", type=Path, help="write all rows as JSON here")
    args = p.parse_args()
    if torch.cuda.device_count() < args.tp:
        sys.exit(f"--tp {args.tp} needs {args.tp} GPUs, {torch.cuda.device_count()} visible")
    rows = {"engines": bench_engines(args)}
    if args.collectives:
        rows["collectives"] = bench_collectives(200)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
