"""Server throughput: N requests with C in flight through `detinfer serve`, then the same requests through
the offline engine in this process, side by side.

    # against a server this script starts (and stops before the offline run, so both get the whole GPU):
    python bench/bench_server.py MODEL_DIR --start-server [--num-requests 256] [--concurrency 64] \
        [--input-len 256] [--output-len 128] [--json FILE] [engine flags: --mode, --max-num-seqs, ...] \
        [--no-engine-process: the server steps its engine on a thread instead of in its own process]
    # against a server already running (the offline run then shares the device with it):
    python bench/bench_server.py MODEL_DIR --url http://127.0.0.1:8000 --served-model-name NAME

Requests are token-id prompts of exactly --input-len random (seeded) ids asking for exactly --output-len
tokens (ignore_eos), greedy unless --temperature, streamed so that time to first token is measured.
Reported: wall time, requests/s, output tokens/s, latency and TTFT percentiles, server-side step times
(from /metrics) and, per request, whether HTTP and offline text and logprobs are bit-identical (they
should all be in deterministic mode; in fast mode they may differ: batches differ).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from detinfer.engine.config import EngineConfig, add_dataclass_args, from_args  # noqa: E402
from detinfer.server.metrics import parse_metrics  # noqa: E402


def make_requests(vocab: list[int], n: int, input_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.choice(vocab) for _ in range(input_len)] for _ in range(n)]


def engine_flags(cfg: EngineConfig) -> list[str]:
    """CLI flags reproducing `cfg` (non-default fields only) for the server subprocess."""
    out = []
    for f in dataclasses.fields(cfg):
        value, flag = getattr(cfg, f.name), "--" + f.name.replace("_", "-")
        if value == f.default:
            continue
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, "none" if value is None else str(value)]
    return out


def start_server(model_dir: str, name: str, cfg: EngineConfig, device: str | None,
                 extra: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "detinfer.server.serve", model_dir, "--port", str(port), "--served-model-name",
           name, "--uvicorn-log-level", "warning", "--max-pending-requests", "100000", *engine_flags(cfg)]
    if device:
        cmd += ["--device", device]
    cmd += extra
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not become healthy in 600 s")


async def run_http(url: str, name: str, prompts: list[list[int]], args) -> dict:
    import httpx

    sem = asyncio.Semaphore(args.concurrency)
    results: list[dict | None] = [None] * len(prompts)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)

    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as http:
        async def one(i: int, output_len: int) -> None:
            body = {"model": name, "prompt": prompts[i], "max_tokens": output_len, "ignore_eos": True,
                    "temperature": args.temperature, "seed": i, "logprobs": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with sem:
                t0 = time.perf_counter()
                ttft, text, lps, usage = None, [], [], None
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        raise SystemExit(f"request {i}: HTTP {r.status_code}: {await r.aread()}")
                    async for line in r.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            raise SystemExit(f"request {i}: {chunk['error']}")
                        for c in chunk["choices"]:
                            if ttft is None and c["text"]:
                                ttft = time.perf_counter() - t0
                            text.append(c["text"])
                            lps += (c.get("logprobs") or {}).get("token_logprobs", [])
                        usage = chunk.get("usage") or usage
                results[i] = {"latency": time.perf_counter() - t0, "ttft": ttft, "text": "".join(text),
                              "logprobs": lps, "output_tokens": usage["completion_tokens"]}

        # Warm-up (not measured): the same prompts at full concurrency with a few output tokens, so the
        # measured run does not pay Triton's JIT compilation and CUDA-graph capture.
        await asyncio.gather(*(one(i % len(prompts), 8) for i in range(args.warmup_requests)))
        before = parse_metrics((await http.get("/metrics")).text)
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, args.output_len) for i in range(len(prompts))))
        wall = time.perf_counter() - t0
        after = parse_metrics((await http.get("/metrics")).text)
    steps = after["detinfer_engine_step_seconds_count"] - before["detinfer_engine_step_seconds_count"]
    step_time = after["detinfer_engine_step_seconds_sum"] - before["detinfer_engine_step_seconds_sum"]
    out_tokens = sum(r["output_tokens"] for r in results)
    lat = sorted(r["latency"] for r in results)
    ttft = sorted(r["ttft"] for r in results if r["ttft"] is not None) or [float("nan")]
    return {"wall_s": wall, "requests_per_s": len(prompts) / wall, "output_tokens_per_s": out_tokens / wall,
            "output_tokens": out_tokens, "latency_p50_s": _pct(lat, 50), "latency_p99_s": _pct(lat, 99),
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99), "engine_steps": steps,
            "mean_step_s": step_time / steps if steps else float("nan"),
            "engine_busy_fraction": step_time / wall, "results": results}


def run_offline(model_dir: str, cfg: EngineConfig, device: str | None, prompts: list[list[int]], args) -> dict:
    from detinfer.engine.core_client import EngineCoreClient
    from detinfer.engine.llm_engine import LLMEngine
    from detinfer.engine.sampling_params import SamplingParams

    engine = (EngineCoreClient if args.offline_engine_process else LLMEngine)(model_dir, cfg, device=device)

    def add(i: int) -> None:
        engine.add_request(str(i), prompts[i], SamplingParams(max_tokens=args.output_len, ignore_eos=True,
                                                              temperature=args.temperature, seed=i, logprobs=0))

    # Closed loop like the HTTP client: at most `concurrency` requests in the engine, the next one added as
    # soon as one finishes (0: all queued at once, the engine's own best case).
    limit = args.offline_concurrency if args.offline_concurrency > 0 else len(prompts)
    final = {}
    t0 = time.perf_counter()
    nxt = min(limit, len(prompts))
    for i in range(nxt):
        add(i)
    steps, step_s = 0, 0.0
    while engine.has_unfinished_requests():
        ts = time.perf_counter()
        outs = engine.step()
        step_s += time.perf_counter() - ts
        steps += 1
        for out in outs:
            if out.finished:
                final[int(out.request_id)] = out.outputs[0]
                if nxt < len(prompts):
                    add(nxt)
                    nxt += 1
    wall = time.perf_counter() - t0
    if args.offline_engine_process:
        engine.close()
    out_tokens = sum(len(o.token_ids) for o in final.values())
    return {"wall_s": wall, "requests_per_s": len(prompts) / wall, "output_tokens_per_s": out_tokens / wall,
            "output_tokens": out_tokens, "engine_steps": steps, "mean_step_s": step_s / max(steps, 1),
            "results": [{"text": final[i].text, "logprobs": [e.logprob for e in final[i].logprobs]}
                        for i in range(len(prompts))]}


def start_profiler(pid: int, out: str) -> subprocess.Popen | None:
    """py-spy sampling the server while the last HTTP run goes: which thread holds the GIL (--gil), raw
    collapsed stacks per thread. None (with a note) when py-spy is not installed."""
    import shutil

    found = [c for c in (Path(d) / "bin" / "py-spy" for d in sys.path if d) if c.exists()]  # pip --target
    exe = shutil.which("py-spy") or (str(found[0]) if found else None)
    if exe is None:
        print("--profile-server: py-spy not found", file=sys.stderr)
        return None
    return subprocess.Popen([exe, "record", "-p", str(pid), "--gil", "-t", "-f", "raw", "-r", "200", "-o", out],
                            stdout=subprocess.DEVNULL)


def write_random_checkpoint(model_dir: str, preset: str, device: str | None) -> None:
    """An HF-format directory with a preset's shapes (repro's random models), bf16 random weights drawn on
    the GPU when there is one, 4 shards, and the tests' tiny tokenizer (prompts are token ids anyway)."""
    import torch

    from detinfer.models.testing import tiny_config_dict, write_tiny_checkpoint
    from detinfer.repro.random_model import PRESETS

    if preset not in PRESETS:
        raise SystemExit(f"--write-random: unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    shape = {k: v for k, v in PRESETS[preset].items() if k in tiny_config_dict.__kwdefaults__}
    t0 = time.perf_counter()
    write_tiny_checkpoint(model_dir, PRESETS[preset]["architectures"][0], num_shards=4, dtype="bfloat16",
                          weights_device=device or ("cuda" if torch.cuda.is_available() else "cpu"), **shape)
    print(f"wrote a random {preset} checkpoint to {model_dir} in {time.perf_counter() - t0:.1f} s", flush=True)


def _pct(sorted_values: list[float], p: float) -> float:
    k = min(len(sorted_values) - 1, max(0, round(p / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--url", help="a running server; default: start one (with --start-server)")
    parser.add_argument("--start-server", action="store_true", help="start `detinfer serve` for the run")
    parser.add_argument("--served-model-name", default="bench")
    parser.add_argument("--device", default=None)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompt-seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--offline-concurrency", type=int, default=None,
                        help="offline run: most requests in the engine at once (default: --concurrency, like the "
                        "HTTP client; 0: all queued at once)")
    parser.add_argument("--warmup-requests", type=int, default=None,
                        help="unmeasured requests (8 output tokens) sent first (default: 2 x --concurrency)")
    parser.add_argument("--http-repeat", type=int, default=1, help="HTTP runs against the one server (the last "
                        "is reported; earlier ones print one line)")
    parser.add_argument("--profile-server", metavar="FILE", help="py-spy the started server during the last HTTP "
                        "run (GIL holder, raw stacks) into FILE")
    parser.add_argument("--server-arg", action="append", default=[], help="extra argument for `detinfer serve` "
                        "(repeat; e.g. --server-arg=--gil-switch-interval-ms --server-arg=20)")
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                        help="the started server runs its engine core in its own process (default, `detinfer "
                        "serve`'s default) or, with --no-engine-process, on a thread of the server process")
    parser.add_argument("--offline-engine-process", action="store_true", help="the offline run drives the engine "
                        "core in its own process too (LLM(engine_process=True)'s client) instead of in this one")
    parser.add_argument("--no-offline", action="store_true", help="skip the offline-engine comparison")
    parser.add_argument("--json", help="write the summary (no per-request results) to this file")
    parser.add_argument("--write-random", metavar="PRESET", help="first write a checkpoint of this shape with "
                        "random weights (a model family's preset, e.g. qwen3-8b) and a tiny byte tokenizer into "
                        "MODEL_DIR, unless MODEL_DIR already holds a config.json")
    add_dataclass_args(parser, EngineConfig)
    args = parser.parse_args(argv)
    if bool(args.url) == bool(args.start_server):
        parser.error("give exactly one of --url and --start-server")
    cfg = from_args(EngineConfig, args)
    if args.warmup_requests is None:
        args.warmup_requests = 2 * args.concurrency
    if args.offline_concurrency is None:
        args.offline_concurrency = args.concurrency
    if args.write_random and not (Path(args.model_dir) / "config.json").exists():
        # In a child process: after drawing the 16 GB of random weights on the GPU in this process, the offline
        # engine later run here took 14.9 ms per step instead of 11.4 (H100, Qwen3-8B shapes, same requests).
        child = multiprocessing.get_context("spawn").Process(
            target=write_random_checkpoint, args=(args.model_dir, args.write_random, args.device))
        child.start()
        child.join()
        if child.exitcode != 0:
            raise SystemExit(f"--write-random {args.write_random}: writing the checkpoint failed "
                             f"(exit code {child.exitcode}; see above)")

    from detinfer.models.loader import load_tokenizer

    tok = load_tokenizer(args.model_dir)
    special = set(tok.all_special_ids)
    vocab = [i for i in range(tok.vocab_size) if i not in special]
    prompts = make_requests(vocab, args.num_requests, args.input_len, args.prompt_seed)

    proc = None
    url = args.url
    if args.start_server:
        mode_flag = "--engine-process" if args.engine_process else "--no-engine-process"
        proc, url = start_server(args.model_dir, args.served_model_name, cfg, args.device,
                                 [mode_flag, *args.server_arg])
    try:
        for rep in range(args.http_repeat):
            prof = None
            if args.profile_server and proc is not None and rep == args.http_repeat - 1:
                prof = start_profiler(proc.pid, args.profile_server)
            http = asyncio.run(run_http(url, args.served_model_name, prompts, args))
            if prof is not None:
                prof.send_signal(signal.SIGINT)
                prof.wait(60)
            if rep < args.http_repeat - 1:
                print(f"HTTP run {rep + 1}: {http['wall_s']:.2f} s, {http['output_tokens_per_s']:.1f} out tok/s, "
                      f"{http['engine_steps']:.0f} steps, mean {1e3 * http['mean_step_s']:.2f} ms", flush=True)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    summary = {"config": {k: v for k, v in vars(args).items()}, "http": {k: v for k, v in http.items()
                                                                          if k != "results"}}
    where = "engine process" if args.engine_process else "engine thread"
    print(f"HTTP    : {args.num_requests} requests, concurrency {args.concurrency}, {args.input_len} in / "
          f"{args.output_len} out tokens, mode {cfg.mode}{f', {where}' if args.start_server else ''}")
    print(f"          {http['wall_s']:.2f} s  {http['requests_per_s']:.2f} req/s  "
          f"{http['output_tokens_per_s']:.1f} out tok/s  latency p50 {http['latency_p50_s']:.3f} s "
          f"p99 {http['latency_p99_s']:.3f} s  TTFT p50 {http['ttft_p50_s']:.3f} s p99 {http['ttft_p99_s']:.3f} s")
    print(f"          engine: {http['engine_steps']:.0f} steps, mean {1e3 * http['mean_step_s']:.2f} ms, "
          f"busy {100 * http['engine_busy_fraction']:.0f}% of the wall time")
    if not args.no_offline:
        off = run_offline(args.model_dir, cfg, args.device, prompts, args)
        same = sum(h["text"] == o["text"] and h["logprobs"] == o["logprobs"]
                   for h, o in zip(http["results"], off["results"]))
        summary["offline"] = {k: v for k, v in off.items() if k != "results"}
        summary["identical_outputs"] = same
        print(f"offline : concurrency {args.offline_concurrency or 'all'}: {off['wall_s']:.2f} s  "
              f"{off['requests_per_s']:.2f} req/s  "
              f"{off['output_tokens_per_s']:.1f} out tok/s  engine: {off['engine_steps']} steps, mean "
              f"{1e3 * off['mean_step_s']:.2f} ms")
        print(f"HTTP / offline throughput: {http['output_tokens_per_s'] / off['output_tokens_per_s']:.2f}; "
              f"bit-identical text+logprobs: {same}/{len(prompts)}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    if statistics.fmean(r["output_tokens"] for r in http["results"]) != args.output_len:
        print("warning: some requests returned fewer tokens than --output-len", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
