"""Weight push benchmark: the time to load a trainer's full weights into a running sampler engine, the step
`detinfer rl` runs after every update when the sampler is an engine of its own (rl/engines.py).

Model: the qwen3-8b preset's shape (`--layers`, default all 36), random bf16 weights. The sampler is a
deterministic engine with `tp_invariant_reduction` and CUDA graphs (`--tp` ranks, from `--sampler-gpu` on); the
trainer's full weights are a random state on `--trainer-gpu`. Each push (`engine.admin.push_weights`: every rank's
shards in buckets, one NCCL scatter per bucket, then the prefix cache reset) is timed from the first byte to
the last rank's copy (CUDA-synchronized on every GPU involved), the median of `--repeats` after one warm-up.
Layouts on 2 GPUs: colocated TP=2 (`--tp 2 --trainer-gpu 0 --sampler-gpu 0`, default) and split TP=1
(`--tp 1 --trainer-gpu 0 --sampler-gpu 1`). Goal: <= 1 s for Qwen3-8B bf16 (16.4 GB).

    python bench/bench_weight_push.py                                   # colocated TP=2
    python bench/bench_weight_push.py --tp 1 --sampler-gpu 1            # split on 2 GPUs
    python bench/bench_weight_push.py --layers 4 --repeats 2            # quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_e2e import qwen3_8b_config  # noqa: E402
from detinfer.distributed.weight_push import DEFAULT_BUCKET_BYTES  # noqa: E402
from detinfer.engine import EngineConfig, LLMEngine  # noqa: E402
from detinfer.engine.admin import push_weights  # noqa: E402
from detinfer.models.random_weights import random_state  # noqa: E402
from detinfer.models.weight_sources import RandomWeights  # noqa: E402


def _sync_all() -> None:
    for d in range(torch.cuda.device_count()):
        torch.cuda.synchronize(d)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--trainer-gpu", type=int, default=0)
    ap.add_argument("--sampler-gpu", type=int, default=0)
    ap.add_argument("--bucket-mib", type=int, default=DEFAULT_BUCKET_BYTES >> 20)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.device_count() < args.sampler_gpu + args.tp:
        print(f"bench_weight_push needs GPUs cuda:{args.sampler_gpu}..{args.sampler_gpu + args.tp - 1}",
              file=sys.stderr)
        return 2
    cfg = qwen3_8b_config(args.layers, 1024)
    config = EngineConfig(tensor_parallel_size=args.tp, tp_invariant_reduction=True, max_model_len=1024,
                          max_num_seqs=64, num_kv_blocks=256)
    engine = LLMEngine.from_weights(RandomWeights(0, torch.bfloat16), cfg, config,
                                    torch.device("cuda", args.sampler_gpu))
    try:
        state = random_state(cfg, seed=1, dtype=torch.bfloat16, device=torch.device("cuda", args.trainer_gpu))
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        times = []
        for i in range(args.repeats + 1):
            _sync_all()
            t0 = time.perf_counter()
            push_weights(engine, state, bucket_bytes=args.bucket_mib << 20)
            _sync_all()
            if i:  # the first push warms up the allocator and the communicator's scatter path
                times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        print(f"{torch.cuda.get_device_name()}  qwen3-8b shapes, {args.layers} layers, {nbytes / 1e9:.2f} GB bf16; "
              f"trainer cuda:{args.trainer_gpu} -> sampler TP={args.tp} from cuda:{args.sampler_gpu}; "
              f"buckets {args.bucket_mib} MiB")
        print(f"push: median {med:.3f} s ({nbytes / med / 1e9:.1f} GB/s), runs {[round(t, 3) for t in times]}; "
              f"goal <= 1 s at 36 layers: {'met' if med <= 1.0 else 'NOT met'}")
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
