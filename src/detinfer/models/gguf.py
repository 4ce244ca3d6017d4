"""GGUF (llama.cpp) file -> HF-format model directory that `load_model` / `load_tokenizer` read.

* Config: from the `{arch}.*` metadata keys.
* Weights: every tensor is dequantized with the `gguf` package (`gguf.quants.dequantize`; Q4_1, Q8_0, F16,
  ...) and stored in the requested float dtype (fp32 by default: a dequantized Q4_1/Q8_0 value, scale *
  quant + offset, is exact in fp32 but not always in 16-bit formats). llama.cpp's Llama converter permutes
  the rows of q/k so that rotary pairs are adjacent (its "interleaved" layout); HF checkpoints pair row i
  with row i + head_dim/2, so that permutation is undone per head for the families that say so
  (`ModelFamily.gguf_rotary_permuted`: Llama). Tensor names and family-specific config fields come from the
  family module (detinfer.models.families).
* Tokenizer: rebuilt from `tokenizer.ggml.*` into a tokenizer.json. Only GPT-2 style byte-level BPE
  ("gpt2" model) with the GPT-2 or the digit-splitting StarCoder/SmolLM pre-tokenizer is rebuilt; anything
  else is refused rather than approximated.

Needs the optional `gguf` package (pip install "detinfer[gguf]").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from detinfer.dtypes import DTYPES
from detinfer.models.config import ModelConfig
from detinfer.models.families import family_for_gguf_arch

# tokenizer.ggml.pre values whose pre-tokenization is GPT-2's regex, or GPT-2's after splitting every digit.
GPT2_PRE = ("default", "gpt2")
DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "codeshell")
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4  # gguf.TokenType values


def _gguf():
    try:
        import gguf
    except ImportError as e:
        raise ImportError("reading GGUF files needs the 'gguf' package: pip install 'detinfer[gguf]'") from e
    return gguf


def read_metadata(reader) -> dict[str, Any]:
    """All GGUF key/values as Python values (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def _f32(value: float) -> float:
    # GGUF stores floats as f32; keep the shortest decimal that round-trips (1e-05, not 9.99999974e-06).
    return float(str(np.float32(value)))


def hf_config_from_gguf(meta: dict[str, Any], tensor_names: set[str], dtype: str) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    family = family_for_gguf_arch(arch)
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("this GGUF carries per-dimension rope_freqs (Llama 3.1 style scaling), which cannot "
                         "be expressed as a HF rope config here; unsupported")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{name}")
        if isinstance(value, list):
            raise ValueError(f"{arch}.{name} varies per layer ({value[:4]}...); unsupported")
        return value

    heads = key("attention.head_count")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.get(f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:
        raise ValueError(f"GGUF metadata gives no vocab size ({arch}.vocab_size or tokenizer.ggml.tokens)")
    cfg: dict[str, Any] = {
        "architectures": [family.architectures[0]], "model_type": family.model_type, "hidden_act": "silu",
        "vocab_size": int(vocab), "hidden_size": key("embedding_length"),
        "intermediate_size": key("feed_forward_length", meta.get(f"{arch}.expert_feed_forward_length")),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads, "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": key("attention.key_length", key("embedding_length") // heads),
        "max_position_embeddings": key("context_length"),
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(key("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"), "torch_dtype": dtype,
    }
    experts = meta.get(f"{arch}.expert_count")
    if experts:  # a mixture of experts: llama.cpp stores the expert sizes as metadata
        if family.moe_from_hf is None:
            raise ValueError(f"GGUF architecture {arch!r} with {experts} experts is not supported (a "
                             f"Mixtral-style GGUF); mixture-of-experts GGUFs supported: qwen3moe")
        cfg.update(num_experts=int(experts), num_experts_per_tok=int(key("expert_used_count")),
                   moe_intermediate_size=int(key("expert_feed_forward_length")))
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": _f32(key("rope.scaling.factor"))}
    elif scaling != "none":
        raise ValueError(f"unsupported GGUF rope scaling {scaling!r}; supported: none, linear")
    cfg.update(family.gguf_config_fields(cfg, tensor_names))
    return cfg


def _unpermute_rotary_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: within each head, GGUF rows are (pair, 2) interleaved; HF
    rows are (2, pair), i.e. first halves of all pairs, then second halves. w: [n_heads * D, ...]."""
    rest = w.shape[1:]
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *rest).transpose(1, 2).reshape(w.shape)


def hf_tensors_from_gguf(reader, cfg: dict[str, Any], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gguf = _gguf()
    config = ModelConfig.from_dict(cfg)
    family = config.family
    expected = family.hf_weight_shapes(config)
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = family.hf_name_from_gguf(t.name)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        values = gguf.quants.dequantize(t.data, t.tensor_type)  # float32 numpy
        w = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)  # a writable copy
        if "{expert}" in name:  # llama.cpp stacks a layer's experts into one [E, out, in] tensor
            out.update({name.format(expert=e): w[e].to(dtype).contiguous() for e in range(shape[0])})
            continue
        proj = name.split(".")[-2]
        if family.gguf_rotary_permuted and name.startswith("model.layers.") and proj in ("q_proj", "k_proj"):
            kv = proj == "k_proj"
            w = _unpermute_rotary_rows(w, config.num_key_value_heads if kv else config.num_attention_heads)
        out[name] = w.to(dtype).contiguous()
    unexpected = sorted(set(out) - set(expected))
    missing = sorted(set(expected) - set(out))
    wrong = [f"{n}: {list(out[n].shape)} != {list(s)}" for n, s in expected.items()
             if n in out and tuple(out[n].shape) != s]
    if unexpected or missing or wrong:
        raise ValueError(f"GGUF tensors do not match the {cfg['architectures'][0]} layout: "
                         f"missing {missing}, unexpected {unexpected}, wrong shapes {wrong}")
    return out


def tokenizer_from_gguf(meta: dict[str, Any]) -> tuple[Tokenizer, dict[str, Any]]:
    """(tokenizers.Tokenizer, tokenizer_config.json dict) rebuilt from tokenizer.ggml.* metadata."""
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    if pre not in GPT2_PRE + DIGIT_SPLIT_PRE:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: "
                         f"{', '.join(GPT2_PRE + DIGIT_SPLIT_PRE)}")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF token list has duplicate entries; cannot build a vocabulary")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = (byte_level if pre in GPT2_PRE else
                         pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]))
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|> ...) are special: matched whole in text and skippable when decoding.
    # User-defined ones are matched whole but kept in decoded text.
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t == _TOKEN_CONTROL])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, t in enumerate(types) if t == _TOKEN_USER_DEFINED])

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    add_bos, add_eos = bool(meta.get("tokenizer.ggml.add_bos_token", False)), bool(
        meta.get("tokenizer.ggml.add_eos_token", False))
    specials = [s for s, flag in ((token("bos"), add_bos), (token("eos"), add_eos)) if flag and s]
    if specials:
        single = " ".join(([f"{token('bos')}:0"] if add_bos else []) + ["$A:0"] +
                          ([f"{token('eos')}:0"] if add_eos else []))
        tok.post_processor = processors.TemplateProcessing(
            single=single, special_tokens=[(s, vocab[s]) for s in dict.fromkeys(specials)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok_cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos, "add_eos_token": add_eos,
        "bos_token": token("bos"), "eos_token": token("eos"), "unk_token": token("unknown"),
        "pad_token": token("padding"), "clean_up_tokenization_spaces": False,
    }
    if meta.get("tokenizer.chat_template"):
        tok_cfg["chat_template"] = meta["tokenizer.chat_template"]
    return tok, tok_cfg


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write config.json, generation_config.json, model.safetensors, tokenizer.json and
    tokenizer_config.json for `gguf_path` into `out_dir` (created); returns out_dir."""
    gguf = _gguf()
    names = {v: k for k, v in DTYPES.items()}
    if dtype not in names:
        raise ValueError(f"dtype must be one of torch.float32/float16/bfloat16, got {dtype}")
    gguf_path, out = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    reader = gguf.GGUFReader(str(gguf_path))
    meta = read_metadata(reader)
    cfg = hf_config_from_gguf(meta, {t.name for t in reader.tensors}, names[dtype])
    tok, tok_cfg = tokenizer_from_gguf(meta)
    if tok.get_vocab_size() > cfg["vocab_size"]:
        raise ValueError(f"GGUF tokenizer has {tok.get_vocab_size()} tokens but the model only "
                         f"{cfg['vocab_size']} embeddings")
    tok_cfg["model_max_length"] = cfg["max_position_embeddings"]
    tensors = hf_tensors_from_gguf(reader, cfg, dtype)
    out.mkdir(parents=True, exist_ok=True)
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if cfg[k] is not None}
    if meta.get("tokenizer.ggml.eot_token_id") not in (None, cfg["eos_token_id"]):
        gen["eos_token_id"] = [cfg["eos_token_id"], meta["tokenizer.ggml.eot_token_id"]]
    for fname, data in (("config.json", cfg), ("generation_config.json", gen),
                        ("tokenizer_config.json", tok_cfg)):
        with open(out / fname, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, ensure_ascii=False)
            f.write("\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save(str(out / "tokenizer.json"))
    return out
