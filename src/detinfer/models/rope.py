"""Rotary position embeddings (RoPE), HF "rotate_half" layout: the config's frequencies (the rotation is
`detinfer.ops.backend.Ops.rope`, which is `kernels.rope.apply_rope`).

cos/sin are computed per token from its position, elementwise, in fp32: no precomputed table whose contents
could depend on a maximum length, and nothing a token computes depends on the other tokens in the batch.
The inverse frequencies are a fixed function of the config ([head_dim / 2] floats).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from detinfer.kernels.rope import apply_rope
from detinfer.models.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] fp32: theta^(-2i / head_dim), then the config's scaling (linear or llama3)."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: wavelengths shorter than the high-frequency cutoff are kept, longer than the low-frequency
    # cutoff are divided by `factor`, and the band between is a linear blend of the two in 1 / wavelength.
    old_len = scaling.original_max_position_embeddings
    low_cut = old_len / scaling.low_freq_factor  # wavelengths above this are scaled fully
    high_cut = old_len / scaling.high_freq_factor  # wavelengths below this are left alone
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_cut, inv_freq / scaling.factor, inv_freq)
    band = scaling.high_freq_factor - scaling.low_freq_factor
    blend = (old_len / wavelen - scaling.low_freq_factor) / band
    blended = (1 - blend) * scaled / scaling.factor + blend * scaled
    in_band = ~(wavelen < high_cut) & ~(wavelen > low_cut)
    return torch.where(in_band, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Holds the inverse frequencies; the rotation is the numerics backend's (`Ops.rope`, which the model
    calls; `forward` is the same function for callers outside a model)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", inverse_frequencies(config), persistent=False)  # [D/2] fp32

    def reset_parameters(self, device: torch.device | str | None = None) -> None:
        """Recompute inv_freq (e.g. after the model was built on the meta device)."""
        self.inv_freq = inverse_frequencies(self.config).to(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions [T] int; q [T, Hq, D], k [T, Hkv, D] -> rotated (q, k), same dtypes."""
        return apply_rope(positions, q, k, self.inv_freq)
