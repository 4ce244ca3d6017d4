"""Models with random weights built in-process from a named shape, for experiments at a real model's size
without its checkpoint (`detinfer repro --random-model qwen3-8b`, `detinfer audit --random-model ...`). The
shapes are the model families' presets (detinfer.models.families).

The weights are drawn on the target device from a seeded generator in the target dtype, so an 8B model
appears in seconds on a GPU, and building it twice with the same seed (once per mode in `--mode both`)
gives the same bits. Linear weights ~ N(0, 1/in_features) keep activations O(1) through the layers, so the
logits are peaked enough for greedy decoding to be meaningful, and near-ties still happen, as with real
models.

There is no tokenizer: prompts are the UTF-8 bytes of the text as token ids (every shape has >= 256
tokens) and outputs are shown as their ids, e.g. "⟨1234⟩⟨77⟩".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from detinfer.models.config import ModelConfig
from detinfer.models.families import preset_hf_config, preset_names
from detinfer.models.transformer import Transformer
from detinfer.ops import Ops

# name -> HF config.json dict of every registered family's presets (each family module defines its own).
PRESETS: dict[str, dict] = {name: preset_hf_config(name) for name in preset_names()}


def preset_config(name: str) -> ModelConfig:
    """The preset's ModelConfig; unknown names raise a ValueError listing the known ones."""
    return ModelConfig.from_dict(preset_hf_config(name))


@torch.no_grad()
def build_random_model(name: str, *, mode: str = "deterministic", device: torch.device | str = "cpu",
                       dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> tuple[Transformer, ModelConfig]:
    """The preset's Transformer with seeded random weights, `dtype` on `device`, ops in `mode`."""
    config = preset_config(name)
    device = torch.device(device)
    with torch.device("meta"):
        model = Transformer(config, Ops(mode, device, dtype, head_dim=config.head_dim))
    gen = torch.Generator(device=device).manual_seed(seed)
    for pname, p in sorted(model.named_parameters()):
        shape = tuple(p.shape)
        t = torch.empty(shape, device=device, dtype=torch.float32)
        if pname.endswith("norm.weight"):
            t.normal_(1.0, 0.1, generator=gen)
        elif pname.endswith(".bias"):
            t.normal_(0.0, 0.1, generator=gen)
        else:  # [out, in]: in = the reduced dim (embeddings: hidden)
            t.normal_(0.0, 1.0 / math.sqrt(shape[-1]), generator=gen)
        _set_param(model, pname, t.to(dtype))
        del t
    model.rotary.reset_parameters(device)
    model.eval()
    return model, config


def _set_param(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    *path, leaf = name.split(".")
    owner = model
    for part in path:
        owner = getattr(owner, part)
    setattr(owner, leaf, torch.nn.Parameter(value, requires_grad=False))


def encode_bytes(text: str) -> list[int]:
    """Prompt ids for a tokenizer-less model: the text's UTF-8 bytes."""
    ids = list(text.encode("utf-8"))
    if not ids:
        raise ValueError("the prompt is empty")
    return ids


def decode_ids(ids: Sequence[int]) -> str:
    return "".join(f"⟨{int(i)}⟩" for i in ids)
