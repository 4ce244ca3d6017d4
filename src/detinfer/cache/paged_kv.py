"""Paged KV cache: pool allocation, layout helpers, and the per-step metadata attention needs.

Layout: per layer one K pool and one V pool, each [num_blocks, block_size, num_kv_heads, head_dim].
A token's heads sit together (write_kv stores one token's Hkv x D with one program) and one head's key is
one contiguous head_dim row (the attention kernel loads a tile of BLOCK_N such rows per kv head). A
sequence owns a list of physical blocks (its block table); its key i lives in slot
table[i // block_size] * block_size + i % block_size. Which physical blocks it owns never changes the
attention bits: the kernel reads key i from wherever the table says, in key order.

Which blocks a sequence gets is the scheduler's business (engine.block_manager); this module turns its
decisions into tensors and checks them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["DEFAULT_BLOCK_SIZE", "KVCacheSpec", "StepMetadata", "allocate_kv_cache", "build_block_tables",
           "build_slot_mapping", "build_step_metadata", "check_step_metadata", "gather_kv",
           "num_blocks_for_bytes"]

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


def build_block_tables(block_lists: Sequence[Sequence[int]], *, max_blocks: int | None = None,
                       device: torch.device | str = "cpu") -> torch.Tensor:
    """[S, max_blocks] int32 from per-sequence physical block lists; unused entries are 0 (never read:
    the kernel stops at kv_len)."""
    width = max((len(b) for b in block_lists), default=0)
    if max_blocks is None:
        max_blocks = max(width, 1)
    if width > max_blocks:
        raise ValueError(f"build_block_tables: a sequence has {width} blocks but max_blocks is {max_blocks}")
    table = torch.zeros((len(block_lists), max_blocks), dtype=torch.int32)
    for s, blocks in enumerate(block_lists):
        if blocks:
            table[s, : len(blocks)] = torch.as_tensor(list(blocks), dtype=torch.int32)
    return table.to(device)


def build_slot_mapping(block_lists: Sequence[Sequence[int]], starts: Sequence[int], counts: Sequence[int],
                       block_size: int, *, pad_to: int | None = None,
                       device: torch.device | str = "cpu") -> torch.Tensor:
    """Slots of the new tokens: sequence s writes positions starts[s] .. starts[s] + counts[s] - 1, in
    packed order. Rows past the real tokens (pad_to) get -1 (write_kv skips them)."""
    slots: list[int] = []
    for blocks, start, count in zip(block_lists, starts, counts, strict=True):
        end = start + count
        if start < 0 or count < 0 or -(-end // block_size) > len(blocks):
            raise ValueError(f"build_slot_mapping: positions {start}..{end - 1} need "
                             f"{-(-end // block_size)} blocks of {block_size}, sequence has {len(blocks)}")
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, end))
    if pad_to is not None:
        if pad_to < len(slots):
            raise ValueError(f"build_slot_mapping: pad_to {pad_to} < {len(slots)} real tokens")
        slots.extend([-1] * (pad_to - len(slots)))
    return torch.tensor(slots, dtype=torch.int64, device=device)


@dataclass(frozen=True)
class StepMetadata:
    """Everything one step's write_kv + paged_attention calls take (the same for every layer)."""
    cu_q_lens: torch.Tensor  # [S+1] int32
    kv_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64
    max_q_len: int
    max_kv_len: int


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
    kv = [c + n for c, n in zip(num_cached, query_lens, strict=True)]
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    return StepMetadata(
        cu_q_lens=torch.tensor(cu, dtype=torch.int32, device=device),
        kv_lens=torch.tensor(kv, dtype=torch.int32, device=device),
        block_tables=build_block_tables(block_lists, max_blocks=max_blocks, device=device),
        slot_mapping=build_slot_mapping(block_lists, num_cached, query_lens, block_size, device=device),
        max_q_len=max(query_lens, default=1), max_kv_len=max(kv, default=1))


def check_step_metadata(cu_q_lens: torch.Tensor, kv_lens: torch.Tensor, block_tables: torch.Tensor, *,
                        block_size: int, num_blocks: int, num_tokens: int, max_kv_len: int | None = None,
                        op: str = "paged attention") -> None:
    """Value checks of one step's metadata (one device->host copy). Raises ValueError naming the problem.

    Rows of q past cu_q_lens[-1] are allowed (padding; attention leaves them unwritten). max_kv_len, when
    given, must bound every kv_len (attention sizes its split grid from it); max_q_len is a speed hint
    only and needs no check.
    """
    cu = cu_q_lens.detach().cpu().to(torch.int64)
    kv = kv_lens.detach().cpu().to(torch.int64)
    s = kv.shape[0]
    if cu.shape != (s + 1,) or block_tables.shape[0] != s:
        raise ValueError(f"{op}: need cu_q_lens [S+1], kv_lens [S], block_tables [S, .] with one S; got "
                         f"{tuple(cu_q_lens.shape)}, {tuple(kv_lens.shape)}, {tuple(block_tables.shape)}")
    if s == 0:
        return
    q_lens = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or bool((q_lens < 0).any()):
        raise ValueError(f"{op}: cu_q_lens must start at 0 and never decrease, got {cu.tolist()}")
    if int(cu[-1]) > num_tokens:
        raise ValueError(f"{op}: cu_q_lens[-1] = {int(cu[-1])} exceeds the {num_tokens} query rows of q")
    bad = torch.nonzero(q_lens > kv).flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"{op}: sequence {i} has q_len {int(q_lens[i])} > kv_len {int(kv[i])} (kv_lens "
                         "count every key including this step's new ones)")
    if max_kv_len is not None and int(kv.max()) > max_kv_len:
        raise ValueError(f"{op}: max_kv_len {max_kv_len} < longest kv_len {int(kv.max())}")
    need = (kv + block_size - 1) // block_size
    short = torch.nonzero(need > block_tables.shape[1]).flatten()
    if short.numel():
        i = int(short[0])
        raise ValueError(f"{op}: block table too short: sequence {i} has kv_len {int(kv[i])}, needing "
                         f"{int(need[i])} blocks of {block_size}; the table has {block_tables.shape[1]} "
                         "columns")
    tables = block_tables.detach().cpu().to(torch.int64)
    used = torch.arange(tables.shape[1])[None, :] < need[:, None]
    ids = tables[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"{op}: block tables reference block ids outside [0, {num_blocks}) "
                         f"(min {int(ids.min())}, max {int(ids.max())})")


def gather_kv(cache: torch.Tensor, block_table_row: torch.Tensor | Sequence[int],
              kv_len: int) -> torch.Tensor:
    """Keys/values 0..kv_len-1 of one sequence, contiguous [kv_len, Hkv, D] (tests, references)."""
    bs = cache.shape[1]
    row = torch.as_tensor(block_table_row, dtype=torch.int64).cpu()[: -(-kv_len // bs)]
    slots = (row[:, None] * bs + torch.arange(bs)).reshape(-1)[:kv_len].to(cache.device)
    return cache.reshape(-1, *cache.shape[2:])[slots]
