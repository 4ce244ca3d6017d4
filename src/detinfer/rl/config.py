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

from detinfer.constants import ENGINE_DTYPES, MODES
from detinfer.engine.config import MAX_SEED, MAX_TENSOR_PARALLEL, check_choice, check_float, check_int

ARMS = (*MODES, "fast-tis")
LOSS_NORMS = ("token", "sequence", "constant")
LR_SCHEDULES = ("constant", "linear", "cosine")
LAYOUTS = ("colocated", "split")
MAX_TEMPERATURE = 100.0
# CLI --mode: one arm, or "both" = both engine modes, i.e. all three arms.
MODE_ARMS = {"deterministic": ("deterministic",), "fast": ("fast",), "fast-tis": ("fast-tis",),
             "both": ARMS}


def arm_engine_mode(arm: str) -> str:
    """The kernels an arm samples and trains with."""
    check_choice("arm", arm, ARMS)
    return "deterministic" if arm == "deterministic" else "fast"


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def _check_optional_str(name: str, value: Any, optional: bool = True) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string{' or None' if optional else ''}, got {value!r}")


def _help(text: str, **extra: Any) -> dict:
    return {"help": text, **extra}


@dataclass(frozen=True)
class RLConfig:
    """A GRPO run: prompts (a built-in generator or a dataset), rewards, rollout sampling, the loss and
    the optimizer. Every field shapes the trajectory except `steps`, `checkpoint_every` and `layout`, so a
    checkpoint refuses to resume under any other change (see `RESUMABLE_CHANGES`)."""

    task: str = field(default="addition", metadata=_help(
        "Built-in task: addition, addition-partial, reverse, sort, math (generated word problems), "
        "emit-token (tiny test models); from Python, any name with your own Task."))
    steps: int = field(default=100, metadata=_help(
        "Steps: one rollout batch each, then updates_per_step optimizer updates on it."))
    prompts_per_step: int = field(default=16, metadata=_help("Prompts per step (GRPO groups)."))
    n_samples: int = field(default=8, metadata=_help(
        "Completions sampled per prompt (group size); advantages are relative to the group."))
    max_tokens: int = field(default=32, metadata=_help("Most tokens per completion."))
    lr: float = field(default=1e-5, metadata=_help("AdamW peak learning rate (see lr_schedule)."))
    weight_decay: float = field(default=0.0, metadata=_help(
        "AdamW weight decay, on weight matrices only (never on norms, biases or embeddings)."))
    max_grad_norm: float | None = field(default=1.0, metadata=_help(
        "Clip the gradient's global norm to this (none: no clipping)."))
    offload_optimizer: bool = field(default=False, metadata=_help(
        "Keep AdamW's two moments in host memory and step on the CPU (train/optim.py's OffloadedAdamW): the "
        "trainer's GPU bytes per parameter go from 18 to 10 (16-bit engine with fp32 masters), for a CPU AdamW "
        "step and PCIe copies (gradients and masters down, masters up) per update. The CPU step is torch's "
        "fused CPU AdamW (one pass per tensor): deterministic, the same bits at any --trainer-ranks, but it "
        "rounds differently from the on-device AdamW, so offloaded runs reproduce each other and are another "
        "trajectory than non-offloaded ones (a resume keeps the setting)."))
    keep_logits: bool = field(default=False, metadata=_help(
        "Keep the scored tokens' [tokens, vocab] logits from the trainer's forward to its backward instead of "
        "recomputing them in 512-row chunks (TrainableModel(logprob_chunk_rows=None)): a faster training step "
        "(Qwen3-8B shapes on an H100: 0.64x the time) for 8 bytes x vocab per scored token of GPU memory per "
        "micro-batch. Deterministic mode gives the same bits either way."))
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
    # -- data ----------------------------------------------------------------------------------------
    dataset: str | None = field(default=None, metadata=_help(
        "Prompts from a file (*.jsonl, *.parquet: needs pyarrow) or a Hugging Face dataset name (needs the "
        "datasets package) instead of the task's generator (none: the built-in task)."))
    dataset_config: str | None = field(default=None, metadata=_help("Hugging Face dataset: subset name."))
    dataset_split: str = field(default="train", metadata=_help("Hugging Face dataset: training split."))
    prompt_column: str = field(default="prompt", metadata=_help(
        "Dataset column holding the prompt: a string, or a list of chat messages {role, content}."))
    answer_column: str = field(default="answer", metadata=_help(
        "Dataset column holding the reference answer (passed to reward functions)."))
    system_prompt: str | None = field(default=None, metadata=_help(
        "System message put before each text prompt (through the model's chat template; needs one)."))
    shuffle: bool = field(default=True, metadata=_help(
        "Dataset prompts in a fresh seeded order every epoch (--no-shuffle: file order)."))
    eval_dataset: str | None = field(default=None, metadata=_help(
        "Held-out prompts (file or Hugging Face dataset name, same columns); none: hold out eval_size "
        "examples of the training data (or draw them from the task's generator)."))
    eval_split: str = field(default="test", metadata=_help("Hugging Face eval dataset: split."))
    eval_size: int = field(default=0, metadata=_help(
        "Eval examples: held out from the training data / generated (or, with eval_dataset, the first "
        "this many; 0: all of eval_dataset)."))
    eval_every: int = field(default=0, metadata=_help(
        "Score the eval set greedily every this many steps (0: never)."))
    # -- rewards -------------------------------------------------------------------------------------
    reward_funcs: str | None = field(default=None, metadata=_help(
        "Comma-separated reward functions: built-ins (task, math, exact, format) or module:function "
        "(called with prompts, completions, answers, completion_ids and the dataset's columns; returns one "
        "float per completion). none: the task's own reward."))
    reward_weights: str | None = field(default=None, metadata=_help(
        "Comma-separated weights, one per reward function (none: all 1)."))
    # -- rollout sampling ----------------------------------------------------------------------------
    temperature: float = field(default=1.0, metadata=_help(
        "Rollout temperature; the loss scores softmax(logits / temperature)."))
    top_p: float = field(default=1.0, metadata=_help("Rollout nucleus sampling (1: off)."))
    top_k: int = field(default=0, metadata=_help("Rollout top-k sampling (0: off)."))
    # -- loss ----------------------------------------------------------------------------------------
    ppo_epochs: int = field(default=1, metadata=_help(
        "Passes over each rollout (PPO-style reuse; each mini-batch of each pass is one optimizer update)."))
    mini_batch_seqs: int | None = field(default=None, metadata=_help(
        "Sequences per optimizer update (none: the whole rollout, one update per epoch)."))
    clip_eps: float = field(default=0.2, metadata=_help(
        "PPO clip: the ratio pi / pi_old is clipped to [1 - clip_eps, 1 + clip_eps_high]."))
    clip_eps_high: float | None = field(default=None, metadata=_help(
        "Upper clip (DAPO's clip-higher, e.g. 0.28; none: = clip_eps)."))
    loss_norm: str = field(default="token", metadata=_help(
        "token: sum over tokens / tokens in the mini-batch (DAPO); sequence: mean per sequence, then over "
        "sequences (GRPO); constant: sum / (sequences * max_tokens) (Dr. GRPO).", choices=LOSS_NORMS))
    mask_truncated: bool = field(default=False, metadata=_help(
        "No loss on completions cut at max_tokens (DAPO's overlong filtering)."))
    overlong_buffer: int = field(default=0, metadata=_help(
        "DAPO soft overlong punishment: completions longer than max_tokens - this lose up to "
        "overlong_penalty, linearly (0: off)."))
    overlong_penalty: float = field(default=1.0, metadata=_help("Largest overlong punishment."))
    # -- optimizer -----------------------------------------------------------------------------------
    lr_schedule: str = field(default="constant", metadata=_help(
        "Learning rate after warmup: constant, or linear / cosine decay to 0 at the last update.",
        choices=LR_SCHEDULES))
    warmup_steps: int = field(default=0, metadata=_help(
        "Optimizer updates of linear warmup from 0 to lr."))
    dtype: str = field(default="auto", metadata=_help(
        "Engine weight dtype (auto: the checkpoint's on GPU, float32 on CPU). 16-bit engines train fp32 "
        "master weights.", choices=ENGINE_DTYPES))
    max_num_seqs: int = field(default=256, metadata=_help("Engine: most sequences sampled at once."))
    max_num_batched_tokens: int = field(default=8192, metadata=_help("Engine: token budget of one step."))
    enforce_eager: bool = field(default=False, metadata=_help("Engine: no CUDA graphs."))
    # -- several GPUs (docs/rl.md "Several GPUs") -----------------------------------------------------
    tensor_parallel_size: int = field(default=1, metadata=_help(
        "Sampler: tensor-parallel ranks (GPUs). Above 1 the trainer trains a one-process copy of the weights "
        "and pushes them into the sampler after every update (each rank's shards in buckets over the TP group); "
        "deterministic mode then needs tp_invariant_reduction."))
    tp_invariant_reduction: bool = field(default=False, metadata=_help(
        "Sampler and trainer sum row-parallel layers (o_proj, down_proj) in one fixed K-chunk tree, so a "
        "tensor-parallel sampler's logprobs have the one-process trainer's bits (deterministic mode; required "
        "there with tensor_parallel_size > 1)."))
    layout: str = field(default="colocated", metadata=_help(
        "Where the sampler's ranks run: colocated (from the trainer's GPU on: cuda:0..N-1, sharing it) or split "
        "(on the GPUs after the trainer's: cuda:1..N). The same thing on a CPU.", choices=LAYOUTS))
    trainer_ranks: int = field(default=1, metadata=_help(
        "Trainer processes: data parallel, each trainer an FSDP2 shard (fixed-order gradient sum); rank r on the "
        "r-th GPU from the trainer's. Must divide prompts_per_step * n_samples and mini_batch_seqs."))

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
        _check_bool("offload_optimizer", self.offload_optimizer)
        _check_bool("keep_logits", self.keep_logits)
        _check_bool("scale_rewards", self.scale_rewards)
        check_float("tis_cap", self.tis_cap, minimum=0.0, min_exclusive=True)
        check_float("kl_coef", self.kl_coef, minimum=0.0)
        check_int("train_batch_seqs", self.train_batch_seqs, minimum=1)
        check_int("seed", self.seed, minimum=0, maximum=MAX_SEED)
        check_int("checkpoint_every", self.checkpoint_every, minimum=0)
        self._check_data()
        self._check_rollout_and_loss()
        check_choice("dtype", self.dtype, ENGINE_DTYPES)
        check_int("max_num_seqs", self.max_num_seqs, minimum=1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, minimum=1)
        _check_bool("enforce_eager", self.enforce_eager)
        self._check_parallelism()

    def _check_parallelism(self) -> None:
        check_int("tensor_parallel_size", self.tensor_parallel_size, minimum=1, maximum=MAX_TENSOR_PARALLEL)
        _check_bool("tp_invariant_reduction", self.tp_invariant_reduction)
        check_choice("layout", self.layout, LAYOUTS)
        check_int("trainer_ranks", self.trainer_ranks, minimum=1)
        ranks = self.trainer_ranks
        if ranks > 1:  # every rank scores an equal block of each mini-batch (rl/trainer_ranks.py)
            seqs = self.prompts_per_step * self.n_samples
            for what, value in (("prompts_per_step * n_samples", seqs), ("mini_batch_seqs", self.mini_batch_seqs)):
                if value is not None and value % ranks:
                    raise ValueError(f"trainer_ranks={ranks} (--trainer-ranks) splits each mini-batch into equal "
                                     f"blocks, but {what} = {value} is not a multiple of it")
            if self.kl_coef > 0:
                raise ValueError(f"kl_coef > 0 (--kl-coef) is not supported with trainer_ranks={ranks} "
                                 "(--trainer-ranks) yet; allowed: kl_coef 0, or trainer_ranks 1")

    def _check_data(self) -> None:
        for name in ("dataset", "dataset_config", "system_prompt", "eval_dataset"):
            _check_optional_str(name, getattr(self, name))
        for name in ("dataset_split", "prompt_column", "answer_column", "eval_split"):
            _check_optional_str(name, getattr(self, name), optional=False)
        _check_bool("shuffle", self.shuffle)
        check_int("eval_size", self.eval_size, minimum=0)
        check_int("eval_every", self.eval_every, minimum=0)
        if self.eval_every and not (self.eval_size or self.eval_dataset):
            raise ValueError("eval_every > 0 needs an eval set: eval_size > 0 or an eval_dataset")
        from detinfer.rl.rewards import parse_reward_config

        parse_reward_config(self.reward_funcs, self.reward_weights)  # raises naming the bad entry

    def _check_rollout_and_loss(self) -> None:
        check_float("temperature", self.temperature, minimum=0.0, maximum=MAX_TEMPERATURE, min_exclusive=True)
        check_float("top_p", self.top_p, minimum=0.0, maximum=1.0, min_exclusive=True)
        check_int("top_k", self.top_k, minimum=0)
        check_int("ppo_epochs", self.ppo_epochs, minimum=1)
        check_int("mini_batch_seqs", self.mini_batch_seqs, minimum=1, optional=True)
        check_float("clip_eps", self.clip_eps, minimum=0.0, maximum=1.0, min_exclusive=True)
        if self.clip_eps_high is not None:
            check_float("clip_eps_high", self.clip_eps_high, minimum=0.0, min_exclusive=True)
        check_choice("loss_norm", self.loss_norm, LOSS_NORMS)
        _check_bool("mask_truncated", self.mask_truncated)
        check_int("overlong_buffer", self.overlong_buffer, minimum=0, maximum=self.max_tokens - 1)
        check_float("overlong_penalty", self.overlong_penalty, minimum=0.0)
        check_choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        check_int("warmup_steps", self.warmup_steps, minimum=0)

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates per rollout: ppo_epochs passes of ceil(sequences / mini_batch_seqs)."""
        seqs = self.prompts_per_step * self.n_samples
        per_epoch = 1 if self.mini_batch_seqs is None else -(-seqs // self.mini_batch_seqs)
        return self.ppo_epochs * per_epoch

    def replace(self, **changes: Any) -> RLConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Fields a resumed run may change: how long it runs, how often it saves, and on which GPUs the sampler runs
# (the layout moves no bit). Everything else shapes the trajectory, so a checkpoint refuses to continue under
# different values.
RESUMABLE_CHANGES = ("steps", "checkpoint_every", "layout")


def resumable_changes(config: RLConfig) -> tuple[str, ...]:
    """RESUMABLE_CHANGES, less `steps` under a decaying learning rate (its horizon is the last update)."""
    if config.lr_schedule == "constant":
        return RESUMABLE_CHANGES
    return tuple(k for k in RESUMABLE_CHANGES if k != "steps")
