"""Tiny random checkpoints in exactly the HF on-disk format, for tests that need a model directory.

`write_tiny_checkpoint(dir, architecture, ...)` (any registered family's HF architecture string) writes
config.json, generation_config.json, model.safetensors (or shards + index), and a small but real tokenizer:
a byte-level BPE trained in-process on a few sentences (tokenizer.json) with a ChatML chat template
(tokenizer_config.json). HF transformers loads these directories as-is, which is what the parity tests use.

Weights are seeded random: linear weights ~ N(0, 1/in_features) so activations stay O(1) through the
layers (a 0.02 init would make logits nearly uniform and the parity checks weak), norm weights near 1.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from detinfer.models.config import ModelConfig
from detinfer.models.families import family_for_architecture

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
CHATML_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}\n"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a tiny test model.<|im_end|>\\n' }}{% endif %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)
_CORPUS = [
    "Once upon a time there was a little model that computed the same answer every time.",
    "The quick brown fox jumps over the lazy dog, 12345 times!",
    "Batch invariance means one row's result never depends on the other rows in the batch.",
    "Hello world. Tell me about Richard Feynman and his diagrams.",
    "Déterminisme: naïve café, 東京, emoji 🙂 and tabs\tand\nnewlines.",
    "def add(a, b):\n    return a + b  # code is text too",
]


def build_tiny_tokenizer(vocab_size: int = 320, add_bos: bool = False) -> Tokenizer:
    """Byte-level BPE (GPT-2 style) trained on a fixed corpus; special tokens are ids 0..2. With add_bos,
    the post-processor prepends <|endoftext|> (used as BOS), as Llama-style tokenizers do."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    if add_bos:
        bos = SPECIAL_TOKENS[0]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, 0)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def tiny_config_dict(architecture: str = "LlamaForCausalLM", *, vocab_size: int = 320, hidden_size: int = 64,
                     intermediate_size: int = 96, num_hidden_layers: int = 2, num_attention_heads: int = 4,
                     num_key_value_heads: int = 2, head_dim: int | None = None,
                     tie_word_embeddings: bool = False,
                     attention_bias: bool = False, mlp_bias: bool = False, rope_theta: float = 10000.0,
                     rope_scaling: dict[str, Any] | None = None, rope_style: str = "legacy",
                     max_position_embeddings: int = 256, rms_norm_eps: float = 1e-6,
                     dtype: str = "float32", extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A HF config.json dict. rope_style "legacy" writes rope_theta/rope_scaling (transformers 4),
    "parameters" writes one rope_parameters dict (transformers 5). The family's module adds its own fields
    (attention_bias / mlp_bias where its config.json has such switches; MoE sizes, which `extra`, family
    fields such as {"num_experts": 4}, overrides)."""
    family = family_for_architecture(architecture)
    if rope_style not in ("legacy", "parameters"):
        raise ValueError(f"rope_style must be 'legacy' or 'parameters', got {rope_style!r}")
    cfg: dict[str, Any] = {
        "architectures": [architecture], "model_type": family.model_type, "vocab_size": vocab_size,
        "hidden_size": hidden_size, "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers, "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads, "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings, "rms_norm_eps": rms_norm_eps,
        "tie_word_embeddings": tie_word_embeddings, "bos_token_id": 0, "eos_token_id": 2,
        "torch_dtype": dtype, "use_cache": True, "initializer_range": 0.02, "attention_dropout": 0.0,
    }
    if head_dim is not None:
        cfg["head_dim"] = head_dim
    cfg.update(extra or {})
    cfg.update(family.hf_config_fields(cfg, attention_bias=attention_bias, mlp_bias=mlp_bias))
    if rope_style == "legacy":
        cfg["rope_theta"] = rope_theta
        if rope_scaling is not None:
            cfg["rope_scaling"] = dict(rope_scaling)
    else:
        cfg["rope_parameters"] = {"rope_theta": rope_theta, "rope_type": "default", **(rope_scaling or {})}
    return cfg


def random_hf_weights(config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu") -> dict:
    """Seeded random tensors for every name the family's `hf_weight_shapes(config)` lists, returned on the CPU.
    `device` is where they are drawn (a GPU makes an 8B-parameter checkpoint in seconds; its random stream
    differs from the CPU's, so the same seed gives other weights there)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in config.family.hf_weight_shapes(config).items():
        r = torch.randn(shape, generator=gen, device=device)
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * r
        elif name.endswith(".bias"):
            t = 0.1 * r
        else:  # [out, in] (embeddings: [vocab, hidden], scaled like a linear with in = hidden)
            t = r / math.sqrt(shape[-1])
        out[name] = t.to(dtype).contiguous().cpu()
    return out


def expected_shard_numel(cfg: ModelConfig, size: int) -> int:
    """For tests: the parameters one tensor-parallel rank of `size` holds, counted from the config alone
    (independently of models.sharding.shard_spec, which it checks)."""
    H, D, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size // size
    hq, hkv = cfg.num_attention_heads // size, max(1, cfg.num_key_value_heads // size)
    vocab_rows = -(-cfg.vocab_size // size)
    n = vocab_rows * H * (1 if cfg.tie_word_embeddings else 2) + H
    for layer in range(cfg.num_hidden_layers):
        n += 2 * H + (hq + 2 * hkv) * D * H + H * hq * D
        n += (hq + 2 * hkv) * D * cfg.qkv_bias + H * cfg.o_bias + 2 * D * cfg.qk_norm
        if layer in cfg.moe_layers:
            n += cfg.num_experts * H + cfg.num_experts // size * 3 * cfg.moe_intermediate_size * H
        else:
            n += 3 * inter * H + (2 * inter + H) * cfg.mlp_bias
    return n


def write_tiny_checkpoint(out_dir: str | Path, architecture: str = "LlamaForCausalLM", *, seed: int = 0,
                          num_shards: int = 1, add_bos: bool = False,
                          chat_template: str | None = CHATML_TEMPLATE, weights_device: str | torch.device = "cpu",
                          **config_kwargs: Any) -> Path:
    """Write a complete HF-format model directory; returns its path. `config_kwargs` go to
    `tiny_config_dict`. num_shards > 1 writes model-0000i-of-0000n.safetensors + index. `weights_device`:
    where the random weights are drawn (see `random_hf_weights`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config_dict(architecture, **config_kwargs)
    tok = build_tiny_tokenizer(add_bos=add_bos)
    if tok.get_vocab_size() > cfg["vocab_size"]:
        raise ValueError(f"vocab_size {cfg['vocab_size']} is smaller than the tiny tokenizer's "
                         f"{tok.get_vocab_size()} tokens")
    config = ModelConfig.from_dict(cfg)
    weights = random_hf_weights(config, seed=seed, dtype=config.dtype or torch.float32, device=weights_device)
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", {"bos_token_id": 0, "eos_token_id": [2, 0]})
    _save_weights(out, weights, num_shards)
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL_TOKENS[0],
               "eos_token": SPECIAL_TOKENS[2], "pad_token": SPECIAL_TOKENS[0], "unk_token": None,
               "add_bos_token": add_bos, "add_eos_token": False, "clean_up_tokenization_spaces": False,
               "model_max_length": cfg["max_position_embeddings"]}
    if chat_template is not None:
        tok_cfg["chat_template"] = chat_template
    _write_json(out / "tokenizer_config.json", tok_cfg)
    return out


def _save_weights(out: Path, weights: dict[str, torch.Tensor], num_shards: int) -> None:
    if not (isinstance(num_shards, int) and num_shards >= 1):
        raise ValueError(f"num_shards must be a positive int, got {num_shards!r}")
    if num_shards == 1:
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(weights)
    per = math.ceil(len(names) / num_shards)
    weight_map = {}
    for s in range(num_shards):
        shard = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: weights[n] for n in names[s * per:(s + 1) * per]}
        save_file(part, str(out / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    _write_json(out / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": weight_map})


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


def write_fp8_checkpoint(src_dir: str | Path, out_dir: str | Path, *, quantization_config: dict | None = None,
                         skip: tuple[str, ...] = ()) -> Path:
    """Copy the model directory `src_dir` (config, tokenizer, weights) to `out_dir` as a HF block-scaled FP8
    checkpoint: each linear weight of the attention and MLP / experts stored as float8_e4m3fn with its
    128 x 128 block scales in `<name>_scale_inv`, config.json given `quantization_config` (default:
    `fp8.quantization_config_json()`). `skip`: HF tensor names to leave out (tests of missing tensors)."""
    import dataclasses
    import shutil

    from safetensors.torch import load_file

    from detinfer.kernels.fp8_quant import quantize_weight
    from detinfer.models import fp8
    from detinfer.models.loader import full_parameter_shapes, safetensors_files

    src, out = Path(src_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    config = dataclasses.replace(ModelConfig.from_dir(src), quantization="fp8")
    shapes = full_parameter_shapes(config)
    fp8_names = fp8.fp8_hf_weights(config.family.hf_sources(config), shapes)
    weights = {}
    for path in sorted(set(safetensors_files(src).values())):
        weights.update(load_file(str(path)))
    stored = {}
    for name, t in weights.items():
        if name in fp8_names:
            stored[name], stored[fp8.hf_scale_name(name)] = quantize_weight(t)
        else:
            stored[name] = t
    stored = {n: t.contiguous() for n, t in stored.items() if n not in skip}
    cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
    cfg["quantization_config"] = quantization_config or fp8.quantization_config_json()
    _write_json(out / "config.json", cfg)
    _save_weights(out, stored, 1)
    return out
