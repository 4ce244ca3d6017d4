"""Models with random weights built in-process from a named shape, for experiments at a real model's size
without its checkpoint (`detinfer repro --random-model qwen3-8b`, `detinfer audit --random-model ...`). The
shapes are the model families' presets (detinfer.models.families).

The weights are drawn on the target device by a counter-based generator (models/random_weights.py: each
element a hash of the seed, the parameter's name and its position), so an 8B model appears in seconds on a
GPU, building it twice with the same seed (once per mode in `--mode both`) gives the same bits, CPU and GPU
draw the same bits, and under tensor parallelism each rank draws only its own slices (`RandomWeights`), the
same bits TP=1 has there. Linear weights have std 1/sqrt(in_features) (a light-tailed triangular
distribution) to keep activations O(1) through the layers, so the logits are peaked enough for greedy
decoding to be meaningful, and near-ties still happen, as with real models. (Before this generator the
weights came from torch's normal generator: the same seed now gives other weights than it did then.)

There is no tokenizer: prompts are the UTF-8 bytes of the text as token ids (every shape has >= 256
tokens) and outputs are shown as their ids, e.g. "⟨1234⟩⟨77⟩".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from detinfer.models.config import ModelConfig
from detinfer.models.families import preset_hf_config, preset_names
from detinfer.models.transformer import Transformer
from detinfer.models.weight_sources import RandomWeights, random_model

# name -> HF config.json dict of every registered family's presets (each family module defines its own).
PRESETS: dict[str, dict] = {name: preset_hf_config(name) for name in preset_names()}


def preset_config(name: str) -> ModelConfig:
    """The preset's ModelConfig; unknown names raise a ValueError listing the known ones."""
    return ModelConfig.from_dict(preset_hf_config(name))


def build_random_model(name: str, *, mode: str = "deterministic", device: torch.device | str = "cpu",
                       dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> tuple[Transformer, ModelConfig]:
    """The preset's Transformer with seeded random weights, `dtype` on `device`, ops in `mode`."""
    config = preset_config(name)
    return random_model(config, seed=seed, mode=mode, device=device, dtype=dtype), config


def random_engine(name: str, config, device, seed: int):
    """An `LLMEngine` (`config`: an EngineConfig) over the preset's seeded random weights; dtype "auto" is
    resolved as for a checkpoint (the preset's dtype on a GPU, fp32 on a CPU). Under tensor parallelism
    every rank draws only its own slices."""
    from detinfer.dtypes import resolve_dtype
    from detinfer.engine.llm_engine import LLMEngine, resolve_device

    model_config, dev = preset_config(name), resolve_device(device)
    dtype = resolve_dtype(config.dtype, model_config.dtype, dev)
    return LLMEngine.from_weights(RandomWeights(seed, dtype), model_config, config, dev)


def encode_bytes(text: str) -> list[int]:
    """Prompt ids for a tokenizer-less model: the text's UTF-8 bytes."""
    ids = list(text.encode("utf-8"))
    if not ids:
        raise ValueError("the prompt is empty")
    return ids


def decode_ids(ids: Sequence[int]) -> str:
    return "".join(f"⟨{int(i)}⟩" for i in ids)
