"""Numerics: `Ops`, the one backend every forward pass and the sampler compute with (see `ops/backend.py`),
and the torch.library drop-in mode built on it (`ops/mode.py`)."""

from detinfer.ops.backend import ATTENTION_BACKENDS, MODES, Ops

__all__ = ["ATTENTION_BACKENDS", "MODES", "Ops"]
