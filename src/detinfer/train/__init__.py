"""Training on the engine's own model: logprobs bit-identical to the sampler's, deterministic backward."""

from detinfer.train.model import MODES, TrainableModel, pack_padded

__all__ = ["MODES", "TrainableModel", "pack_padded"]
