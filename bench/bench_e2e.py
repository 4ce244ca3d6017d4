"""End-to-end engine benchmark: fast vs deterministic mode on one random Qwen3-8B-shaped model.

The Thinking Machines setup ("Defeating Nondeterminism in LLM Inference"): 1000 requests, prompts of
~100 tokens, output lengths uniform in 90..110 (ignore_eos), all submitted at once; wall time and output
tokens/s per mode, and their ratio. Then decode tokens/s at fixed batch sizes (every sequence decoding,
CUDA graphs) against the weight-bandwidth roofline (all matmul weights read once per step at 3.0 TB/s).

The model is built from a ModelConfig with random bf16 weights initialised in place on the GPU (no
checkpoint file); both modes share the same weight tensors. No tokenizer: prompts are random token ids.

    python bench/bench_e2e.py                                  # full: 36 layers, 1000 requests
    python bench/bench_e2e.py --layers 4 --num-requests 100    # quick, scaled down
    python bench/bench_e2e.py --async-scheduling on,off       # overlapped scheduling on and off
    python bench/bench_e2e.py --tensor-parallel-size 2        # the same on 2 GPUs (tensor parallelism)

Per decode batch it also splits a step's wall time into the host's time blocked waiting for the device
(`wait`, in Event.synchronize: the engine reads a step's results back through one event) and the rest
(`host`: scheduling, inputs, launches, output processing). With --async-scheduling on,off the host time
hidden per step is step_ms(off) - step_ms(on).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from detinfer.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from detinfer.models.config import ModelConfig  # noqa: E402
from detinfer.models.families import preset_hf_config  # noqa: E402
from detinfer.models.transformer import Transformer  # noqa: E402
from detinfer.models.weight_sources import random_model as build_random  # noqa: E402

HBM_BYTES_PER_S = 3.0e12  # measured device-to-device copy on this H100 kind (docs/performance.md)


def qwen3_8b_config(layers: int, max_len: int, quantization: str | None = None) -> ModelConfig:
    """The qwen3-8b preset's shape with `layers` layers, `max_len` positions, bf16 (FP8 linears with
    `quantization="fp8"`: block-scaled W8A8, lm_head and norms stay bf16)."""
    cfg = {**preset_hf_config("qwen3-8b"), "num_hidden_layers": layers, "max_position_embeddings": max_len,
           "torch_dtype": "bfloat16"}
    return dataclasses.replace(ModelConfig.from_dict(cfg), quantization=quantization)


def random_model(cfg: ModelConfig, device: torch.device, seed: int) -> Transformer:
    """Fast-mode model with seeded random bf16 weights (models.weight_sources.random_model)."""
    return build_random(cfg, seed=seed, mode="fast", device=device, dtype=torch.bfloat16)


def model_in_mode(fast_model: Transformer, cfg: ModelConfig, mode: str) -> Transformer:
    """The same model (same weight tensors, no copy) switched to another Ops mode."""
    fast_model.set_ops(fast_model.ops.replace(mode=mode))
    return fast_model


def matmul_weight_bytes(model: Transformer) -> int:
    """Bytes of every weight a decode step reads in full (all linears + lm_head; the embedding is only
    gathered, norms are negligible but counted)."""
    total = 0
    for name, p in model.named_parameters():
        if name == "embed_tokens" and model.lm_head is not None:
            continue
        total += p.numel() * p.element_size()
    return total


def workload(n: int, vocab: int, seed: int, prompt_len: int, output_kind: str = "final_only"):
    """`output_kind` "final_only" is what `LLM.generate` asks the engine for (only the final outputs are
    used); "cumulative" reproduces runs before that (a growing copy of every running request's output per step)."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        plen = rng.randint(prompt_len - 5, prompt_len + 5)
        prompt = [rng.randrange(vocab) for _ in range(plen)]
        reqs.append((f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=rng.randint(90, 110),
                                                     ignore_eos=True, output_kind=output_kind)))
    return reqs


