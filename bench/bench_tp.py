"""Tensor-parallel benchmark: decode step time at TP=1 vs TP=N with CUDA graphs on both, and the cost of one
cross-rank sum inside a CUDA graph.

Model: the qwen3-8b preset's shape (random bf16 weights on the GPU, `--layers` to scale it down). Engines,
all with CUDA graphs: deterministic TP=1 and TP=N, fast TP=1 and TP=N, deterministic TP=N and TP=1 with
--tp-invariant-reduction (`--eager` adds deterministic TP=N without graphs). For each, B sequences decode
together (every step: one token each) and the median step time is taken over `--steps` steps after a
warm-up. The table gives each step time, TP=N / TP=1 (same mode and reduction; goal <= 0.6) and
deterministic / fast at the same TP size (goal <= 1.10). At TP=2 the deterministic engine is also run with
its row-parallel sums through NCCL + a cast (DETINFER_TP_PEER_SUM=0, row "nccl") beside the default peer
kernel (distributed/peer_sum.py), as an A/B in the same process.

Cross-rank sums (2 GPUs, `--no-collectives` to skip): one reduction of an fp32 partial of 8 KB / 64 KB /
256 KB per call, timed eagerly and inside a CUDA graph (`--graph-calls` calls captured back to back, the
graph replayed; the time per call): `exact_sum` (what deterministic mode runs; at TP=2 one fp32
all-reduce, goal <= 10 us in a graph at <= 64 KB), the all-gather + tree it replaces at TP=2, and fast
mode's bf16 all-reduce of the same number of elements.

    python bench/bench_tp.py                    # 36 layers, batch 1 and 64, all engines (a few minutes)
    python bench/bench_tp.py --quick            # smoke test: 4 layers, batch 1 and 8, few steps
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_e2e import qwen3_8b_config, random_model  # noqa: E402
from detinfer.distributed.group import connect, free_port  # noqa: E402
from detinfer.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from detinfer.kernels.chunked_linear import pairwise_tree_sum  # noqa: E402
from detinfer.models.weight_sources import RandomWeights  # noqa: E402
from detinfer.repro.random_model import preset_config  # noqa: E402

SUM_BYTES = (8 << 10, 64 << 10, 256 << 10)  # fp32 partials: 2048 / 16384 / 65536 elements


def decode_step_ms(engine: LLMEngine, batch: int, steps: int, vocab: int) -> float:
    """Median wall time of engine steps in which `batch` sequences all decode (graph replays)."""
    rng = random.Random(batch)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True)
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
        engine.step()  # overlapped scheduling: one step's launch and the previous step's read-back
        times.append(time.perf_counter() - start)
    for i in range(batch):
        engine.abort_request(f"b{batch}-{i}")
    while engine.has_unfinished_requests():
        engine.step()
    return 1e3 * statistics.median(times)


def engine_runs(args) -> list[tuple[str, int, bool, bool, bool]]:
    """(mode, tp, tp_invariant_reduction, enforce_eager, nccl_sums). TP=1 with the flag comes last: it swaps
    the o_proj/down_proj modules of the model it is given in place. nccl_sums: DETINFER_TP_PEER_SUM=0."""
    det, tp = "deterministic", args.tp
    runs = [(det, 1, False, False, False), ("fast", 1, False, False, False), (det, tp, False, False, False),
            ("fast", tp, False, False, False), (det, tp, True, False, False)]
    if tp == 2:
        runs += [(det, tp, False, False, True), (det, tp, True, False, True)]
    if args.eager:
        runs.append((det, tp, False, True, False))
    runs.append((det, 1, True, False, False))
    if args.only:
        names = {f"{m[:3]}{t}{'inv' if inv else ''}{'eager' if e else ''}{'nccl' if n else ''}": (m, t, inv, e, n)
                 for m, t, inv, e, n in runs}
        unknown = set(args.only) - set(names)
        if unknown:
            raise SystemExit(f"--only: unknown {sorted(unknown)}; choose from {sorted(names)}")
        runs = [r for name, r in names.items() if name in args.only]
    return runs


def build_engine(args, model, cfg, config: EngineConfig) -> LLMEngine:
    """From the shared TP=1 model (qwen3-8b shapes), or with --preset from sharded random draws: every rank
    draws only its own slices, so models larger than one GPU start (no TP=1 copy exists anywhere)."""
    if model is None:
        return LLMEngine.from_weights(RandomWeights(0, torch.bfloat16), cfg, config, torch.device("cuda", 0))
    model.set_ops(model.ops.replace(mode=config.mode))
    return LLMEngine.from_model(model, cfg, config)


def bench_engines(args) -> list[dict]:
    rows = []
    if args.preset:
        cfg, model = preset_config(args.preset), None
    else:
        cfg = qwen3_8b_config(args.layers, args.max_len)
        model = random_model(cfg, torch.device("cuda", 0), seed=0)
    for mode, tp, invariant, eager, nccl in engine_runs(args):
        os.environ["DETINFER_TP_PEER_SUM"] = "0" if nccl else "1"  # read by every rank as it joins the group
        config = EngineConfig(mode=mode, tensor_parallel_size=tp, tp_invariant_reduction=invariant,
                              enforce_eager=eager, max_num_seqs=max(args.batch_sizes),
                              max_num_batched_tokens=max(512, max(args.batch_sizes)), max_model_len=args.max_len,
                              cuda_graph_max_tokens=args.cuda_graph_max_tokens,
                              gpu_memory_utilization=args.gpu_memory_utilization)
        start = time.perf_counter()
        engine = build_engine(args, model, cfg, config)
        built = time.perf_counter() - start
        try:
            graphs = engine.runner.graphs
            for b in args.batch_sizes:
                group = getattr(engine.runner, "group", None)
                row = {"mode": mode, "tp": tp, "tp_invariant_reduction": invariant, "graphs": graphs is not None,
                       "nccl_sums": nccl, "peer_sum": getattr(group, "peer", None) is not None, "batch": b,
                       "step_ms": decode_step_ms(engine, b, args.steps, cfg.vocab_size),
                       "engine_build_s": built, "capture_s": graphs.capture_seconds if graphs else 0.0}
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            engine.close()
            del engine, graphs  # the graph runner holds the model: drop it too, or the next engine OOMs
            gc.collect()  # the engine's KV pools and graph pool go before the next engine sizes its own
            torch.cuda.empty_cache()
    return rows


def _time_calls(fn, calls: int, graph: bool, dev: torch.device) -> float:
    """Microseconds per call of fn(): eagerly (`calls` calls), or `calls` calls captured in one graph."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize(dev)
    if not graph:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize(dev)
        return 1e6 * (time.perf_counter() - start) / calls
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize(dev)
    reps = 20
    start = time.perf_counter()
    for _ in range(reps):
        g.replay()
    torch.cuda.synchronize(dev)
    return 1e6 * (time.perf_counter() - start) / (reps * calls)


