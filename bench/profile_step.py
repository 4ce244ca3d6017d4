"""Where a graphed decode step's time goes: a torch-profiler trace of a few decode steps of a random preset
at TP=1, per kernel name (launches per step, summed duration) and the kernel sequence of one stretch.

Read the counts and the order more than the durations: under PDL (kernels/_pdl.py) a kernel launches early
and waits for its predecessor, so its duration includes that wait and durations overlap.

    python bench/profile_step.py --preset qwen3-30b-a3b --modes deterministic,fast --batch-sizes 1,64
(chrome traces go to --out; open them in Perfetto.)
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
from detinfer.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from detinfer.models.weight_sources import RandomWeights  # noqa: E402
from detinfer.repro.random_model import preset_config  # noqa: E402


def profile_batch(engine: LLMEngine, preset: str, mode: str, batch: int, out: Path, steps: int) -> None:
    rng = random.Random(batch)
    for i in range(batch):
        engine.add_request(f"{mode}{batch}-{i}", [rng.randrange(1000) for _ in range(32)],
                           SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    for _ in range(10):  # prefill and graph warm-up
        engine.step()
    torch.cuda.synchronize()
    wall = []
    for _ in range(15):
        start = time.perf_counter()
        engine.step()
        wall.append(time.perf_counter() - start)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    path = out / f"trace_{preset}_{mode}_b{batch}.json"
    prof.export_chrome_trace(str(path))
    events = sorted((e for e in json.loads(path.read_text())["traceEvents"]
                     if e.get("ph") == "X" and e.get("cat") == "kernel"), key=lambda e: e["ts"])
    print(f"==== {preset} {mode} batch {batch}: step {1e3 * statistics.median(wall):.2f} ms, "
          f"{len(events) / steps:.0f} kernels per step", flush=True)
    totals: dict[str, list] = {}
    for e in events:
        t = totals.setdefault(e["name"][:60], [0, 0.0])
        t[0] += 1
        t[1] += e["dur"]
    for name, (count, dur) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"  {count / steps:7.1f}x {dur / steps / 1e3:8.3f} ms  {name}")
    start = len(events) // 10
    for e in events[start:start + 45]:
        print(f"    {e['dur']:7.1f} us  {e['name'][:50]:50s} grid {e.get('args', {}).get('grid')}")
    for i in range(batch):
        engine.abort_request(f"{mode}{batch}-{i}")
    while engine.has_unfinished_requests():
        engine.step()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--modes", default="deterministic,fast")
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--steps", type=int, default=5, help="profiled decode steps per batch size")
    ap.add_argument("--out", default=".", help="folder for the chrome traces")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_step.py needs a CUDA GPU")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    cfg = preset_config(args.preset)
    for mode in args.modes.split(","):
        engine = LLMEngine.from_weights(RandomWeights(0, torch.bfloat16), cfg, EngineConfig(
            mode=mode, max_model_len=1024, max_num_seqs=max(batches), max_num_batched_tokens=512,
            cuda_graph_max_tokens=128, gpu_memory_utilization=0.9), torch.device("cuda", 0))
        try:
            for b in batches:
                profile_batch(engine, args.preset, mode, b, Path(args.out), args.steps)
        finally:
            engine.close()
        del engine
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
