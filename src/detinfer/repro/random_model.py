"""Models with random weights built in-process from a named shape, for experiments at a real model's size
without its checkpoint (`detinfer repro --random-model qwen3-8b`, `detinfer audit --random-model ...`).

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
from detinfer.models.transformer import Transformer
from detinfer.ops import Ops

# HF config.json fields of public models (architecture shapes only; no weights involved).
PRESETS: dict[str, dict] = {
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     max_position_embeddings=40960, tie_word_embeddings=False, eos_token_id=151645),
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       max_position_embeddings=40960, tie_word_embeddings=True, eos_token_id=151645),
    "llama-3.1-8b": dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
                         max_position_embeddings=131072, tie_word_embeddings=False, eos_token_id=128009),
    # Small enough for a CPU (tests, trying the tool out).
    "tiny": dict(architectures=["Qwen3ForCausalLM"], vocab_size=512, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048,
                 tie_word_embeddings=False, eos_token_id=2),
}


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown random model {name!r}; known: {', '.join(PRESETS)}")
    return ModelConfig.from_dict(PRESETS[name])


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
