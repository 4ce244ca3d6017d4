"""The engines of a GRPO run: one, or a tensor-parallel sampler beside a one-process trainer's engine.

tensor_parallel_size 1, colocated: one engine samples and its model is trained in place (the one-GPU loop of
grpo.py). Otherwise (tensor_parallel_size N > 1, or the split layout) the sampler is an engine of its own, at
TP=N (rank 0 in this process, workers in their own), and the trainer trains a one-process (TP=1) engine's
model on the trainer's device. After every update
the trainer's weights, in the engine's dtype (bf16 engines: the fp32 masters rounded, the bits the trainer's
forward uses), are pushed into the sampler: each rank's shards in buckets over the TP group
(distributed/weight_push.py), then the sampler's prefix cache is dropped.

Bits: a TP=N forward sums o_proj / down_proj over ranks. With `tp_invariant_reduction` both engines cut those
reductions into the same fixed chunks and add them in the same pairwise tree (distributed/layers.py), so the
trainer's logprob of a sampled token has the sampler's bits at every TP size dividing the model's chunk count;
deterministic mode therefore requires the flag at TP > 1 (`check_parallel_config`).

Layouts (GPUs): colocated puts the sampler's ranks on cuda:b..b+N-1 from the trainer's GPU b on (the trainer's
engine and sampler rank 0 share GPU b; at N = 1 they are one engine); split on the GPUs after the trainer's,
cuda:b+1..b+N (at N = 1 on 2 GPUs: trainer on cuda:0, sampler on cuda:1, the weights copied across after
every update). On a CPU both layouts run the same processes on the same cores.
"""

from __future__ import annotations

import torch

from detinfer.rl.config import RLConfig, arm_engine_mode

KV_BLOCK_SIZE = 16


def check_parallel_config(config: RLConfig, mode: str) -> None:
    """ValueError naming the flags when the sampler's bits could not be the trainer's."""
    tp = config.tensor_parallel_size
    if mode == "deterministic" and tp > 1 and not config.tp_invariant_reduction:
        raise ValueError(f"tensor_parallel_size={tp} (--tensor-parallel-size) in deterministic mode needs "
                         "tp_invariant_reduction (--tp-invariant-reduction): the one-process trainer reproduces a "
                         "tensor-parallel sampler's logprobs bit for bit only when both sum the row-parallel "
                         "layers in the same fixed chunk tree")


def sampler_device(trainer_device: torch.device, config: RLConfig) -> torch.device:
    """Where the sampler's rank 0 runs (its other ranks on the following GPUs): see the module doc."""
    if trainer_device.type != "cuda" or config.layout == "colocated":
        return trainer_device
    base = trainer_device.index if trainer_device.index is not None else torch.cuda.current_device()
    first = base + config.trainer_ranks
    need, count = first + config.tensor_parallel_size, torch.cuda.device_count()
    if need > count:
        raise ValueError(f"layout 'split' (--layout) puts the trainer on cuda:{base} and the sampler's "
                         f"{config.tensor_parallel_size} ranks on cuda:{first}..{need - 1}, but only {count} GPUs "
                         "are visible; use --layout colocated or fewer --tensor-parallel-size ranks")
    return torch.device("cuda", first)


