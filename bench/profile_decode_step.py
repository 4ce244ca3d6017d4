"""Per-kernel device time of a decode step (torch profiler) on a random Qwen3-8B-shaped model or a preset.

Where the time of a decode step goes besides the matmuls (norms, rotary, activations, copies, attention),
per batch size: the batch decodes a few steps, then `--steps` steps are profiled and the CUDA kernels are
listed by device time per step (all layers summed), with launches per step. Eager by default; `--graphs`
profiles the CUDA-graphed step the engine really runs, and `--sequence N` prints N consecutive kernels from
a tenth into the trace (one layer's order and each launch's grid). Under PDL (kernels/_pdl.py) a kernel
launches early and waits for its predecessor, so with graphs its duration includes that wait: read the
counts and the order there, or set DETINFER_PDL=0 for durations that do not overlap. `--critical-path` adds
a table that PDL does not blur: each kernel is charged the time from the previous kernel's end to its own
end (what removing it would save at most), summed per kernel name, then the largest idle gaps in trace order
(spread over every step, or a few long pauses?). `--tp N` profiles rank 0 of a
tensor-parallel engine (the other ranks run the same step in their own processes).

    python bench/profile_decode_step.py --layers 36 --batches 1,64 --mode deterministic
    python bench/profile_decode_step.py --preset qwen3-30b-a3b --batches 1,64 --mode fast   # a full-size preset
    python bench/profile_decode_step.py --preset qwen3-30b-a3b --batches 1 --graphs --steps 5 --sequence 60
    python bench/profile_decode_step.py --tp 2 --graphs --steps 10 --critical-path
    python bench/profile_decode_step.py --quantization fp8 --graphs --steps 5 --critical-path
    python bench/profile_decode_step.py --tp 2 --graphs --steps 20 --batches 256 --host   # rank 0's host side
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from bench_e2e import HBM_BYTES_PER_S, matmul_weight_bytes, model_in_mode, qwen3_8b_config, random_model  # noqa: E402
from detinfer.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from detinfer.models.weight_sources import RandomWeights  # noqa: E402
from detinfer.repro.random_model import preset_config  # noqa: E402


def kernel_events(prof) -> list[dict]:
    """The trace's CUDA kernels in start order (name, ts, dur in us)."""
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        with open(f"{tmp}/trace.json") as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "kernel"]
    return sorted(events, key=lambda e: e["ts"])