def _collective_worker(rank: int, port: int, calls: int, out) -> None:
    dev = torch.device("cuda", rank)
    group = connect(rank, 2, port, dev)
    res = []
    for nbytes in SUM_BYTES:
        # Zeros: repeated in-place sums stay finite; the values do not change the time.
        part = torch.zeros(nbytes // 4, device=dev)
        half = torch.zeros(nbytes // 4, device=dev, dtype=torch.bfloat16)
        cases = {"exact_sum (deterministic)": lambda part=part: group.exact_sum(part),
                 "all_gather + tree (before)": lambda part=part: pairwise_tree_sum(group.all_gather(part)),
                 "all_reduce bf16 (fast)": lambda half=half: group.all_reduce_sum(half)}
        for name, fn in cases.items():
            for graph in (False, True):
                us = _time_calls(fn, calls, graph, dev)
                res.append({"bytes": nbytes, "case": name, "graph": graph, "us_per_call": us})
    if rank == 0:
        out.put(res)


def bench_collectives(calls: int) -> list[dict]:
    ctx = torch.multiprocessing.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_collective_worker, args=(r, port, calls, queue)) for r in range(2)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=600)
    for p in procs:
        p.join()
    return rows


def print_tables(engines: list[dict], sums: list[dict], tp: int) -> None:
    by = {(r["mode"], r["tp"], r["tp_invariant_reduction"], r["graphs"], r["nccl_sums"], r["batch"]): r["step_ms"]
          for r in engines}
    batches = sorted({r["batch"] for r in engines})
    print("\ndecode step (ms, median)" + "".join(f" | batch {b:>4}" for b in batches) +
          "".join(f" | TP{tp}/TP1 b{b}" for b in batches) + "".join(f" | det/fast b{b}" for b in batches))
    for mode, t, inv, graphs, nccl in dict.fromkeys(k[:5] for k in by):
        name = f"{mode[:5]} TP={t}{' inv' if inv else ''}{'' if graphs else ' eager'}{' nccl' if nccl else ''}"
        mine = [by[(mode, t, inv, graphs, nccl, b)] for b in batches]
        cells = [f"{x:10.2f}" for x in mine]
        base = [by.get((mode, 1, inv, True, False, b)) for b in batches]
        cells += [f"{m / x:11.2f}" if x and t > 1 else f"{'':>11}" for m, x in zip(mine, base)]
        fast = [by.get(("fast", t, False, graphs, False, b)) for b in batches]
        cells += [f"{m / f:11.2f}" if f and mode == "deterministic" else f"{'':>11}" for m, f in zip(mine, fast)]
        print(f"{name:<24}" + "".join(f" | {c}" for c in cells))
    if sums:
        print("\ncross-rank sum, us per call (2 GPUs)" + "".join(f" | {n >> 10:>3} KB eager | {n >> 10:>3} KB graph"
                                                               for n in SUM_BYTES))
        for case in dict.fromkeys(r["case"] for r in sums):
            cells = [f"{r['us_per_call']:12.1f}" for n in SUM_BYTES for graph in (False, True)
                     for r in sums if r["case"] == case and r["bytes"] == n and r["graph"] == graph]
            print(f"{case:<36}" + "".join(f" | {c}" for c in cells))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--preset", default=None, help="a random-model preset at full size (e.g. qwen3-30b-a3b, "
                   "llama-3.1-70b, qwen3-235b-a22b) instead of qwen3-8b with --layers; every engine draws its own "
                   "shards (pick the engines that fit with --only)")
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--cuda-graph-max-tokens", type=int, default=128,
                   help="largest graphed mixed step (decode graphs are what is timed; fewer mixed graphs start "
                   "faster)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    p.add_argument("--eager", action="store_true", help="also deterministic TP=N without CUDA graphs")
    p.add_argument("--no-collectives", action="store_true", help="skip the cross-rank sum timings")
    p.add_argument("--graph-calls", type=int, default=100, help="cross-rank sums captured per graph")
    p.add_argument("--quick", action="store_true", help="smoke test: 4 layers, batch 1 and 8, 8 steps")
    p.add_argument("--out", type=Path, help="write all rows as JSON here")
    p.add_argument("--only", type=lambda s: s.split(","), default=None,
                   help="engines to run, e.g. det1,det2 (det/fas + TP size + inv / eager / nccl)")
    args = p.parse_args()
    if args.quick:
        args.layers, args.batch_sizes, args.steps, args.max_len, args.graph_calls = 4, [1, 8], 8, 512, 20
    if torch.cuda.device_count() < max(args.tp, 2 if not args.no_collectives else 1):
        sys.exit(f"--tp {args.tp} (and the cross-rank sums) need {max(args.tp, 2)} GPUs, "
                 f"{torch.cuda.device_count()} visible")
    print(f"{torch.cuda.get_device_name()} x {torch.cuda.device_count()}, torch {torch.__version__}, "
          f"{args.preset or f'qwen3-8b shapes, {args.layers} layers'}, batch sizes {args.batch_sizes}", flush=True)
    rows = {"engines": bench_engines(args), "sums": []}
    if not args.no_collectives:
        rows["sums"] = bench_collectives(args.graph_calls)
    print_tables(rows["engines"], rows["sums"], args.tp)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