def run_engines(model, config: RLConfig, arm: str, device, max_model_len: int, *, follower: bool = False,
                eval_size: int = 0, trainer_class=None):
    """A GRPO run's engines: (sampler LLM or None, trainer LLM, rl.trainer_ranks.Followers or None, whether
    the run owns the engines). `model`: a directory or hub id, or a built LLM (used as both, not owned).
    `follower`: a data-parallel trainer rank > 0 (no sampler: rank 0 samples); rank 0 of several trainer ranks
    starts the others first (each building a `trainer_class`), so that they load while it does."""
    from detinfer.engine import LLM

    c, mode = config, arm_engine_mode(arm)
    if isinstance(model, LLM):
        if model.engine.config.mode != mode:
            raise ValueError(f"arm {arm!r} samples in {mode} mode; the given LLM runs in "
                             f"{model.engine.config.mode} mode")
        if c.tensor_parallel_size > 1 or c.layout == "split" or c.trainer_ranks > 1:
            raise ValueError("tensor_parallel_size > 1, layout 'split' and trainer_ranks > 1 build their own "
                             "sampler and trainer engines: give the model as a directory, not a built LLM")
        return model, model, None, False
    if follower:
        return None, build_trainer_engine(model, c, mode, device, max_model_len), None, True
    followers = None
    if c.trainer_ranks > 1:
        from detinfer.engine.llm_engine import resolve_device
        from detinfer.rl.trainer_ranks import Followers

        followers = Followers(trainer_class, model, c, arm, resolve_device(device), max_model_len)
    try:
        sampler, trainer = build_engines(model, c, mode, device, max_model_len,
                                         max(c.prompts_per_step * c.n_samples, eval_size))
    except BaseException:
        if followers is not None:  # they are loading, or waiting in their first collective: end them
            followers.broken = True
            followers.close()
        raise
    return sampler, trainer, followers, True


def build_engines(model, config: RLConfig, mode: str, device, max_model_len: int, seqs: int):
    """(sampler LLM, trainer LLM); the same object at tensor_parallel_size 1. `seqs`: the most sequences a
    step samples at once (the sampler's KV pool holds them all at max_model_len)."""
    from detinfer.engine import LLM
    from detinfer.engine.llm_engine import resolve_device

    c = config
    check_parallel_config(c, mode)
    invariant = c.tp_invariant_reduction and mode == "deterministic"
    # A KV pool that holds a whole step's sequences at max_model_len (prompts within a group share their blocks
    # besides), sized explicitly: the default would fill the GPU the trainer needs.
    blocks = seqs * -(-max_model_len // KV_BLOCK_SIZE) + 1
    sampling = dict(mode=mode, dtype=c.dtype, block_size=KV_BLOCK_SIZE, num_kv_blocks=blocks,
                    max_model_len=max_model_len, max_num_seqs=min(c.max_num_seqs, seqs),
                    max_num_batched_tokens=max(c.max_num_batched_tokens, min(c.max_num_seqs, seqs)),
                    enforce_eager=c.enforce_eager, tp_invariant_reduction=invariant,
                    # colocated: the sampler's KV pool is handed back during each update (grpo.py) and taken again
                    # at the same addresses after it, so the trainer has that memory and the graphs stay valid
                    releasable_kv_cache=c.layout == "colocated")
    if c.tensor_parallel_size == 1 and c.layout == "colocated" and c.trainer_ranks == 1:
        llm = LLM(str(model), device=device, **sampling)
        return llm, llm
    trainer_device = resolve_device(device)
    trainer = build_trainer_engine(model, c, mode, trainer_device, max_model_len)
    try:
        where = sampler_device(trainer_device, c)
        sampler = LLM(str(model), device=where, tensor_parallel_size=c.tensor_parallel_size, **sampling)
    except BaseException:
        trainer.close()
        raise
    return sampler, trainer


def build_trainer_engine(model, config: RLConfig, mode: str, device, max_model_len: int):
    """The engine whose model the trainer trains when the sampler is another engine. It never samples (scoring
    builds its own temporary KV cache), so it gets the smallest pool and no CUDA graphs."""
    from detinfer.engine import LLM

    return LLM(str(model), device=device, mode=mode, dtype=config.dtype, block_size=KV_BLOCK_SIZE,
               num_kv_blocks=-(-max_model_len // KV_BLOCK_SIZE) + 1, max_model_len=max_model_len,
               max_num_seqs=1, max_num_batched_tokens=max_model_len, enforce_eager=True,
               tp_invariant_reduction=config.tp_invariant_reduction and mode == "deterministic")


@torch.no_grad()
def push_to_sampler(sampler, trainer) -> None:
    """The trainer engine's weights (its own tensors: the bits its forward uses) into the sampler, in place;
    the sampler's prefix cache is dropped. Nothing to do when they are one engine."""
    if sampler is trainer:
        return
    from detinfer.engine.admin import push_weights

    push_weights(sampler.engine, {n: p.detach() for n, p in trainer.engine.runner.model.named_parameters()})
