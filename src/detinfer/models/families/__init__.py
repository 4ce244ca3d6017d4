"""The model-family registry: one module per architecture (llama.py, qwen2.py, qwen3.py, ...).

Every module in this package that defines `FAMILY` (a `ModelFamily`) is registered at import, in module-name
order. Lookups by HF architecture string, GGUF architecture or preset name raise a ValueError naming what is
supported.

Adding an architecture whose checkpoints have the dense decoder's tensors (biases / q-k norm as flags) is one
new module here plus its tests (tests/models/families/test_<name>.py); ModelConfig, the loader, the GGUF
converter, the tiny-checkpoint writer and `--random-model` find it through this registry. One whose tensors
differ (a mixture of experts) also brings its own weight layout module, and the model code its new layer.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from detinfer.models.families.base import FLAG_FIELDS, ModelFamily

__all__ = ["FLAG_FIELDS", "ModelFamily", "families", "family_for_architecture", "family_for_gguf_arch",
           "preset_hf_config", "preset_names", "register", "supported_architectures"]

_BY_TYPE: dict[str, ModelFamily] = {}
_BY_ARCHITECTURE: dict[str, ModelFamily] = {}
_BY_GGUF_ARCH: dict[str, ModelFamily] = {}
_PRESET_OWNER: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    """Add a family; its model_type, architectures, GGUF arch and preset names must all be new."""
    if not isinstance(family, ModelFamily):
        raise TypeError(f"register takes a ModelFamily, got {type(family).__name__}")
    clashes = ([f"model_type {family.model_type!r}"] if family.model_type in _BY_TYPE else []) + [
        f"architecture {a!r}" for a in family.architectures if a in _BY_ARCHITECTURE] + (
        [f"GGUF arch {family.gguf_arch!r}"] if family.gguf_arch in _BY_GGUF_ARCH else []) + [
        f"preset {p!r}" for p in family.presets if p in _PRESET_OWNER]
    if clashes:
        raise ValueError(f"family {family.model_type!r} clashes with a registered family: {', '.join(clashes)}")
    _BY_TYPE[family.model_type] = family
    _BY_ARCHITECTURE.update(dict.fromkeys(family.architectures, family))
    if family.gguf_arch is not None:
        _BY_GGUF_ARCH[family.gguf_arch] = family
    _PRESET_OWNER.update(dict.fromkeys(family.presets, family))
    return family


def families() -> tuple[ModelFamily, ...]:
    return tuple(_BY_TYPE.values())


def supported_architectures() -> tuple[str, ...]:
    return tuple(_BY_ARCHITECTURE)


def family_for_architecture(architecture: str) -> ModelFamily:
    """The family of a HF `architectures[0]` string (e.g. "Qwen3ForCausalLM")."""
    family = _BY_ARCHITECTURE.get(architecture) if isinstance(architecture, str) else None
    if family is None:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: "
                         f"{', '.join(supported_architectures())}")
    return family


def family_for_gguf_arch(arch: str) -> ModelFamily:
    """The family of a GGUF `general.architecture` value (e.g. "qwen3")."""
    family = _BY_GGUF_ARCH.get(arch) if isinstance(arch, str) else None
    if family is None:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_BY_GGUF_ARCH)}")
    return family


def preset_names() -> tuple[str, ...]:
    return tuple(_PRESET_OWNER)


def preset_hf_config(name: str) -> dict[str, Any]:
    """A random-model preset's HF config.json dict (a fresh copy)."""
    family = _PRESET_OWNER.get(name) if isinstance(name, str) else None
    if family is None:
        raise ValueError(f"unknown random model {name!r}; known: {', '.join(preset_names())}")
    return family.preset_hf_config(name)


def _register_builtin_families() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        if isinstance(getattr(module, "FAMILY", None), ModelFamily):
            register(module.FAMILY)


_register_builtin_families()
