"""detinfer: deterministic, batch-invariant LLM inference.

Drop-in mode for any PyTorch / Hugging Face model:

    import detinfer
    with detinfer.batch_invariant():
        out = model(**inputs)

The serving engine's offline API, spelled as in vLLM (also importable from detinfer.engine):

    from detinfer import LLM, SamplingParams
    llm = LLM("Qwen/Qwen3-0.6B")  # a model directory or a Hugging Face hub id
    print(llm.generate("Hello", SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text)

All of these names are imported lazily, so pure-Python parts (the scheduler, the block manager) can be
imported without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_MODE_NAMES = ("NotBatchInvariantError", "batch_invariant", "disable", "enable", "is_enabled")
_ENGINE_NAMES = ("LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams",
                 "StructuredOutputs")

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "NotBatchInvariantError", "RequestOutput",
           "SamplingParams", "StructuredOutputs", "__version__", "batch_invariant", "disable", "enable", "is_enabled"]

if TYPE_CHECKING:
    from detinfer.engine import (
        LLM,
        CompletionOutput,
        EngineConfig,
        LLMEngine,
        RequestOutput,
        SamplingParams,
        StructuredOutputs,
    )
    from detinfer.ops.mode import NotBatchInvariantError, batch_invariant, disable, enable, is_enabled


def __getattr__(name: str):
    if name in _MODE_NAMES:
        return getattr(importlib.import_module("detinfer.ops.mode"), name)
    if name in _ENGINE_NAMES:
        return getattr(importlib.import_module("detinfer.engine"), name)
    raise AttributeError(f"module 'detinfer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
