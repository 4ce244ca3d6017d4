"""Helpers shared by the training tests and benchmarks: random models of real shapes, comparing a trainer's
logprobs with the sampler's (engine.testing.sample_under_load), and running a function in N gloo processes
(data-parallel tests)."""

from __future__ import annotations

import datetime
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from detinfer.models.config import ModelConfig
from detinfer.models.families import preset_hf_config
from detinfer.models.transformer import Transformer
from detinfer.models.weight_sources import random_model as build_random

_QWEN3 = preset_hf_config("qwen3-8b")
SHAPES: dict[str, dict] = {
    "qwen3-8b": _QWEN3,
    # the models people train with RL on one GPU (public config.json shapes, for memory benchmarks;
    # Llama 3.2's rope scaling is left out: it changes no shape)
    "qwen3-4b": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, tie_word_embeddings=True),
    "qwen3-1.7b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, tie_word_embeddings=True),
    "llama-3.2-3b": dict(preset_hf_config("llama-3.1-8b"), hidden_size=3072, intermediate_size=8192,
                         num_hidden_layers=28, num_attention_heads=24, head_dim=128, tie_word_embeddings=True),
    "smollm2-135m": dict(architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                         max_position_embeddings=8192, tie_word_embeddings=True, eos_token_id=2),
}


def random_model(shape: str, *, layers: int | None = None, mode: str = "deterministic",
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0) -> tuple[Transformer, ModelConfig]:
    """A Transformer of a named shape (`SHAPES`), optionally truncated to `layers`, with the seeded random
    weights of models.weight_sources.random_model."""
    cfg = dict(SHAPES[shape])
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    config = ModelConfig.from_dict(cfg)
    return build_random(config, seed=seed, mode=mode, device=device, dtype=dtype), config


def pack(seqs: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[int]]:
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + len(s))
    return torch.tensor([t for s in seqs for t in s], dtype=torch.int64), cu


def mismatch(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
    """pairs of (trainer logprobs, sampler logprobs) of the same tokens -> (fraction of tokens that differ,
    max |difference|)."""
    got = torch.cat([g.detach().float().cpu() for g, _ in pairs])
    want = torch.cat([w.detach().float().cpu() for _, w in pairs])
    if got.numel() == 0:
        return 0.0, 0.0
    return (got != want).float().mean().item(), (got - want).abs().max().item()


def kl_per_token(logprobs_p: torch.Tensor, logprobs_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) of each row of two [N, V] log-distributions, in fp64."""
    lp, lq = logprobs_p.double(), logprobs_q.double()
    return (lp.exp() * (lp - lq)).sum(-1)


def run_ranks(target: Callable, world_size: int, args: tuple = (), *, backend: str = "gloo",
              timeout_s: float = 300.0) -> list:
    """Run `target(rank, *args)` in `world_size` spawned processes that have joined one default process
    group (`backend` "gloo", or "nccl" with rank r on cuda:r and the package's NCCL environment defaults);
    -> the ranks' return values (torch.save-able, moved to the CPU by the caller), in rank order. A rank's
    exception is re-raised here with its traceback; ranks still running after `timeout_s` are killed (never
    a hang). The group is always destroyed. `target` must be importable by name (a module-level function)."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    import torch.multiprocessing as mp

    from detinfer.distributed.group import master_store
    store = master_store(world_size)  # the parent hosts the rendezvous: no free-port race
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=_rank_main, args=(target, r, world_size, store.port, args, out_dir, errors,
                                                       backend, timeout_s)) for r in range(world_size)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, proc in enumerate(procs) if proc.is_alive()]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        found = []
        while not errors.empty():
            found.append(errors.get())
        if found or hung or any(proc.exitcode != 0 for proc in procs):
            raise RuntimeError(f"{backend} ranks failed (still running after {timeout_s}s: {hung}, exit codes "
                               f"{[proc.exitcode for proc in procs]}):\n" + "\n".join(found))
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def _rank_main(target, rank, world_size, port, args, out_dir, errors, backend, timeout_s) -> None:
    try:
        if backend == "nccl":
            from detinfer.distributed.group import NCCL_ENV_DEFAULTS
            for key, value in NCCL_ENV_DEFAULTS.items():  # NVLink SHARP off: see distributed/group.py
                os.environ.setdefault(key, value)
            torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, world_size, False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            result = target(rank, *args)
        finally:
            dist.destroy_process_group()
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
