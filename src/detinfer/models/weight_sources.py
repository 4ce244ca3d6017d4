"""Where a model's weights come from, as small picklable values: under tensor parallelism rank 0 sends each
worker one of these (not tensors), and every rank builds only its own shard from it
(`state(config, rank, size, device)`), so no process ever holds the full weights.

- `CheckpointWeights`: a HF safetensors directory; each rank reads only its slices (models/loader.py
  `load_state`).
- `RandomWeights`: a random-model preset's seeded weights; each rank draws only its slices
  (models/random_weights.py), the same bits TP=1 draws for them. `random_model` builds a whole one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from detinfer.models.config import ModelConfig
from detinfer.models.transformer import Transformer
from detinfer.ops import Ops


@dataclass(frozen=True)
class CheckpointWeights:
    model_dir: str
    dtype: torch.dtype

    def state(self, config: ModelConfig, rank: int, size: int, device: torch.device) -> dict[str, torch.Tensor]:
        from detinfer.models.loader import load_state

        return load_state(self.model_dir, config, self.dtype, device, rank, size)


@dataclass(frozen=True)
class RandomWeights:
    seed: int
    dtype: torch.dtype

    def state(self, config: ModelConfig, rank: int, size: int, device: torch.device) -> dict[str, torch.Tensor]:
        from detinfer.models.random_weights import random_state

        return random_state(config, seed=self.seed, dtype=self.dtype, device=device, rank=rank, size=size)


def build_full_model(weights, config: ModelConfig, ops: Ops) -> Transformer:
    """The whole (TP=1) model from `weights`, on `ops.device`."""
    from detinfer.models.loader import model_from_state

    return model_from_state(config, ops, weights.state(config, 0, 1, torch.device(ops.device)))


@torch.no_grad()
def random_model(config: ModelConfig, *, seed: int = 0, mode: str = "deterministic",
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16) -> Transformer:
    """The one builder of a random-weight model: `config`'s Transformer with `RandomWeights(seed, dtype)`
    drawn on `device`, ops in `mode`. (`LLMEngine.from_weights(RandomWeights(...), ...)` is the same under
    an engine, also sharded.)"""
    device = torch.device(device)
    return build_full_model(RandomWeights(seed, dtype), config, Ops(mode, device, dtype, head_dim=config.head_dim))
