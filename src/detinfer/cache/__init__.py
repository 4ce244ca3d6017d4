"""Paged KV cache pools, layout helpers and per-step metadata (block tables, slot mappings)."""

from detinfer.cache.paged_kv import (
    DEFAULT_BLOCK_SIZE,
    KVCacheSpec,
    StepMetadata,
    allocate_kv_cache,
    build_block_tables,
    build_slot_mapping,
    build_step_metadata,
    check_step_metadata,
    gather_kv,
    num_blocks_for_bytes,
)

__all__ = ["DEFAULT_BLOCK_SIZE", "KVCacheSpec", "StepMetadata", "allocate_kv_cache", "build_block_tables",
           "build_slot_mapping", "build_step_metadata", "check_step_metadata", "gather_kv",
           "num_blocks_for_bytes"]
