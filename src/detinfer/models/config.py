"""`ModelConfig`: the architecture facts the model code needs, parsed and validated from a HF config.json.

One decoder-only transformer covers every registered family (detinfer.models.families: Llama, Qwen2,
Qwen3); what differs between them is expressed as flags here (qkv/output/MLP biases, per-head q/k RMSNorm),
which each family's module derives from its config.json, so the model code has no per-architecture branches.

Two spellings of the rotary parameters exist in the wild: transformers 4 writes `rope_theta` and
`rope_scaling` at the top level, transformers 5 writes one `rope_parameters` dict (and may keep a top-level
`rope_theta` as well). Both are accepted and normalised into `rope_theta` + `RopeScaling`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from detinfer.dtypes import DTYPES
from detinfer.models.families import ModelFamily, family_for_architecture, supported_architectures
from detinfer.models.fp8 import QUANTIZATIONS, parse_quantization_config, parse_unquantized_modules

# Rotary variants whose frequencies are a fixed function of the config. "dynamic" NTK scaling is left out on
# purpose: its frequencies depend on the current sequence length, so a token's result would depend on how
# long its sequence happens to be at that step.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling. `linear`: inv_freq / factor. `llama3`: Llama 3.1's banded scaling."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None

    def __post_init__(self):
        if self.rope_type not in SUPPORTED_ROPE_TYPES or self.rope_type == "default":
            raise ValueError(f"rope scaling type must be one of {SUPPORTED_ROPE_TYPES[1:]}, "
                             f"got {self.rope_type!r}")
        if not (isinstance(self.factor, (int, float)) and self.factor >= 1.0):
            raise ValueError(f"rope scaling factor must be a number >= 1, got {self.factor!r}")
        if self.rope_type == "llama3":
            for name in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                value = getattr(self, name)
                if not (isinstance(value, (int, float)) and value > 0):
                    raise ValueError(f"llama3 rope scaling needs a positive {name}, got {value!r}")
            if self.high_freq_factor <= self.low_freq_factor:
                raise ValueError("llama3 rope scaling needs high_freq_factor > low_freq_factor, got "
                                 f"{self.high_freq_factor} <= {self.low_freq_factor}")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    # The family flags (see detinfer.models.families: each family's flags_from_hf sets them).
    qkv_bias: bool = False  # bias on the q/k/v projections
    o_bias: bool = False  # bias on the attention output projection
    mlp_bias: bool = False  # biases on gate/up/down
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before rotary
    # Mixture of experts (0 experts: a dense model). `moe_layers`: the layers whose MLP is the sparse block
    # (the rest keep the dense MLP of intermediate_size); `norm_topk_prob`: renormalise the top-k weights.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    pad_token_id: int | None = None
    torch_dtype: str | None = None  # the dtype the checkpoint was saved in, if config.json says
    # "fp8": linear weights are block-scaled float8_e4m3fn (models/fp8.py); None: all in the model dtype.
    quantization: str | None = None
    # FP8 checkpoints: HF module-name patterns left in the model dtype (quantization_config's
    # modules_to_not_convert / ignored_layers; models/fp8.py `unquantized_linears` applies them).
    fp8_unquantized: tuple[str, ...] = ()

    def __post_init__(self):
        family_for_architecture(self.architecture)  # raises, naming the supported ones
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"rope_scaling must be a RopeScaling or None, got {type(self.rope_scaling)}")
        for name in ("tie_word_embeddings", "qkv_bias", "o_bias", "mlp_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self._check_moe()
        for name in ("bos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 0 <= value < self.vocab_size):
                raise ValueError(f"{name} must be None or an id in [0, {self.vocab_size}), got {value!r}")
        if not isinstance(self.eos_token_ids, tuple) or not all(
                isinstance(i, int) and 0 <= i < self.vocab_size for i in self.eos_token_ids):
            raise ValueError(f"eos_token_ids must be a tuple of ids in [0, {self.vocab_size}), "
                             f"got {self.eos_token_ids!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}")
        if not (isinstance(self.fp8_unquantized, tuple) and all(isinstance(p, str) for p in self.fp8_unquantized)):
            raise ValueError(f"fp8_unquantized must be a tuple of module-name patterns, got {self.fp8_unquantized!r}")
        if self.torch_dtype is not None and self.torch_dtype not in DTYPES:
            raise ValueError(f"torch_dtype must be one of {sorted(DTYPES)} or None, got {self.torch_dtype!r}")

    def _check_moe(self) -> None:
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"norm_topk_prob must be a bool, got {self.norm_topk_prob!r}")
        layers = self.moe_layers
        if not (isinstance(layers, tuple) and all(isinstance(i, int) and 0 <= i < self.num_hidden_layers
                                                  for i in layers) and list(layers) == sorted(set(layers))):
            raise ValueError(f"moe_layers must be an ascending tuple of layer indices in "
                             f"[0, {self.num_hidden_layers}), got {layers!r}")
        if self.num_experts == 0:
            if layers:
                raise ValueError(f"moe_layers {layers} given but num_experts is 0")
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                             f"got {self.num_experts_per_tok}")
        if self.moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size must be positive for an MoE model, got "
                             f"{self.moe_intermediate_size}")

    @property
    def family(self) -> ModelFamily:
        return family_for_architecture(self.architecture)

    @property
    def model_type(self) -> str:
        return self.family.model_type

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def softmax_scale(self) -> float:
        """Scale applied to q.k before softmax (the runner's attention needs it)."""
        return self.head_dim ** -0.5

    @property
    def dtype(self) -> torch.dtype | None:
        return DTYPES[self.torch_dtype] if self.torch_dtype else None

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
        """Parse a HF config.json dict (and optionally generation_config.json for extra eos ids)."""
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot tell which model this is "
                             f"(supported: {', '.join(supported_architectures())})")
        arch = archs[0]
        family = family_for_architecture(arch)
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {cfg.get('hidden_act')!r}")
        if cfg.get("use_sliding_window"):
            raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")
        if cfg.get("pretraining_tp", 1) not in (1, None):
            raise ValueError(f"pretraining_tp must be 1, got {cfg.get('pretraining_tp')!r}")
        _require(cfg, "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "vocab_size", "rms_norm_eps")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope_theta, rope_scaling = _parse_rope(cfg)
        gen = generation_config or {}
        eos: list[int] = []
        for ids in (gen.get("eos_token_id"), cfg.get("eos_token_id")):
            for i in ([] if ids is None else [ids] if isinstance(ids, int) else list(ids)):
                if i not in eos:
                    eos.append(i)
        bos = gen.get("bos_token_id", cfg.get("bos_token_id"))
        dtype = cfg.get("torch_dtype") or cfg.get("dtype")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg["rms_norm_eps"]),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            **family.flags(cfg),
            **(family.moe_from_hf(cfg) if family.moe_from_hf is not None else {}),
            bos_token_id=bos,
            eos_token_ids=tuple(eos),
            pad_token_id=cfg.get("pad_token_id"),
            torch_dtype=dtype,
            quantization=parse_quantization_config(cfg),
            fp8_unquantized=parse_unquantized_modules(cfg),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read config.json (required) and generation_config.json (optional) from a model directory."""
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model directory {model_dir} does not exist")
        path = model_dir / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir} (expected a HF-format model directory)")
        cfg = _read_json(path)
        gen_path = model_dir / "generation_config.json"
        gen = _read_json(gen_path) if gen_path.is_file() else None
        return cls.from_dict(cfg, gen)


def _require(cfg: dict, *names: str) -> None:
    missing = [n for n in names if cfg.get(n) is None]
    if missing:
        raise ValueError(f"config.json is missing required field(s): {', '.join(missing)}")


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _parse_rope(cfg: dict) -> tuple[float, RopeScaling | None]:
    """Normalise both rotary spellings (see module docstring) into (theta, scaling)."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = dict(cfg.get("rope_scaling") or {})
    if params and any(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported (one global rotary config "
                         "expected)")
    if (params.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = legacy or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return float(theta), None
    if rope_type == "linear":
        return float(theta), RopeScaling("linear", factor=float(scaling.get("factor", 1.0)))
    return float(theta), RopeScaling(
        rope_type=rope_type,
        factor=float(scaling.get("factor", 1.0)),
        low_freq_factor=scaling.get("low_freq_factor"),
        high_freq_factor=scaling.get("high_freq_factor"),
        # as in HF: without an explicit pretraining length, the config's max positions is taken
        original_max_position_embeddings=scaling.get("original_max_position_embeddings",
                                                     cfg.get("max_position_embeddings")),
    )
