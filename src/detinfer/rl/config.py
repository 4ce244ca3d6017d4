"""`RLConfig`: one frozen, validated dataclass holding every knob of a GRPO run; the `detinfer rl` flags
are generated from it (like the engine's `EngineConfig`). No torch here.

Arms (`ARMS`): the three runs the comparison needs.
  deterministic  sampler and trainer on detinfer's batch-invariant kernels; plain on-policy gradient
                 (the sampler's and the trainer's logprobs are the same bits, so no correction exists)
  fast           stock kernels on both sides; plain gradient, ignoring the sampler/trainer mismatch
  fast-tis       stock kernels; truncated importance weighting min(pi_trainer / pi_sampler, C) per token
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from detinfer.engine.config import DTYPES, MAX_SEED, check_choice, check_float, check_int

ARMS = ("deterministic", "fast", "fast-tis")
# CLI --mode: one arm, or "both" = both engine modes, i.e. all three arms.
MODE_ARMS = {"deterministic": ("deterministic",), "fast": ("fast",), "fast-tis": ("fast-tis",),
             "both": ARMS}


def arm_engine_mode(arm: str) -> str:
    """The kernels an arm samples and trains with."""
    check_choice("arm", arm, ARMS)
    return "deterministic" if arm == "deterministic" else "fast"


def _help(text: str, **extra: Any) -> dict:
    return {"help": text, **extra}


@dataclass(frozen=True)
class RLConfig:
    """A GRPO run. Sampling is at temperature 1 with no top-k/top-p, so the sampler's distribution is
    the model's and the trainer can score it."""

    task: str = field(default="addition", metadata=_help(
        "Built-in task: addition, addition-partial, reverse, sort, emit-token (tiny test models); from "
        "Python, any name with your own Task."))
    steps: int = field(default=100, metadata=_help("Optimizer steps (one rollout batch each)."))
    prompts_per_step: int = field(default=16, metadata=_help("Prompts per step (GRPO groups)."))
    n_samples: int = field(default=8, metadata=_help(
        "Completions sampled per prompt (group size); advantages are relative to the group."))
    max_tokens: int = field(default=32, metadata=_help("Most tokens per completion."))
    lr: float = field(default=1e-5, metadata=_help("AdamW learning rate (constant)."))
    weight_decay: float = field(default=0.0, metadata=_help("AdamW weight decay."))
    max_grad_norm: float | None = field(default=1.0, metadata=_help(
        "Clip the gradient's global norm to this (none: no clipping)."))
    scale_rewards: bool = field(default=True, metadata=_help(
        "Divide group-relative advantages by the group's reward std (GRPO); --no-scale-rewards keeps "
        "reward - group mean."))
    tis_cap: float = field(default=2.0, metadata=_help(
        "The fast-tis arm's truncation C: each token's weight is min(pi_trainer / pi_sampler, C)."))
    kl_coef: float = field(default=0.0, metadata=_help(
        "Weight of a KL-to-reference penalty (k3 estimator, reference = the initial weights); 0: off, "
        "and no reference copy is kept."))
    train_batch_seqs: int = field(default=64, metadata=_help(
        "Sequences per training forward/backward (gradients of a step accumulate over these micro-batches "
        "in a fixed order)."))
    seed: int = field(default=0, metadata=_help(
        "Run seed: prompts and every sampling seed are pure functions of (seed, step, prompt, sample)."))
    checkpoint_every: int = field(default=0, metadata=_help(
        "Save a checkpoint every this many steps (0: only at the end)."))
    dtype: str = field(default="auto", metadata=_help(
        "Engine weight dtype (auto: the checkpoint's on GPU, float32 on CPU). 16-bit engines train fp32 "
        "master weights.", choices=DTYPES))
    max_num_seqs: int = field(default=256, metadata=_help("Engine: most sequences sampled at once."))
    max_num_batched_tokens: int = field(default=8192, metadata=_help("Engine: token budget of one step."))
    enforce_eager: bool = field(default=False, metadata=_help("Engine: no CUDA graphs."))

    def __post_init__(self):
        if not isinstance(self.task, str) or not self.task:
            raise ValueError(f"task must be a non-empty task name, got {self.task!r}")
        check_int("steps", self.steps, minimum=0)
        check_int("prompts_per_step", self.prompts_per_step, minimum=1)
        check_int("n_samples", self.n_samples, minimum=2)  # one sample has no group to be relative to
        check_int("max_tokens", self.max_tokens, minimum=1)
        check_float("lr", self.lr, minimum=0.0)
        check_float("weight_decay", self.weight_decay, minimum=0.0)
        if self.max_grad_norm is not None:
            check_float("max_grad_norm", self.max_grad_norm, minimum=0.0, min_exclusive=True)
        if not isinstance(self.scale_rewards, bool):
            raise TypeError(f"scale_rewards must be a bool, got {self.scale_rewards!r}")
        check_float("tis_cap", self.tis_cap, minimum=0.0, min_exclusive=True)
        check_float("kl_coef", self.kl_coef, minimum=0.0)
        check_int("train_batch_seqs", self.train_batch_seqs, minimum=1)
        check_int("seed", self.seed, minimum=0, maximum=MAX_SEED)
        check_int("checkpoint_every", self.checkpoint_every, minimum=0)
        check_choice("dtype", self.dtype, DTYPES)
        check_int("max_num_seqs", self.max_num_seqs, minimum=1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, minimum=1)
        if not isinstance(self.enforce_eager, bool):
            raise TypeError(f"enforce_eager must be a bool, got {self.enforce_eager!r}")

    def replace(self, **changes: Any) -> RLConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Fields a resumed run may change: how long it runs and how often it saves. Everything else shapes the
# trajectory, so a checkpoint refuses to continue under different values.
RESUMABLE_CHANGES = ("steps", "checkpoint_every")
