"""The policy loss of one mini-batch, and the optimizer: pure functions of their inputs.

Per token t of a completion with advantage A (the group-relative advantage of its sequence):

    ratio_t = pi(t) / pi_old(t)                         pi_old: the logprobs the rollout was sampled with
    term_t  = min(ratio_t * A, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A)      (PPO, DAPO clip-higher)
              * w_t                                      fast-tis: w_t = min(pi_old_trainer / pi_sampler, C)
              - kl_coef * k3(pi, pi_ref)                 optional, k3 = exp(d) - d - 1, d = log pi_ref - log pi
    loss    = -sum_t norm_t * term_t

norm_t (`loss_norm`): token = 1 / (unmasked tokens in the mini-batch) (DAPO); sequence = 1 / (length of
t's sequence * sequences in the mini-batch) (GRPO); constant = 1 / (sequences * max_tokens) (Dr. GRPO).
Masked sequences (truncated ones under `mask_truncated`) get norm 0 and do not count.

With one update per rollout, ratio_t == 1 and the gradient is the plain policy gradient A * grad log pi.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def token_norms(lengths: Sequence[int], keep: Sequence[bool], loss_norm: str, max_tokens: int) -> list[float]:
    """Each token's share of a mini-batch's loss (see the module doc), flattened sequence-major."""
    kept = [n for n, k in zip(lengths, keep) if k and n]  # an empty completion has no token to weigh
    out: list[float] = []
    for n, k in zip(lengths, keep):
        if not k or not n:
            out += [0.0] * n
        elif loss_norm == "token":
            out += [1.0 / sum(kept)] * n
        elif loss_norm == "sequence":
            out += [1.0 / (n * len(kept))] * n
        elif loss_norm == "constant":
            out += [1.0 / (len(lengths) * max_tokens)] * n
        else:
            raise ValueError(f"loss_norm must be token, sequence or constant, got {loss_norm!r}")
    return out


def clipped_objective(lp: torch.Tensor, old_lp: torch.Tensor, adv: torch.Tensor, eps_low: float,
                      eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's per-token clipped surrogate (to maximise) and a bool mask of the tokens whose clip is active
    (their gradient is 0)."""
    ratio = torch.exp(lp - old_lp)
    clipped_ratio = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    objective = torch.minimum(ratio * adv, clipped_ratio * adv)
    r = ratio.detach()
    active = ((r > 1.0 + eps_high) & (adv > 0)) | ((r < 1.0 - eps_low) & (adv < 0))
    return objective, active


def k3_kl(lp: torch.Tensor, ref_lp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref) on tokens drawn from pi: exp(d) - d - 1, d = ref - pi."""
    d = ref_lp - lp
    return torch.exp(d) - d - 1


# -- optimizer ---------------------------------------------------------------------------------------

def decays(name: str, param: torch.Tensor) -> bool:
    """Weight decay applies to weight matrices only: not to norms' gains or biases (1-D) nor embeddings,
    whose rows for rare tokens decay towards 0 between their rare gradients."""
    return param.dim() >= 2 and "embed" not in name


def build_optimizer(named_params, config, single_tensor: bool = False):
    """AdamW over two groups: decayed weight matrices, and everything else without decay. Checkpoints
    store the groups' hyperparameters; their membership is a function of the parameter names. The
    implementation (fused on CUDA, single-tensor elsewhere) is train/optim.py's `adamw` choice, or the
    single-tensor loop everywhere with `single_tensor` (FSDP shards: see train/fsdp.py). With
    `config.offload_optimizer`: `OffloadedAdamW` over the same groups (moments on the host, torch's fused
    CPU step over host copies; a DTensor shard through its local tensor)."""
    from detinfer.train.optim import OffloadedAdamW, adamw

    named = list(named_params)
    decay = [p for n, p in named if decays(n, p)]
    no_decay = [p for n, p in named if not decays(n, p)]
    groups = [{"params": decay, "weight_decay": config.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if config.offload_optimizer:
        return OffloadedAdamW(groups, lr=config.lr)
    return adamw(groups, lr=config.lr, **({"fused": False, "foreach": False} if single_tensor else {}))


def lr_at(update: int, total_updates: int, config) -> float:
    """The learning rate of optimizer update `update` (0-based) of `total_updates`: linear warmup over
    warmup_steps updates, then constant / linear / cosine decay reaching 0 after the last update."""
    base, warm = config.lr, config.warmup_steps
    if update < warm:
        return base * (update + 1) / (warm + 1)
    if config.lr_schedule == "constant":
        return base
    span = max(1, total_updates - warm)
    progress = min(1.0, (update - warm) / span)
    if config.lr_schedule == "linear":
        return base * (1.0 - progress)
    return base * 0.5 * (1.0 + math.cos(math.pi * progress))
