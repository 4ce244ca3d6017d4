"""The serving engine: scheduler + block manager (pure Python), model runner over the paged KV cache,
invariant sampler, `LLMEngine` (step-wise) and `LLM` (offline batch API).

Exports are resolved lazily, so importing the pure-Python submodules (config, scheduler, block manager)
does not import torch through this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "LLM": "detinfer.engine.llm",
    "LLMEngine": "detinfer.engine.llm_engine",
    "EngineConfig": "detinfer.engine.config",
    "SamplingParams": "detinfer.engine.sampling_params",
    "StructuredOutputs": "detinfer.engine.structured",
    "RequestOutput": "detinfer.engine.outputs",
    "CompletionOutput": "detinfer.engine.outputs",
    "TokenLogprob": "detinfer.engine.outputs",
    "EngineStats": "detinfer.engine.outputs",
}
__all__ = ["LLM", "CompletionOutput", "EngineConfig", "EngineStats", "LLMEngine", "RequestOutput",
           "SamplingParams", "StructuredOutputs", "TokenLogprob"]

if TYPE_CHECKING:
    from detinfer.engine.config import EngineConfig
    from detinfer.engine.llm import LLM
    from detinfer.engine.llm_engine import LLMEngine
    from detinfer.engine.outputs import CompletionOutput, EngineStats, RequestOutput, TokenLogprob
    from detinfer.engine.sampling_params import SamplingParams
    from detinfer.engine.structured import StructuredOutputs


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'detinfer.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
