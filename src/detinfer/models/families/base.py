"""`ModelFamily`: everything detinfer knows about one HF architecture, in one value.

The model code (`detinfer.models.transformer`) has no per-architecture branches: what differs between
families reaches it only as `ModelConfig` fields (biases, q/k norm). A family module says how to get those
fields from a HF config.json, which tensor names its checkpoints and its GGUF files hold, and which
random-model presets (public models' shapes, no weights) it offers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# The ModelConfig fields a family derives from its config.json; the model code reads only these.
FLAG_FIELDS = ("qkv_bias", "o_bias", "mlp_bias", "qk_norm")


@dataclass(frozen=True)
class ModelFamily:
    """One architecture. Callables take plain dicts / a ModelConfig, so this module needs no torch."""

    model_type: str  # HF config.json `model_type`; also the family's name
    architectures: tuple[str, ...]  # HF config.json `architectures[0]` values loaded as this family
    # HF config.json dict -> {flag: bool} for every name in FLAG_FIELDS.
    flags_from_hf: Callable[[Mapping[str, Any]], dict[str, bool]]
    # (common config.json fields, attention_bias, mlp_bias) -> the family's own config.json fields, for
    # checkpoints written here (tiny test checkpoints).
    hf_config_fields: Callable[..., dict[str, Any]]
    # HF checkpoint layout: ModelConfig -> {tensor name: shape}, and HF tensors -> Transformer state dict.
    hf_weight_shapes: Callable[[Any], dict[str, tuple[int, ...]]]
    state_dict_from_hf: Callable[[Any, dict], dict]
    # ModelConfig -> {Transformer parameter name: dense_decoder.HFSource}: which HF tensors make each parameter
    # (what the sharded loader reads slices of). None: only whole-model loading.
    hf_sources: Callable[[Any], dict] | None = None
    gguf_arch: str | None = None  # GGUF `general.architecture`; None: no GGUF support
    # (common config.json fields read from GGUF metadata, GGUF tensor names) -> the family's own fields.
    gguf_config_fields: Callable[[Mapping[str, Any], set[str]], dict[str, Any]] | None = None
    hf_name_from_gguf: Callable[[str], str] | None = None  # GGUF tensor name -> HF tensor name
    # llama.cpp's converter permutes q/k rows of this family (rotary pairs made adjacent); undone on load.
    gguf_rotary_permuted: bool = False
    # Mixture of experts: HF config.json dict -> the ModelConfig MoE fields (`num_experts`,
    # `num_experts_per_tok`, `moe_intermediate_size`, `norm_topk_prob`, `moe_layers`); None: a dense family.
    moe_from_hf: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    # random-model name -> HF config.json fields of a public model's shape (`architectures` is added).
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def __post_init__(self):
        if not (isinstance(self.model_type, str) and self.model_type):
            raise ValueError(f"model_type must be a non-empty str, got {self.model_type!r}")
        if not (isinstance(self.architectures, tuple) and self.architectures
                and all(isinstance(a, str) and a for a in self.architectures)):
            raise ValueError(f"{self.model_type}: architectures must be a non-empty tuple of str, "
                             f"got {self.architectures!r}")
        if self.gguf_arch is not None and (self.gguf_config_fields is None or self.hf_name_from_gguf is None):
            raise ValueError(f"{self.model_type}: a family with a gguf_arch needs gguf_config_fields and "
                             "hf_name_from_gguf")
        for name, preset in self.presets.items():
            if "architectures" in preset:
                raise ValueError(f"{self.model_type}: preset {name!r} must not set 'architectures' (the "
                                 "family adds its own)")

    def flags(self, hf_config: Mapping[str, Any]) -> dict[str, bool]:
        """`flags_from_hf`, checked to give exactly FLAG_FIELDS as bools."""
        flags = self.flags_from_hf(hf_config)
        if set(flags) != set(FLAG_FIELDS) or not all(isinstance(v, bool) for v in flags.values()):
            raise ValueError(f"{self.model_type}: flags_from_hf must return bools for exactly "
                             f"{FLAG_FIELDS}, got {flags!r}")
        return flags

    def preset_hf_config(self, name: str) -> dict[str, Any]:
        """The preset's HF config.json dict, with this family's architecture."""
        return {"architectures": [self.architectures[0]], **self.presets[name]}
