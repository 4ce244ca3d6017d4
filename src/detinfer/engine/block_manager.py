"""Paged KV block manager with ref-counted prefix caching (pure Python, no torch).

The KV cache is a fixed pool of `num_blocks` blocks of `block_size` token slots. A sequence's
`block_table[i]` is the physical block holding its positions [i * block_size, (i + 1) * block_size).

Prefix caching: once a FULL block's K/V are computed, the block is registered under a hash chaining the
block's token ids with the previous block's hash (SHA-256, so the key is the same in every process and
never collides in practice; the tokens are compared too). A later sequence whose leading blocks have the
same hashes shares those physical blocks (ref count + 1) and skips computing them. This is exact for
detinfer: the cached K/V were computed by the same batch-invariant kernels from the same tokens at the
same positions, so they have the bits a recomputation would produce.

Blocks whose ref count drops to 0 are free. Free blocks that still carry a hash stay in the cache and can
be hit again; they are evicted least-recently-freed first, and only when no never-cached free block is
left. A sequence frees its blocks last-to-first, so a prompt's tail is evicted before its head (heads are
the blocks other prompts are likely to share).

A sequence only ever writes K/V into blocks it alone owns that carry no hash (see `allocate`): shared and
cached blocks are read-only, so cache hits can never be corrupted by a writer.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass

from detinfer.engine.sequence import PENDING_TOKEN, Sequence

# Parent "hash" of a sequence's first block; versioned so a change of hashing scheme never aliases.
ROOT_BLOCK_HASH = hashlib.sha256(b"detinfer/kv-prefix-cache/v1").digest()


def hash_block_tokens(parent_hash: bytes, token_ids: Iterable[int]) -> bytes:
    """Hash of one full block: SHA-256 of its parent's hash and its token ids as little-endian int64."""
    ids = list(token_ids)
    return hashlib.sha256(parent_hash + struct.pack(f"<{len(ids)}q", *ids)).digest()


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set while the block is registered in the prefix cache
    token_ids: tuple[int, ...] = ()  # the registered content, compared on lookup


