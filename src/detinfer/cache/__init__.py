"""Paged KV cache: pool allocation, the step layout (block tables, slot mappings, logits rows) and its
tensors.

Exports are resolved lazily, so the pure-Python `cache.layout` (which the scheduler uses) does not import
torch through this package.
"""

from __future__ import annotations

import importlib

_EXPORTS = {name: "detinfer.cache.paged_kv" for name in (
    "DEFAULT_BLOCK_SIZE", "KVCacheSpec", "StepMetadata", "allocate_kv_cache", "build_block_tables",
    "build_slot_mapping", "build_step_metadata", "check_step_metadata", "gather_kv", "num_blocks_for_bytes",
    "step_tensors")}
_EXPORTS["StepLayout"] = "detinfer.cache.layout"
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'detinfer.cache' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
