"""Pure functions of one GRPO step: group-relative advantages, the sampler-vs-trainer mismatch on the
sampled tokens, and a cheap exact fingerprint of the weights."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence

import torch


def group_advantages(rewards: Sequence[float], group_size: int, scale: bool = True) -> list[float]:
    """GRPO advantages: each reward minus its group's mean (groups = consecutive `group_size` rewards),
    divided by the group's (population) std when `scale`. A group whose rewards are all equal gets 0
    (it carries no preference). Python floats in a fixed order: the same rewards give the same bits."""
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    out: list[float] = []
    for g in range(0, len(rewards), group_size):
        group = [float(r) for r in rewards[g:g + group_size]]
        mean = math.fsum(group) / group_size
        centred = [r - mean for r in group]
        std = math.sqrt(math.fsum(c * c for c in centred) / group_size)
        if std == 0.0:
            out += [0.0] * group_size
        else:
            out += [c / (std + 1e-6) if scale else c for c in centred]
    return out


def mismatch_stats(trainer_lp: torch.Tensor, sampler_lp: torch.Tensor) -> dict[str, float]:
    """Trainer vs sampler logprobs of the same sampled tokens (1-D, fp32).

    bits_differ: fraction of tokens whose logprob bits differ; max/mean_abs_diff: |trainer - sampler|;
    kl_k3: estimate of KL(sampler || trainer) from tokens drawn by the sampler, mean of
    (r - 1) - log r with r = pi_trainer / pi_sampler (Schulman's k3: unbiased, never negative)."""
    t = trainer_lp.detach().to(torch.float64).cpu()
    s = sampler_lp.detach().to(torch.float64).cpu()
    if t.shape != s.shape or t.dim() != 1:
        raise ValueError(f"logprobs must be two 1-D tensors of one shape, got {tuple(t.shape)}, {tuple(s.shape)}")
    if t.numel() == 0:
        return {"tokens": 0, "bits_differ": 0.0, "max_abs_diff": 0.0, "mean_abs_diff": 0.0, "kl_k3": 0.0}
    differ = trainer_lp.detach().cpu() != sampler_lp.detach().cpu().to(trainer_lp.dtype)
    log_r = t - s
    diff = log_r.abs()
    return {"tokens": int(t.numel()), "bits_differ": differ.double().mean().item(),
            "max_abs_diff": diff.max().item(), "mean_abs_diff": diff.mean().item(),
            "kl_k3": (torch.expm1(log_r) - log_r).mean().item()}


# Words per streamed piece of a tensor: bounds the int64 temporaries to a few of 2^22 x 8 B = 32 MiB,
# whatever the tensor's size. Integer sums do not depend on how they are split, so neither does the value.
FINGERPRINT_CHUNK_WORDS = 1 << 22
_MODULUS = 65521


@torch.no_grad()
def weights_fingerprint(named: Iterable[tuple[str, torch.Tensor]],
                        chunk_words: int = FINGERPRINT_CHUNK_WORDS) -> str:
    """12 hex digits identifying the weights' exact bits, computed on the weights' device.

    Per tensor: its bytes read as unsigned 16-bit words w_i (i = 0..n-1), summed twice, with weights
    (i mod 65521) + 1 and (n - 1 - i mod 65521) + 1. Integer sums are exact and order-independent, so the
    value is the same on every run and device, and any single changed bit changes it (a word changes by
    +-2^b, a sum by +-2^b times a weight >= 1). The sums, names, shapes and dtypes are then hashed with
    SHA-256. Streamed `chunk_words` words at a time (the sums of the pieces added exactly in Python
    integers), so the only temporaries are a few int64 pieces: cheap enough to print every step (no copy
    of the weights to the host)."""
    h = hashlib.sha256()
    for name, p in named:
        words = p.detach().contiguous().reshape(-1).view(torch.int16)
        n = words.numel()
        pieces = []
        for start in range(0, n, chunk_words):
            piece = words[start:start + chunk_words].to(torch.int64) & 0xFFFF
            index = torch.arange(start, start + piece.numel(), device=piece.device, dtype=torch.int64)
            # weights in [1, 65521] and words < 2^16: each product < 2^32, a piece's sum < 2^54
            pieces.append(torch.stack([(piece * (index % _MODULUS + 1)).sum(),
                                       (piece * ((n - 1 - index) % _MODULUS + 1)).sum()]))
        sums = [sum(col) for col in zip(*torch.stack(pieces).tolist())] if pieces else [0, 0]
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{sums[0]}:{sums[1]};".encode())
    return h.hexdigest()[:12]