class BlockManager:
    """Allocates KV blocks to sequences; see the module docstring for the caching rules."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free_uncached: deque[int] = deque(range(num_blocks))  # free, no hash: used first
        self._free_cached: OrderedDict[int, None] = OrderedDict()   # free, hashed: LRU order, oldest first
        self._hash_to_block: dict[bytes, int] = {}
        # Counters for metrics: prompt tokens looked up in the cache / found there.
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    # -- queries -------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation may take (cached free blocks count: they are evicted on demand)."""
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._free_cached)

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def is_cached(self, block_id: int) -> bool:
        """Whether the block is registered in the prefix cache (and so must never be written)."""
        return self._blocks[block_id].block_hash is not None

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix lookup -------------------------------------------------------------------------------
    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        """Hashes of the first `num_full_blocks` blocks of seq (memoised on the sequence)."""
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else ROOT_BLOCK_HASH
            hashes.append(hash_block_tokens(parent, seq.token_ids[i * bs:(i + 1) * bs]))
        return hashes

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Physical blocks holding seq's longest cached prefix of full blocks.

        Only blocks within the first num_tokens - 1 tokens count: the last token must be computed to get
        the logits that sample the next token, and it is recomputed in a fresh block (with the rest of its
        block) rather than written into a shared one.
        """
        if not self.enable_prefix_caching or seq.prompt_logprobs_pending:
            return []
        bs = self.block_size
        hits: list[int] = []
        # Pending tokens (ids still on the device) are never hashed; a waiting sequence has none by the
        # time it is admitted, so this bound only matters as a guard.
        for i, h in enumerate(self._block_hashes(seq, min(seq.num_tokens - 1, seq.num_known_tokens) // bs)):
            block_id = self._hash_to_block.get(h)
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            if block_id is None or self._blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        """Leading tokens of a waiting seq that `allocate` would take from the prefix cache right now."""
        return len(self._cached_prefix(seq)) * self.block_size

    # -- allocation ----------------------------------------------------------------------------------
    def _blocks_to_take(self, seq: Sequence, hits: list[int]) -> int:
        """Free blocks an allocation would consume: fresh blocks plus cache hits that are now free."""
        fresh = self.blocks_for_tokens(seq.num_tokens) - len(hits)
        revived = sum(1 for b in hits if self._blocks[b].ref_count == 0)
        return fresh + revived

    def can_allocate(self, seq: Sequence) -> bool:
        return self._blocks_to_take(seq, self._cached_prefix(seq)) <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> int:
        """Give a waiting sequence blocks for all its tokens; returns how many leading tokens are cached.

        The sequence's `num_computed_tokens` is set to that number: the runner computes the rest.
        """
        if seq.block_table:
            raise RuntimeError(f"allocate: sequence {seq.seq_id} already holds blocks {seq.block_table}")
        hits = self._cached_prefix(seq)
        if self._blocks_to_take(seq, hits) > self.num_free_blocks:
            raise RuntimeError(f"allocate: not enough free KV blocks for sequence {seq.seq_id}; "
                               "call can_allocate first")
        for block_id in hits:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._free_cached[block_id]
            block.ref_count += 1
        fresh = [self._take_fresh_block() for _ in range(self.blocks_for_tokens(seq.num_tokens) - len(hits))]
        seq.block_table = hits + fresh
        seq.num_hashed_blocks = len(hits)
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        if self.enable_prefix_caching and not seq.prompt_logprobs_pending:
            self.prefix_query_tokens += seq.num_tokens
            self.prefix_hit_tokens += seq.num_cached_tokens
        return seq.num_cached_tokens

    def _take_fresh_block(self) -> int:
        if self._free_uncached:
            block_id = self._free_uncached.popleft()
        elif self._free_cached:
            block_id, _ = self._free_cached.popitem(last=False)  # evict the least recently freed
            self._uncache(block_id)
        else:
            raise RuntimeError("out of KV blocks")
        self._blocks[block_id].ref_count = 1
        return block_id

    def _new_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        needed = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        """Whether slots for the next `num_new_tokens` positions (after the computed ones) can be had."""
        return self._new_blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int = 1) -> None:
        """Extend seq's block table to cover positions up to num_computed_tokens + num_new_tokens."""
        needed = self._new_blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"append_slots: not enough free KV blocks for sequence {seq.seq_id}; "
                               "call can_append first")
        seq.block_table.extend(self._take_fresh_block() for _ in range(needed))

    def commit_computed(self, seq: Sequence) -> None:
        """Register seq's newly computed full blocks in the prefix cache (call after each step).

        If another block already holds the same content (two sequences computed it at once), that one
        stays the cache entry and this block stays private.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        # Only blocks whose every token id is known: a pending token's K/V may be computed already (a
        # decode fed it on the device) but its id, which the hash needs, is not on the host yet.
        num_full = min(min(seq.num_computed_tokens, seq.num_known_tokens) // bs, len(seq.block_table))
        hashes = self._block_hashes(seq, num_full)
        for i in range(seq.num_hashed_blocks, num_full):
            if hashes[i] not in self._hash_to_block:
                block = self._blocks[seq.block_table[i]]
                block.block_hash = hashes[i]
                block.token_ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
                self._hash_to_block[hashes[i]] = block.block_id
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, num_full)

    def free(self, seq: Sequence) -> None:
        """Release all of seq's blocks (finish, abort or preemption); its KV state is reset."""
        for block_id in reversed(seq.block_table):
            block = self._blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"free: block {block_id} of sequence {seq.seq_id} has ref count "
                                   f"{block.ref_count}")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is not None:
                    self._free_cached[block_id] = None
                else:
                    self._free_uncached.append(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block (e.g. after the model's weights changed, which makes their K/V
        stale). Only free cached blocks are dropped: they become plain free blocks. Blocks still owned by
        a sequence keep their hash, so call this when no sequence runs (the engine checks that). Returns
        how many blocks were dropped."""
        dropped = list(self._free_cached)
        for block_id in dropped:
            self._uncache(block_id)
            self._free_uncached.append(block_id)
        self._free_cached.clear()
        return len(dropped)

    def _uncache(self, block_id: int) -> None:
        block = self._blocks[block_id]
        del self._hash_to_block[block.block_hash]
        block.block_hash, block.token_ids = None, ()

    # -- invariants ----------------------------------------------------------------------------------
    def check_invariants(self, owners: Iterable[Sequence]) -> None:
        """Raise AssertionError unless the pool is consistent with `owners` (every sequence holding blocks).

        Checks: ref counts equal the number of owners; no block both free and owned, or free twice; every
        block owned or free (no leak); the hash map and the blocks' hashes agree; owners' tables cover
        their computed tokens.
        """
        def fail(msg: str):
            raise AssertionError(f"block manager invariant violated: {msg}")

        owners = list(owners)
        counts: Counter[int] = Counter()
        for seq in owners:
            if len(set(seq.block_table)) != len(seq.block_table):
                fail(f"sequence {seq.seq_id} lists a block twice: {seq.block_table}")
            counts.update(seq.block_table)
            if seq.num_computed_tokens > len(seq.block_table) * self.block_size:
                fail(f"sequence {seq.seq_id} computed {seq.num_computed_tokens} tokens in "
                     f"{len(seq.block_table)} blocks")
            if seq.num_hashed_blocks > len(seq.block_table):
                fail(f"sequence {seq.seq_id} hashed {seq.num_hashed_blocks} of {len(seq.block_table)} blocks")
        free_uncached, free_cached = set(self._free_uncached), set(self._free_cached)
        if len(free_uncached) != len(self._free_uncached):
            fail("a block is in the uncached free list twice")
        if free_uncached & free_cached:
            fail(f"blocks in both free lists: {sorted(free_uncached & free_cached)}")
        for block in self._blocks:
            b = block.block_id
            if block.ref_count != counts.get(b, 0):
                fail(f"block {b} has ref count {block.ref_count} but {counts.get(b, 0)} owners")
            is_free = b in free_uncached or b in free_cached
            if block.ref_count > 0 and is_free:
                fail(f"block {b} is owned (ref {block.ref_count}) and free")
            if block.ref_count == 0 and not is_free:
                fail(f"block {b} is neither owned nor free (leaked)")
            if b in free_cached and block.block_hash is None:
                fail(f"block {b} is in the cached free list without a hash")
            if b in free_uncached and block.block_hash is not None:
                fail(f"block {b} is in the uncached free list with a hash")
            if block.block_hash is not None:
                if not self.enable_prefix_caching:
                    fail(f"block {b} has a hash with prefix caching off")
                if self._hash_to_block.get(block.block_hash) != b:
                    fail(f"block {b}'s hash is not mapped to it")
                if len(block.token_ids) != self.block_size:
                    fail(f"cached block {b} records {len(block.token_ids)} tokens")
                if PENDING_TOKEN in block.token_ids:
                    fail(f"cached block {b} was registered with a pending token id: {block.token_ids}")
        for h, b in self._hash_to_block.items():
            if self._blocks[b].block_hash != h:
                fail(f"hash map entry points at block {b}, which carries another hash")
