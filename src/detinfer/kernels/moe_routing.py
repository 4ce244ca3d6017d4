"""The MoE layer's routing bookkeeping: stable top-k of the router probabilities, and the grouping of the
(token, rank) pairs by expert into whole tiles for the grouped expert GEMMs (kernels/moe.py's module doc
says why each is done this way). Each is a pure-torch reference and one Triton launch that gives the
reference's bits:

- `topk_stable_ref` / `topk_stable`: per row, the k highest probabilities, higher first, equal ones in
  ascending expert id (what a stable descending sort gives; NaN, as torch sorts it, above everything);
  renormalised weights divide each value by v0 + v1 + ... + v_{k-1}, added left to right in fp32, with an
  IEEE round-to-nearest division (`tl.math.div_rn`: Triton's plain `/` on fp32 may be an approximate
  division on a GPU, torch's is not). The kernel takes k rounds of (max, lowest index holding it, mask it
  out) over a row tile held in registers, so it is limited to `TOPK_MAX_EXPERTS` experts.
- `local_expert_ids` + `group_by_expert_ref` / `group_by_expert`: (pair ids padded to whole BLOCK_M
  tiles, one expert per tile; each tile's expert) from the global expert ids, with expert parallelism's
  foreign slots (experts of another rank) in a last group that is never computed. The kernel is one
  program, since the grouping is global over all pairs: it counts the pairs of each expert, prefix-sums
  the padded counts, then gives each pair its rank among the earlier pairs of its expert and scatters the
  pair index there.

Why kernels: at decode sizes the references are ~50 launches of a few microseconds each per MoE layer
(sort, slicing, k - 1 adds, a division; sort, scatter_add, cumsums, searchsorted, index ops), more than the
expert GEMMs themselves. Neither path synchronises with the host, so both can be captured in a CUDA graph;
the outputs are exact (integers, or the reference's fp32 operations in the reference's order), so which
path runs never changes a bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detinfer.kernels._launch import check_kernel_inputs, interpreting, next_pow2

__all__ = ["GROUP_KERNEL_MAX_PAIRS", "TOPK_MAX_EXPERTS", "group_by_expert", "group_by_expert_ref",
           "local_expert_ids", "max_tiles_for", "topk_stable", "topk_stable_ref"]

# The top-k kernel holds a whole row in registers and does k max-reductions over it: fine up to 512
# experts (every current MoE model); wider rows take the reference (`kernels.moe.route` checks this).
TOPK_MAX_EXPERTS = 512
# Probabilities per top-k program (rows = this // the row tile's width). Rows are independent, so the
# tile shape cannot change a result; it comes from E only, never from the number of tokens.
_TOPK_TILE_ELEMENTS = 2048
# `group_by_expert` runs its one-program kernel up to this many (token, rank) pairs and the torch
# reference above it. Both give identical integers, so the switch cannot change a bit; above it the single
# program's serial walk over the pairs would be slower than torch's device-wide sort (prefill sizes).
GROUP_KERNEL_MAX_PAIRS = 4096
# One-hot tile of the grouping kernel: pairs per chunk x expert buckets (a function of E only).
_GROUP_TILE_ELEMENTS = 4096


# ----------------------------------------------------------------------------------------- references
def topk_stable_ref(probs: torch.Tensor, top_k: int, renormalize: bool):
    """Top-k of each row of probs [T, E]: higher score first, ties to the lower expert id (a stable sort of
    the scores keeps equal ones in id order). Renormalised weights sum the k values in rank order."""
    values, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    values, ids = values[:, :top_k], ids[:, :top_k]
    if renormalize:
        total = values[:, 0]
        for r in range(1, top_k):
            total = total + values[:, r]
        values = values / total[:, None]
    return values, ids


def local_expert_ids(ids: torch.Tensor, first_expert: int | None, num_local: int) -> tuple[torch.Tensor, bool]:
    """Expert parallelism: (ids as indices into this rank's experts [first_expert, first_expert + num_local),
    every slot routed to another rank's expert mapped to `num_local`; whether such foreign slots may occur,
    i.e. `first_expert` was given). `group_by_expert_ref(..., foreign)` puts the `num_local` slots in a last
    group that is never computed, so their outputs must start at zero. Without `first_expert` the ids are
    returned as they are. Pure index arithmetic on the device (no host sync)."""
    if first_expert is None:
        return ids, False
    local = ids - first_expert
    return torch.where((local >= 0) & (local < num_local), local, num_local), True


def max_tiles_for(pairs: int, buckets: int, block_m: int) -> int:
    """Tiles of the fixed-size grid for `pairs` pairs in `buckets` groups: each group adds at most one
    partial tile. A function of the pair count only (host arithmetic, no sync)."""
    return -(-pairs // block_m) + min(buckets, pairs)


def group_by_expert_ref(ids: torch.Tensor, num_experts: int, block_m: int, foreign: bool = False):
    """(pair ids [tiles * block_m] int32, -1 = padding; expert of each tile [tiles] int32, -1 = spare; tiles)
    for local ids [T, k]: pairs (t * k + r) grouped by expert in ascending pair order, each expert's group
    padded to whole tiles. All on the device (no host sync); the grid size depends on T * k only. `foreign`:
    ids may also be `num_experts`, a slot whose expert lives on another rank; those pairs form a last group
    whose tiles are spare (never computed)."""
    dev = ids.device
    flat = ids.reshape(-1)
    P = flat.numel()
    buckets = num_experts + int(foreign)
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(buckets, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    group_start = torch.cumsum(counts, 0) - counts
    sorted_e = flat[order]
    dest = (padded_end - padded)[sorted_e] + torch.arange(P, device=dev) - group_start[sorted_e]
    max_tiles = max_tiles_for(P, buckets, block_m)
    pair_ids = torch.full((max_tiles * block_m,), -1, dtype=torch.int32, device=dev)
    pair_ids[dest] = order.to(torch.int32)
    tile_start = torch.arange(max_tiles, device=dev, dtype=torch.int64) * block_m
    tile_expert = torch.searchsorted(padded_end, tile_start, right=True)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1).to(torch.int32)
    return pair_ids, tile_expert, max_tiles


# -------------------------------------------------------------------------------------------- top-k
@triton.jit
def _topk_kernel(probs_ptr, values_ptr, ids_ptr, T, E, stride_p, stride_o,
                 TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    row_ptr = probs_ptr + rows.to(tl.int64) * stride_p
    x = tl.load(row_ptr[:, None] + cols[None, :], mask=row_ok[:, None] & (cols[None, :] < E), other=0.0)
    alive = (cols[None, :] < E) & (rows[:, None] >= 0)  # [BLOCK_T, BLOCK_E]: not chosen yet
    is_nan = x != x
    ranks = tl.arange(0, BLOCK_K)
    values = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    ids = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    total = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for r in tl.static_range(TOP_K):
        # torch's descending sort puts NaN first (lowest index first), then the values, ties to the lower id
        first_nan = tl.min(tl.where(alive & is_nan, cols[None, :], BLOCK_E), axis=1)
        best = tl.max(tl.where(alive & ~is_nan, x, float("-inf")), axis=1)
        first_best = tl.min(tl.where(alive & (x == best[:, None]), cols[None, :], BLOCK_E), axis=1)
        pick = tl.where(first_nan < BLOCK_E, first_nan, first_best)
        # The chosen value re-read from memory: its exact bits (-0.0, NaN payloads included).
        v = tl.load(row_ptr + pick, mask=row_ok, other=1.0)
        alive = alive & (cols[None, :] != pick[:, None])
        values = tl.where(ranks[None, :] == r, v[:, None], values)
        ids = tl.where(ranks[None, :] == r, pick[:, None], ids)
        if r == 0:
            total = v
        else:
            total = total + v  # rank order, one rounded fp32 add per rank, as the reference
    if RENORMALIZE:
        values = tl.math.div_rn(values, total[:, None])
    out = rows.to(tl.int64)[:, None] * stride_o + ranks[None, :]
    out_ok = row_ok[:, None] & (ranks[None, :] < TOP_K)
    tl.store(values_ptr + out, values, mask=out_ok)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=out_ok)


def topk_stable(probs: torch.Tensor, top_k: int, renormalize: bool):
    """`topk_stable_ref`'s bits in one launch: probs [T, E] fp32 (E <= TOPK_MAX_EXPERTS) on CUDA, or on the
    CPU under TRITON_INTERPRET=1 -> (values [T, k] fp32, ids [T, k] int64)."""
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2:
        raise ValueError("topk_stable: probs must be a 2-D tensor [tokens, experts], got "
                         f"{tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__}")
    check_kernel_inputs("topk_stable", probs, dtypes=(torch.float32,))
    T, E = probs.shape
    if E > TOPK_MAX_EXPERTS:
        raise ValueError(f"topk_stable: {E} experts; the kernel takes at most {TOPK_MAX_EXPERTS} "
                         "(use topk_stable_ref for wider rows)")
    if not (isinstance(top_k, int) and 1 <= top_k <= E):
        raise ValueError(f"topk_stable: top_k must be an int in [1, {E}] (the number of experts), got {top_k!r}")
    values = torch.empty(T, top_k, dtype=torch.float32, device=probs.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=probs.device)
    if T == 0:
        return values, ids
    probs = probs if probs.stride(1) == 1 else probs.contiguous()
    block_e = next_pow2(E)
    block_t = max(1, _TOPK_TILE_ELEMENTS // block_e)
    _topk_kernel[(triton.cdiv(T, block_t),)](probs, values, ids, T, E, probs.stride(0), top_k, TOP_K=top_k,
                                             RENORMALIZE=bool(renormalize), BLOCK_T=block_t, BLOCK_E=block_e,
                                             BLOCK_K=next_pow2(top_k), num_warps=4)
    return values, ids


# ----------------------------------------------------------------------------------------- grouping
@triton.jit
def _chunk_buckets(ids_ptr, start, P, first_expert, NUM_EXPERTS: tl.constexpr, FOREIGN: tl.constexpr,
                   CHUNK: tl.constexpr, BLOCK_B: tl.constexpr):
    """(pair indices, whether each is a pair, one-hot [CHUNK, BLOCK_B] of each pair's bucket) for the
    pairs start .. start + CHUNK - 1. Local id = global - first_expert; with FOREIGN every id outside
    [0, NUM_EXPERTS) goes to bucket NUM_EXPERTS (`local_expert_ids`)."""
    pairs = start + tl.arange(0, CHUNK)
    ok = pairs < P
    e = (tl.load(ids_ptr + pairs, mask=ok, other=0) - first_expert).to(tl.int32)
    if FOREIGN:
        e = tl.where((e >= 0) & (e < NUM_EXPERTS), e, NUM_EXPERTS)
    buckets = tl.arange(0, BLOCK_B)
    return pairs, ok, (buckets[None, :] == e[:, None]) & ok[:, None]


@triton.jit
def _group_kernel(ids_ptr, pair_ids_ptr, tile_expert_ptr, P, first_expert, max_tiles,
                  NUM_EXPERTS: tl.constexpr, FOREIGN: tl.constexpr, BLOCK_M: tl.constexpr,
                  CHUNK: tl.constexpr, BLOCK_B: tl.constexpr, FILL: tl.constexpr):
    buckets = tl.arange(0, BLOCK_B)
    n_buckets = NUM_EXPERTS + FOREIGN
    # 1. pairs per bucket, padded to whole tiles; each group's first padded slot
    counts = tl.zeros((BLOCK_B,), dtype=tl.int32)
    for start in range(0, P, CHUNK):
        _, _, hot = _chunk_buckets(ids_ptr, start, P, first_expert, NUM_EXPERTS, FOREIGN, CHUNK, BLOCK_B)
        counts += tl.sum(hot.to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    # 2. every slot -1 (padding), then (after the barrier) each pair's index at its slot
    slots = max_tiles * BLOCK_M
    for s in range(0, slots, FILL):
        offs = s + tl.arange(0, FILL)
        tl.store(pair_ids_ptr + offs, tl.full((FILL,), -1, tl.int32), mask=offs < slots)
    tl.debug_barrier()
    next_slot = padded_end - padded  # per bucket: where its next pair goes
    for start in range(0, P, CHUNK):
        pairs, ok, hot = _chunk_buckets(ids_ptr, start, P, first_expert, NUM_EXPERTS, FOREIGN, CHUNK, BLOCK_B)
        hot_i = hot.to(tl.int32)
        # rank among this chunk's earlier pairs of the same bucket (inclusive count - 1), plus its slot base
        rank = tl.sum(tl.where(hot, tl.cumsum(hot_i, 0), 0), axis=1) - 1
        base = tl.sum(tl.where(hot, next_slot[None, :], 0), axis=1)
        dest = base + rank
        tl.store(pair_ids_ptr + dest, pairs, mask=ok & (dest < slots))
        next_slot += tl.sum(hot_i, axis=0)
    # 3. a tile's expert: the first group whose padded end lies past the tile's start (searchsorted, right)
    ends = tl.where(buckets < n_buckets, padded_end, 2147483647)
    for t0 in range(0, max_tiles, CHUNK):
        tiles = t0 + tl.arange(0, CHUNK)
        group = tl.sum((ends[None, :] <= tiles[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(tile_expert_ptr + tiles, tl.where(group < NUM_EXPERTS, group, -1), mask=tiles < max_tiles)


def group_by_expert(ids: torch.Tensor, num_experts: int, block_m: int, first_expert: int | None = None):
    """`group_by_expert_ref(*local_expert_ids(ids, first_expert, num_experts), block_m)` -- (pair_ids int32
    [max_tiles * block_m], tile_expert int32 [max_tiles], max_tiles) -- for GLOBAL expert ids [T, k] int64:
    one Triton program for up to GROUP_KERNEL_MAX_PAIRS pairs where the kernels run (CUDA, or the CPU under
    TRITON_INTERPRET=1), the torch reference otherwise (the same integers). Without `first_expert` the ids
    must lie in [0, num_experts)."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError("group_by_expert: ids must be a 2-D tensor [tokens, top_k], got "
                         f"{tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__}")
    if ids.dtype != torch.int64:
        raise TypeError(f"group_by_expert: ids must be int64 expert ids, got {ids.dtype}")
    if not (isinstance(num_experts, int) and num_experts >= 1 and isinstance(block_m, int) and block_m >= 1):
        raise ValueError(f"group_by_expert: num_experts and block_m must be positive ints, got {num_experts!r} "
                         f"and {block_m!r}")
    kernel = (ids.is_cuda or (ids.device.type == "cpu" and interpreting())) and ids.numel() <= GROUP_KERNEL_MAX_PAIRS
    if not kernel:
        local, foreign = local_expert_ids(ids, first_expert, num_experts)
        return group_by_expert_ref(local, num_experts, block_m, foreign)
    return _group_by_expert_kernel(ids, num_experts, block_m, first_expert)


def _group_by_expert_kernel(ids: torch.Tensor, num_experts: int, block_m: int, first_expert: int | None):
    """The one-program launch of `group_by_expert` (any pair count; the public function picks the path)."""
    flat = ids.reshape(-1)
    P = flat.numel()
    foreign = first_expert is not None
    max_tiles = max_tiles_for(P, num_experts + int(foreign), block_m)
    pair_ids = torch.empty(max_tiles * block_m, dtype=torch.int32, device=ids.device)
    tile_expert = torch.empty(max_tiles, dtype=torch.int32, device=ids.device)
    if P == 0:
        return pair_ids, tile_expert, max_tiles
    flat = flat.contiguous()
    block_b = next_pow2(num_experts + int(foreign))
    chunk = max(16, _GROUP_TILE_ELEMENTS // block_b)
    _group_kernel[(1,)](flat, pair_ids, tile_expert, P, first_expert or 0, max_tiles, NUM_EXPERTS=num_experts,
                        FOREIGN=foreign, BLOCK_M=block_m, CHUNK=chunk, BLOCK_B=block_b, FILL=1024, num_warps=4)
    return pair_ids, tile_expert, max_tiles