def warm_up(engine: LLMEngine, vocab: int) -> None:
    """Compile every kernel variant before timing: prefills of many lengths (the attention tile height
    follows the longest chunk), each added in its own step so it mixes with the earlier ones' decodes."""
    rng = random.Random(2)
    for i, n in enumerate((1, 2, 3, 5, 9, 17, 33, 65, 129, 257, 513, 100, 100, 100)):
        engine.add_request(f"warm{i}", [rng.randrange(vocab) for _ in range(n)],
                           SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        engine.step()
    drain(engine)


def count_graph_steps(engine: LLMEngine) -> dict:
    """Counts graph / eager steps, and times every step (host wall time of `step()`, which ends with the
    logits on the host) by kind: "mixed" (a prefill chunk in the step) or "decode"."""
    counts = {"graph": 0, "eager": 0, "mixed_graph": 0, "step_ms": {"mixed": [], "decode": []},
              "mixed_tokens": []}
    # Under tensor parallelism the engine's runner sends each step to the workers and runs rank 0's
    # ModelRunner (`.local`): that one picks graph or eager.
    local = getattr(engine.runner, "local", engine.runner)
    runner, orig_graph, orig_eager, orig_step = engine.runner, local._run_graph, local._run_eager, engine.step
    kind = []

    def graph(host, *args, **kwargs):
        counts["graph"] += 1
        counts["mixed_graph"] += not host.all_single_token
        return orig_graph(host, *args, **kwargs)

    def eager(host, *args, **kwargs):
        counts["eager"] += 1
        return orig_eager(host, *args, **kwargs)

    def execute(batch, input_ids=None, argmax_only=False, _orig=runner.execute):
        kind.append("decode" if batch.layout.all_single_token else "mixed")
        if kind[-1] == "mixed":
            counts["mixed_tokens"].append(batch.layout.num_tokens)
        return _orig(batch, input_ids, argmax_only)

    def step():
        kind.clear()
        t = time.perf_counter()
        out = orig_step()
        if kind:
            counts["step_ms"][kind[-1]].append((time.perf_counter() - t) * 1e3)
        return out

    local._run_graph, local._run_eager, runner.execute, engine.step = graph, eager, execute, step
    return counts


_PLAIN_GREEDY = SamplingParams.__dict__["is_plain_greedy"]


def set_argmax_only(on: bool) -> None:
    """--argmax-only off: no request counts as plain greedy, so every step finishes as full logits and goes
    through the sampler (the engine's path before argmax-only steps existed)."""
    SamplingParams.is_plain_greedy = _PLAIN_GREEDY if on else property(lambda self: False)


def step_summary(ms: list[float]) -> str:
    if not ms:
        return "none"
    return f"{len(ms)} steps, median {statistics.median(ms):.2f} ms, mean {statistics.mean(ms):.2f} ms, " \
        f"total {sum(ms) / 1e3:.2f} s"


def drain(engine: LLMEngine) -> dict:
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def run_e2e(engine: LLMEngine, reqs) -> dict:
    """Submit every request at once and step until all finish; wall time and output tokens/s."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    steps0 = engine.stats().num_steps
    start = time.perf_counter()
    for rid, prompt, params in reqs:
        engine.add_request(rid, prompt, params)
    final = drain(engine)
    wall = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in final.values())
    return {"wall_s": wall, "output_tokens": out_tokens, "output_tok_s": out_tokens / wall,
            "steps": engine.stats().num_steps - steps0,
            "tokens": {r: final[r].outputs[0].token_ids for r, _, _ in reqs}}


class WaitClock:
    """Seconds the host spends in torch.cuda.Event.synchronize (waiting for the device), while installed."""

    def __init__(self):
        self.seconds, self._orig = 0.0, None

    def __enter__(self):
        if torch.cuda.is_available():
            self._orig = orig = torch.cuda.Event.synchronize

            def timed(event):
                t = time.perf_counter()
                orig(event)
                self.seconds += time.perf_counter() - t

            torch.cuda.Event.synchronize = timed
        return self

    def __exit__(self, *exc):
        if self._orig is not None:
            torch.cuda.Event.synchronize = self._orig


def decode_rate(engine: LLMEngine, batch: int, vocab: int, steps: int, seed: int) -> dict:
    """Median step time of steps where exactly `batch` sequences decode (graph replays), and the median
    split of such a step into host work and waiting for the device."""
    rng = random.Random(seed)
    for i in range(batch):
        engine.add_request(f"d{batch}-{i}", [rng.randrange(vocab) for _ in range(100)],
                           SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True))
    times, waits = [], []
    with WaitClock() as clock:
        while engine.has_unfinished_requests():
            before = clock.seconds
            engine.step()
            s = engine.stats()
            if s.last_step_tokens == batch and s.num_running == batch and s.num_waiting == 0:
                times.append(s.last_step_seconds)
                waits.append(clock.seconds - before)
    times, waits = times[2:], waits[2:]  # the first decode steps may still compile / warm caches
    med = statistics.median(times)
    host = statistics.median(t - w for t, w in zip(times, waits))
    return {"batch": batch, "steps_timed": len(times), "step_ms": med * 1e3, "tok_s": batch / med,
            "host_ms": host * 1e3, "wait_ms": statistics.median(waits) * 1e3}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--modes", default="fast,deterministic")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--decode-batches", default="1,64")
    ap.add_argument("--decode-steps", type=int, default=48)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--cuda-graph-max-tokens", type=int, default=EngineConfig.cuda_graph_max_tokens,
                    help="largest graphed step with prefill chunks (0: mixed steps run eagerly)")
    ap.add_argument("--cuda-graph-short-kv", action=argparse.BooleanOptionalAction, default=True,
                    help="also capture decode graphs bounded to 256 keys (A/B: --no-cuda-graph-short-kv)")
    ap.add_argument("--async-scheduling", default="on",
                    help="on, off, or on,off: overlapped scheduling setting(s) to run each mode with")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="GPUs to split the model over (rank r on the r-th GPU from cuda:0)")
    ap.add_argument("--tp-invariant-reduction", action="store_true",
                    help="deterministic row-parallel sums with TP=1's bits at any TP size "
                    "(docs/tensor-parallel.md); at "
                    "TP=1 it swaps the shared model's o_proj/down_proj in place: keep the default mode order")
    ap.add_argument("--quantization", choices=["fp8"], default=None,
                    help="fp8: the random model's linears block-scaled FP8 (W8A8), as an FP8 checkpoint loads")
    ap.add_argument("--repeat", type=int, default=1, help="timed e2e runs per mode (the median is reported)")
    ap.add_argument("--output-kind", default="final_only",
                    help="the workload's SamplingParams.output_kind (final_only: as LLM.generate; cumulative: as "
                    "runs before it); a comma list alternates them over the repeats (an A/B in one engine)")
    ap.add_argument("--argmax-only", default="on",
                    help="on: greedy steps finish as argmax ids (the engine's default); off: as full logits (as "
                    "before it); a comma list alternates with the output kinds over the repeats")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test the script (tiny --layers)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("bench_e2e needs a CUDA GPU (or --device cpu for a smoke test)", file=sys.stderr)
        return 2
    cuda = dev.type == "cuda"
    cfg = qwen3_8b_config(args.layers, args.max_model_len, args.quantization)
    t = time.perf_counter()
    fast_model = random_model(cfg, dev, seed=0)
    wbytes = matmul_weight_bytes(fast_model)
    roof_step = wbytes / args.tensor_parallel_size / HBM_BYTES_PER_S  # each GPU reads its shard of the weights
    name = torch.cuda.get_device_name() if cuda else "cpu"
    tp = args.tensor_parallel_size
    print(f"{name}  torch {torch.__version__}  layers {args.layers}  TP {tp}  weights read per step"
          f"  {wbytes / 1e9:.2f} GB{f' ({wbytes / tp / 1e9:.2f} GB per GPU)' if tp > 1 else ''} -> roofline "
          f"{roof_step * 1e3:.2f} ms/step  (built in "
          f"{time.perf_counter() - t:.1f}s)", flush=True)
    kinds = args.output_kind.split(",")
    variants = [(k, a) for a in args.argmax_only.split(",") for k in kinds]  # cycled over the repeats
    reqs = workload(args.num_requests, cfg.vocab_size, seed=1, prompt_len=args.prompt_len, output_kind=kinds[0])
    results = {}
    overlaps = [v.strip() for v in args.async_scheduling.split(",")]
    if not overlaps or any(v not in ("on", "off") for v in overlaps):
        print(f"--async-scheduling takes on, off or on,off; got {args.async_scheduling!r}", file=sys.stderr)
        return 2
    for mode, overlap in [(m, o) for m in args.modes.split(",") for o in overlaps]:
        key = mode if len(overlaps) == 1 else f"{mode}/async-{overlap}"
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        t = time.perf_counter()
        engine = LLMEngine.from_model(model_in_mode(fast_model, cfg, mode), cfg, EngineConfig(
            mode=mode, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
            cuda_graph_max_tokens=args.cuda_graph_max_tokens, cuda_graph_short_kv=args.cuda_graph_short_kv,
            async_scheduling=overlap == "on", tensor_parallel_size=args.tensor_parallel_size,
            tp_invariant_reduction=args.tp_invariant_reduction))
        init_s = time.perf_counter() - t
        graphs = engine.runner.graphs
        if graphs is not None:
            bounds = len({s.max_kv_len for s in graphs.shapes.values() if s.kind == "decode"})
            print(f"[{key}] captured {len(graphs.shapes)} CUDA graphs ({len(engine.runner.graph_sizes)} decode "
                  f"(x{bounds} kv bounds), "
                  f"{len(engine.runner.mixed_graph_tokens)} mixed up to "
                  f"{(engine.runner.mixed_graph_tokens or [0])[-1]} tokens) in {graphs.capture_seconds:.1f} s; "
                  f"pool {graphs.pool_bytes / 2**20:.0f} MiB + static {graphs.static_bytes() / 2**20:.0f} MiB, "
                  f"reserved {engine.runner.graph_reserve_bytes / 2**20:.0f} MiB (profiled step peak "
                  f"{engine.runner.graph_step_peak_bytes / 2**20:.0f} MiB)", flush=True)
        t = time.perf_counter()
        warm_up(engine, cfg.vocab_size)
        warm_s = time.perf_counter() - t
        counts = count_graph_steps(engine)
        runs = []
        for i in range(args.repeat):
            # Each repeat gets its own random prompts: a repeat of the same prompts would hit the prefix
            # cache and skip most prefill work. Collected garbage first, so no GC pause of the earlier
            # run's objects lands inside the timed region.
            gc.collect()
            kind, argmax = variants[i % len(variants)]
            set_argmax_only(argmax == "on")
            n_decode = len(counts["step_ms"]["decode"])
            runs.append(run_e2e(engine, reqs if i == 0 else workload(
                args.num_requests, cfg.vocab_size, seed=100 + i, prompt_len=args.prompt_len, output_kind=kind)))
            runs[-1]["variant"] = f"{kind}, argmax-only {argmax}"
            runs[-1]["decode_median_ms"] = statistics.median(counts["step_ms"]["decode"][n_decode:] or [0.0])
        set_argmax_only(True)
        res = sorted(runs, key=lambda r: r["wall_s"])[(len(runs) - 1) // 2] | {"tokens": runs[0]["tokens"]}
        res["all_wall_s"] = [r["wall_s"] for r in runs]
        res["graph_steps"], res["eager_steps"] = counts["graph"] // len(runs), counts["eager"] // len(runs)
        res["mixed_graph_steps"] = counts["mixed_graph"] // len(runs)
        # copies taken now: decode_rate below steps the same (still wrapped) engine
        res["step_ms"] = {k: list(v) for k, v in counts["step_ms"].items()}
        toks = sorted(counts["mixed_tokens"])
        res.update(mode=mode, async_scheduling=overlap, init_s=init_s, warmup_s=warm_s,
                   kv_blocks=engine.runner.num_kv_blocks, graphs=engine.runner.graph_sizes)
        res["decode"] = [decode_rate(engine, int(b), cfg.vocab_size, args.decode_steps, seed=3)
                         for b in args.decode_batches.split(",")]
        results[key] = res
        print(f"[{key}] init {init_s:.1f}s warmup {warm_s:.1f}s  e2e wall {res['wall_s']:.2f}s "
              f"(runs {', '.join(f'{w:.2f}' for w in res['all_wall_s'])})  "
              f"{res['output_tokens']} output tokens  {res['output_tok_s']:.0f} tok/s  steps {res['steps']}  "
              f"(graph {res['graph_steps']} of which mixed {res['mixed_graph_steps']}, eager {res['eager_steps']})  "
              f"kv blocks {res['kv_blocks']}", flush=True)
        if len(variants) > 1:
            for v in dict.fromkeys(r["variant"] for r in runs):
                walls = ", ".join(f"{r['wall_s']:.2f}" for r in runs if r["variant"] == v)
                medians = ", ".join(f"{r['decode_median_ms']:.2f}" for r in runs if r["variant"] == v)
                print(f"[{key}] {v}: runs {walls} s, decode step medians {medians} ms", flush=True)
        for k, ms in res["step_ms"].items():
            print(f"[{key}] {k} steps (all timed runs): {step_summary(ms)}", flush=True)
        if toks:
            print(f"[{key}] mixed-step tokens: min {toks[0]}, median {toks[len(toks) // 2]}, max {toks[-1]}, "
                  f"<= 512: {sum(t <= 512 for t in toks)}, <= 2048: {sum(t <= 2048 for t in toks)} of {len(toks)}",
                  flush=True)
        for d in res["decode"]:
            roof = d["batch"] / roof_step
            print(f"[{key}] decode batch {d['batch']:>3}: {d['step_ms']:.2f} ms/step  {d['tok_s']:.0f} tok/s  "
                  f"= {d['tok_s'] / roof:.0%} of roofline {roof:.0f} tok/s  (host {d['host_ms']:.2f} ms, "
                  f"waiting for the device {d['wait_ms']:.2f} ms)", flush=True)
        engine.close()  # stops tensor-parallel workers at once (a no-op otherwise)
        del engine
    suffixes = [""] if len(overlaps) == 1 else [f"/async-{o}" for o in overlaps]
    for sfx in suffixes:
        if {"fast" + sfx, "deterministic" + sfx} <= results.keys():
            f, d = results["fast" + sfx], results["deterministic" + sfx]
            same = sum(f["tokens"][r] == d["tokens"][r] for r, _, _ in reqs)
            print(f"deterministic / fast wall-time ratio{sfx}: {d['wall_s'] / f['wall_s']:.3f} (goal <= 1.10, must "
                  f"be <= 1.25); requests with identical tokens in both modes: {same}/{len(reqs)}")
    if len(overlaps) == 2:
        for mode in args.modes.split(","):
            on, off = results[f"{mode}/async-on"], results[f"{mode}/async-off"]
            same = all(on["tokens"][r] == off["tokens"][r] for r, _, _ in reqs)
            print(f"[{mode}] async on / off: e2e wall {on['wall_s']:.2f} s / {off['wall_s']:.2f} s; identical "
                  f"tokens: {same}", flush=True)
            for a, b in zip(on["decode"], off["decode"]):
                print(f"[{mode}] decode batch {a['batch']:>3}: host time hidden per step "
                      f"{b['step_ms'] - a['step_ms']:.2f} ms (step {b['step_ms']:.2f} -> {a['step_ms']:.2f} ms)")
    if args.json:
        for r in results.values():
            r.pop("tokens")
        Path(args.json).write_text(json.dumps({"args": vars(args), "weight_bytes": wbytes, "results": results},
                                              indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
