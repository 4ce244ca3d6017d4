"""Paged KV cache: pool allocation, layout helpers, and the per-step metadata attention needs.

Layout: per layer one K pool and one V pool, each [num_blocks, block_size, num_kv_heads, head_dim].
A token's heads sit together (write_kv stores one token's Hkv x D with one program) and one head's key is
one contiguous head_dim row (the attention kernel loads a tile of BLOCK_N such rows per kv head). A
sequence owns a list of physical blocks (its block table); its key i lives in slot
table[i // block_size] * block_size + i % block_size. Which physical blocks it owns never changes the
attention bits: the kernel reads key i from wherever the table says, in key order.

Which blocks a sequence gets is the scheduler's business (engine.block_manager); the step's layout
(slots, positions, logits rows) is derived once, in `cache.layout`; this module allocates the pools and
turns a layout into tensors (`step_tensors`, which the engine runs every eager step through).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from detinfer.cache.layout import StepLayout, padded_tables
from detinfer.kernels._launch import check_step_metadata  # noqa: F401  (re-exported)

__all__ = ["DEFAULT_BLOCK_SIZE", "KVCacheSpec", "StepLayout", "StepMetadata", "allocate_kv_cache",
           "build_block_tables", "build_slot_mapping", "build_step_metadata", "check_step_metadata", "gather_kv",
           "num_blocks_for_bytes", "step_tensors"]

# Tokens per block. 16 keeps the tail waste per sequence small. The attention kernel looks up the block
# of every key (block ids one tile ahead), so any block size works and gives the same bits; the
# benchmark (docs/performance.md, "Attention") ran at 16 and reached the copy bandwidth at large batch.
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class KVCacheSpec:
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        for name in ("num_blocks", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"KVCacheSpec: {name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"KVCacheSpec: dtype must be a floating torch.dtype, got {self.dtype!r}")

    @property
    def pool_shape(self) -> tuple[int, int, int, int]:
        return (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes in one layer, K and V together."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * elem


def num_blocks_for_bytes(budget_bytes: int, *, block_size: int, num_kv_heads: int, head_dim: int,
                         dtype: torch.dtype, num_layers: int) -> int:
    """How many blocks fit in `budget_bytes` for all layers' K and V pools."""
    spec = KVCacheSpec(1, block_size, num_kv_heads, head_dim, dtype)
    if num_layers < 1 or budget_bytes < 0:
        raise ValueError(f"num_layers must be >= 1 and budget_bytes >= 0, got {num_layers}, {budget_bytes}")
    return budget_bytes // (spec.bytes_per_block * num_layers)