def print_critical_path(events: list[dict], steps: int, top: int) -> None:
    """Charge each kernel (end - the latest earlier end): under PDL kernels overlap, so durations double count,
    while these charges add up to the busy span and say what each kernel adds to it."""
    charged: dict[str, list[float]] = {}
    gaps: list[tuple[float, float, str]] = []  # (idle us, at us from the first kernel, the kernel after it)
    last_end = None
    for e in events:
        end = e["ts"] + e["dur"]
        start = e["ts"] if last_end is None else max(last_end, e["ts"])
        name = re.sub(r"_(\d+)$", "", e["name"])[:70]
        entry = charged.setdefault(name, [0.0, 0.0, 0])
        entry[0] += max(0.0, end - start)
        idle = max(0.0, e["ts"] - last_end) if last_end is not None else 0.0  # idle before it
        entry[1] += idle
        entry[2] += 1
        if idle > 0:
            gaps.append((idle, e["ts"] - events[0]["ts"], name))
        last_end = end if last_end is None else max(last_end, end)
    span = (last_end - events[0]["ts"]) / steps
    busy = sum(v[0] for v in charged.values()) / steps
    print(f"  critical path: span {span / 1e3:.3f} ms per step, charged {busy / 1e3:.3f} ms, idle "
          f"{sum(v[1] for v in charged.values()) / steps / 1e3:.3f} ms")
    for name, (c, idle, n) in sorted(charged.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {c / steps:9.1f} us  idle before {idle / steps:7.1f} us  x{n / steps:<6.1f} {name}")
    # Spread over every step, or a few long pauses (a GC, the profiler)? The largest gaps, in trace order.
    total = sum(g[0] for g in gaps)
    largest = sorted(gaps, reverse=True)[:8]
    print(f"  idle: {len(gaps)} gaps, {sum(g[0] > 10 for g in gaps)} over 10 us; the {len(largest)} largest hold "
          f"{sum(g[0] for g in largest) / max(total, 1e-9):.0%} of it:")
    for idle, at, name in sorted(largest, key=lambda g: g[1]):
        print(f"    {idle:8.1f} us at {at / 1e3:8.3f} ms, before {name}")


PROMPT_LEN = 100
PROFILE_WARM = 3  # steps run under the profiler before the recorded ones (see profile_batch)


def host_profile(engine: LLMEngine, steps: int, top: int) -> None:
    """The host side of `steps` steps (rank 0's process): wall time per step without any profiler, then the
    same number of steps under cProfile, functions by own time (where the host's time goes when the GPU
    idles between steps: scheduling, the step message to the workers, uploads, sampling's read-back)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    print(f"  host: {(time.perf_counter() - start) / steps * 1e3:.2f} ms per step (wall, no profiler)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    prof.disable()
    for order in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(order).print_stats(top)
        print("\n".join("  " + line for line in out.getvalue().splitlines() if line.strip()))


def profile_batch(engine: LLMEngine, batch: int, vocab: int, top: int, steps: int, sequence: int,
                  critical_path: bool = False, prefill: int = 0, host: bool = False) -> None:
    """`prefill` > 0: each profiled step also prefills a new prompt of that many tokens (a mixed step).
    `host`: `host_profile` instead of the device trace (decode steps only)."""
    rng = random.Random(batch)
    # Prefill steps (chunked by the token budget), then warm decode steps (compiles every variant): a large
    # batch's prompts take several steps, and a profiled step must not still be prefilling.
    warm = 6 + -(-batch * PROMPT_LEN // engine.config.max_num_batched_tokens)
    for i in range(batch):
        engine.add_request(f"p{batch}-{i}", [rng.randrange(vocab) for _ in range(PROMPT_LEN)],
                           SamplingParams(temperature=0.0, max_tokens=warm + 16 + 3 * steps + PROFILE_WARM,
                                          ignore_eos=True))
    for _ in range(warm):
        engine.step()
    for s in range(3 if prefill else 0):  # warm the mixed step's shapes too
        engine.add_request(f"w{batch}-{s}", [rng.randrange(vocab) for _ in range(prefill)],
                           SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        engine.step()
    if host:
        host_profile(engine, steps, top)
        while engine.has_unfinished_requests():
            engine.step()
        return
    def one_step(s: int) -> None:
        if prefill:
            engine.add_request(f"m{batch}-{s}", [rng.randrange(vocab) for _ in range(prefill)],
                               SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        engine.step()

    torch.cuda.synchronize()
    start = time.perf_counter()
    for s in range(steps):
        one_step(s)
    torch.cuda.synchronize()
    print(f"  wall without the profiler: {(time.perf_counter() - start) / steps * 1e3:.3f} ms per step")
    # The profiled window opens after PROFILE_WARM steps that run under the profiler but are not recorded, and
    # with no synchronize before it: the queue is as full as in a running engine, so the first recorded step's
    # eager inputs do not start at the host's pace with an idle GPU.
    schedule = torch.profiler.schedule(wait=0, warmup=PROFILE_WARM, active=steps, repeat=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], schedule=schedule) as prof:
        for s in range(PROFILE_WARM + steps):
            one_step(steps + s)
            if s == PROFILE_WARM + steps - 1:
                torch.cuda.synchronize()  # the last recorded step's kernels complete inside the window
            prof.step()
    rows = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    rows.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in rows) / steps
    launches = sum(e.count for e in rows) / steps
    kind = f" + a {prefill}-token prefill" if prefill else ""
    print(f"batch {batch}{kind}: {total / 1e3:.2f} ms device time, {launches:.0f} kernels per step")
    for e in rows[:top]:
        print(f"  {e.self_device_time_total / steps:9.1f} us  x{e.count / steps:<7.1f} {e.key[:100]}")
    if critical_path or sequence:
        events = kernel_events(prof)
    if critical_path:
        print_critical_path(events, steps, top)
    if sequence:
        for e in events[len(events) // 10:len(events) // 10 + sequence]:
            print(f"    {e['dur']:7.1f} us  {e['name'][:60]:60s} grid {e.get('args', {}).get('grid')}")
    while engine.has_unfinished_requests():
        engine.step()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--mode", default="deterministic")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--steps", type=int, default=1, help="decode steps profiled (figures are per step)")
    ap.add_argument("--graphs", action="store_true", help="CUDA graphs on (the engine's default) instead of eager")
    ap.add_argument("--sequence", type=int, default=0, help="also print this many consecutive kernels in order")
    ap.add_argument("--prefill", type=int, default=0, help="profile mixed steps: each also prefills a new "
                    "prompt of this many tokens")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (rank 0 is profiled)")
    ap.add_argument("--critical-path", action="store_true", help="also charge each kernel the time from the "
                    "previous kernel's end to its own end, per name")
    ap.add_argument("--host", action="store_true", help="profile rank 0's host side instead (cProfile; "
                    "wall time per step first)")
    ap.add_argument("--preset", default=None, help="a random-model preset at full size (e.g. qwen3-30b-a3b) "
                    "instead of qwen3-8b shapes with --layers")
    ap.add_argument("--quantization", choices=["fp8"], default=None,
                    help="qwen3-8b shapes in block-scaled FP8 (weights quantized at load)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_decode_step needs a CUDA GPU", file=sys.stderr)
        return 2
    config = EngineConfig(mode=args.mode, max_num_seqs=256, max_model_len=max(1024, args.prefill + 64),
                          enforce_eager=not args.graphs, tensor_parallel_size=args.tp)
    if args.preset:
        cfg = preset_config(args.preset)
        print(f"{torch.cuda.get_device_name()}  {args.preset}  mode {args.mode}")
        engine = LLMEngine.from_weights(RandomWeights(0, torch.bfloat16), cfg, config, torch.device("cuda", 0))
    else:
        cfg = qwen3_8b_config(args.layers, 1024, args.quantization)
        model = model_in_mode(random_model(cfg, torch.device("cuda"), seed=0), cfg, args.mode)
        roof = matmul_weight_bytes(model) / HBM_BYTES_PER_S
        print(f"{torch.cuda.get_device_name()}  layers {args.layers}  mode {args.mode}  roofline {roof * 1e3:.2f} ms")
        engine = LLMEngine.from_model(model, cfg, config)
    for b in args.batches.split(","):
        profile_batch(engine, int(b), cfg.vocab_size, args.top, args.steps, args.sequence, args.critical_path,
                      args.prefill, args.host)
    return 0


if __name__ == "__main__":
    sys.exit(main())