def allocate_kv_cache(spec: KVCacheSpec, num_layers: int, device: torch.device | str,
                      fill: float | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (k_pool, v_pool) pair per layer. fill=None leaves memory uninitialized (attention never reads
    a slot it was not given); tests pass fill=float('nan') so a wrong read shows."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"allocate_kv_cache: num_layers must be a positive int, got {num_layers!r}")
    pools = []
    for _ in range(num_layers):
        pair = tuple(torch.empty(spec.pool_shape, dtype=spec.dtype, device=device) for _ in range(2))
        if fill is not None:
            for t in pair:
                t.fill_(fill)
        pools.append(pair)
    return pools


def upload(values, dtype: torch.dtype, device: torch.device | str, *, out: torch.Tensor | None = None
           ) -> torch.Tensor:
    """Host values (nested lists, or a tensor built on the host) on `device`, without waiting for the device:
    the one host->device path of every step input (eager steps, CUDA-graph inputs, sampled-id gathers, the
    sampler's per-row values, logits processors' and grammars' masks). On CUDA the values are written
    once into pinned memory and copied with non_blocking=True: a copy from pageable memory may wait for the
    device's queued work, and the engine prepares a step while the previous one still runs (overlapped
    scheduling). The pinned block comes from torch's caching host allocator, which reuses it only after the
    copy reading it has completed, so no step waits for the previous step's copies.

    `out`: a device buffer (e.g. a CUDA graph's static input, which replay reads in place) to copy the
    values into instead of a new tensor; it may be a strided view. Returns `out`, or the new tensor."""
    cuda = torch.device(device).type == "cuda"
    if isinstance(values, torch.Tensor):
        host = values.to(dtype).pin_memory() if cuda else values.to(dtype)
    else:
        host = torch.tensor(values, dtype=dtype, pin_memory=cuda)
    if out is not None:
        return out.copy_(host.view(out.shape), non_blocking=True)
    return host.to(device, non_blocking=True) if cuda else host.to(device)


def build_block_tables(block_lists: Sequence[Sequence[int]], *, max_blocks: int | None = None,
                       device: torch.device | str = "cpu") -> torch.Tensor:
    """[S, max_blocks] int32 from per-sequence physical block lists; unused entries are 0 (never read:
    the kernel stops at kv_len)."""
    width = max((len(b) for b in block_lists), default=0)
    if max_blocks is None:
        max_blocks = max(width, 1)
    if width > max_blocks:
        raise ValueError(f"build_block_tables: a sequence has {width} blocks but max_blocks is {max_blocks}")
    rows = padded_tables(block_lists, max_blocks)
    return upload(rows, torch.int32, device).reshape(len(rows), max_blocks)


def build_slot_mapping(block_lists: Sequence[Sequence[int]], starts: Sequence[int], counts: Sequence[int],
                       block_size: int, *, pad_to: int | None = None,
                       device: torch.device | str = "cpu") -> torch.Tensor:
    """Slots of the new tokens: sequence s writes positions starts[s] .. starts[s] + counts[s] - 1, in
    packed order. Rows past the real tokens (pad_to) get -1 (write_kv skips them)."""
    slots = StepLayout.build(block_lists, starts, counts, block_size).slots
    if pad_to is not None:
        if pad_to < len(slots):
            raise ValueError(f"build_slot_mapping: pad_to {pad_to} < {len(slots)} real tokens")
        slots.extend([-1] * (pad_to - len(slots)))
    return upload(slots, torch.int64, device)


@dataclass(frozen=True)
class StepMetadata:
    """Everything one step's write_kv + paged_attention calls take (the same for every layer), and the
    packed token ids and positions the model runs on."""
    cu_q_lens: torch.Tensor  # [S+1] int32
    kv_lens: torch.Tensor  # [S] int32, keys per sequence including this step's
    block_tables: torch.Tensor  # [S, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64; -1: padding row, nothing written
    max_q_len: int  # host-side bounds: no device->host sync needed to size the grid
    max_kv_len: int
    input_ids: torch.Tensor | None = None  # [T] int64
    positions: torch.Tensor | None = None  # [T] int64


def step_tensors(layout: StepLayout, device: torch.device | str = "cpu", *,
                 max_blocks: int | None = None) -> StepMetadata:
    """The device tensors of one step's layout (what the engine runs every eager step through)."""
    i64 = torch.int64
    i32_rows = upload([layout.cu_q_lens, layout.kv_lens + [0]], torch.int32, device)  # one copy per dtype
    i64_rows = upload([layout.token_ids, layout.positions, layout.slots], i64, device)
    return StepMetadata(
        cu_q_lens=i32_rows[0], kv_lens=i32_rows[1, :-1],
        block_tables=build_block_tables(layout.block_tables, max_blocks=max_blocks, device=device),
        slot_mapping=i64_rows[2], max_q_len=layout.max_q_len, max_kv_len=layout.max_kv_len,
        input_ids=i64_rows[0], positions=i64_rows[1])


def build_step_metadata(block_lists: Sequence[Sequence[int]], num_cached: Sequence[int],
                        query_lens: Sequence[int], block_size: int, *, max_blocks: int | None = None,
                        device: torch.device | str = "cpu") -> StepMetadata:
    """Sequence s already has num_cached[s] keys in the cache and brings query_lens[s] new tokens."""
    if not (len(block_lists) == len(num_cached) == len(query_lens)):
        raise ValueError("build_step_metadata: block_lists, num_cached and query_lens must have one entry "
                         f"per sequence, got {len(block_lists)}, {len(num_cached)}, {len(query_lens)}")
    if any(n < 1 for n in query_lens) or any(c < 0 for c in num_cached):
        raise ValueError(f"build_step_metadata: query_lens must be >= 1 and num_cached >= 0, got "
                         f"{list(query_lens)}, {list(num_cached)}")
    layout = StepLayout.build(block_lists, num_cached, query_lens, block_size)
    return step_tensors(layout, device, max_blocks=max_blocks)


def gather_kv(cache: torch.Tensor, block_table_row: torch.Tensor | Sequence[int],
              kv_len: int) -> torch.Tensor:
    """Keys/values 0..kv_len-1 of one sequence, contiguous [kv_len, Hkv, D] (tests, references)."""
    bs = cache.shape[1]
    row = torch.as_tensor(block_table_row, dtype=torch.int64).cpu()[: -(-kv_len // bs)]
    slots = (row[:, None] * bs + torch.arange(bs)).reshape(-1)[:kv_len].to(cache.device)
    return cache.reshape(-1, *cache.shape[2:])[slots]
