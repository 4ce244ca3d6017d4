"""BlockManager: allocation, ref-counted prefix caching (hit / miss / eviction), invariant checking."""

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from detinfer.engine.block_manager import ROOT_BLOCK_HASH, BlockManager, hash_block_tokens
from detinfer.engine.sampling_params import SamplingParams
from detinfer.engine.sequence import Sequence


def make_seq(seq_id, tokens, **params):
    return Sequence(seq_id, f"req{seq_id}", list(tokens), SamplingParams(**params), seed=None)


def compute(bm, seq, upto=None):
    """Pretend the runner computed seq's tokens up to `upto` (default: all); commit like the scheduler."""
    seq.num_computed_tokens = seq.num_tokens if upto is None else upto
    bm.commit_computed(seq)


def test_constructor_validation():
    with pytest.raises(ValueError, match="num_blocks must be an int >= 1, got 0"):
        BlockManager(0, 4)
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        BlockManager(4, 0)


def test_allocate_and_free_round_trip():
    bm = BlockManager(10, 4)
    seq = make_seq(0, range(10))
    assert bm.can_allocate(seq)
    assert bm.allocate(seq) == 0
    assert len(seq.block_table) == 3 and seq.num_computed_tokens == 0
    assert bm.num_free_blocks == 7
    bm.check_invariants([seq])
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 10
    bm.check_invariants([])


def test_allocate_twice_or_without_room_is_an_error():
    bm = BlockManager(2, 4)
    seq = make_seq(0, range(5))
    bm.allocate(seq)
    with pytest.raises(RuntimeError, match="already holds blocks"):
        bm.allocate(seq)
    other = make_seq(1, range(100, 105))
    assert not bm.can_allocate(other)
    with pytest.raises(RuntimeError, match="not enough free KV blocks"):
        bm.allocate(other)


def test_prefix_hit_after_the_owner_finished():
    bm = BlockManager(10, 4)
    a = make_seq(0, range(10))
    bm.allocate(a)
    compute(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)
    assert bm.num_cached_free_blocks == 2  # the two full blocks stay cached
    b = make_seq(1, list(range(8)) + [99, 98, 97])
    assert bm.allocate(b) == 8
    assert b.block_table[:2] == a_blocks[:2] and b.num_computed_tokens == 8 == b.num_cached_tokens
    assert bm.prefix_hit_tokens == 8
    bm.check_invariants([b])


def test_prefix_shared_while_the_owner_still_runs():
    bm = BlockManager(10, 4)
    a = make_seq(0, range(9))
    bm.allocate(a)
    compute(bm, a)
    b = make_seq(1, range(9))
    assert bm.allocate(b) == 8
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared and all(bm.ref_count(x) == 2 for x in shared)
    assert b.block_table[2] != a.block_table[2]  # partial last blocks are never shared
    bm.check_invariants([a, b])
    bm.free(a)
    assert all(bm.ref_count(x) == 1 for x in shared)
    bm.check_invariants([b])


def test_fully_cached_prompt_still_computes_its_last_block():
    bm = BlockManager(10, 4)
    a = make_seq(0, range(8))
    bm.allocate(a)
    compute(bm, a)
    b = make_seq(1, range(8))
    # Both blocks are cached, but the last token must be computed for logits: its block is recomputed in a
    # fresh block instead of writing into the shared one.
    assert bm.allocate(b) == 4
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    assert bm.ref_count(b.block_table[1]) == 1 and not bm.is_cached(b.block_table[1])
    bm.check_invariants([a, b])


def test_hash_chain_depends_on_the_whole_prefix():
    bm = BlockManager(10, 4)
    a = make_seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    bm.allocate(a)
    compute(bm, a)
    b = make_seq(1, [9, 9, 9, 9, 5, 6, 7, 8, 0])  # same second block, different first block
    assert bm.allocate(b) == 0
    bm.check_invariants([a, b])


def test_block_hash_is_stable_across_processes():
    here = hash_block_tokens(hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3]), [4, 5, 6]).hex()
    # A fresh interpreter with another str-hash salt (package __init__s stubbed: they load torch, slowly).
    code = ("import importlib.util, sys, types\n"
            "for name in ('detinfer', 'detinfer.engine'):\n"
            "    stub = types.ModuleType(name)\n"
            "    stub.__path__ = list(importlib.util.find_spec(name).submodule_search_locations)\n"
            "    sys.modules[name] = stub\n"
            "from detinfer.engine.block_manager import ROOT_BLOCK_HASH as R, hash_block_tokens as h\n"
            "print(h(h(R, [1, 2, 3]), [4, 5, 6]).hex())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONHASHSEED": "123"})
    assert other.returncode == 0, other.stderr
    assert other.stdout.strip() == here
    assert hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3]) != hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 4])


def test_uncomputed_blocks_are_not_offered():
    bm = BlockManager(10, 4)
    a = make_seq(0, range(10))
    bm.allocate(a)
    b = make_seq(1, range(10))
    assert bm.allocate(b) == 0  # a's K/V are not computed yet
    compute(bm, a, upto=5)  # a chunk covering block 0 and part of block 1
    c = make_seq(2, range(10))
    assert bm.allocate(c) == 4
    bm.check_invariants([a, b, c])


def test_a_colliding_hash_with_other_tokens_is_not_a_hit():
    bm = BlockManager(10, 4)
    a = make_seq(0, [1, 2, 3, 4, 0])
    bm.allocate(a)
    compute(bm, a)
    b = make_seq(1, [5, 6, 7, 8, 0])
    b.block_hashes = list(a.block_hashes)  # simulate a hash collision: same key, different tokens
    assert bm.allocate(b) == 0


def test_concurrently_computed_duplicates_keep_the_first_entry():
    bm = BlockManager(10, 4)
    a, b = make_seq(0, range(6)), make_seq(1, range(6))
    bm.allocate(a)
    bm.allocate(b)
    compute(bm, a)
    compute(bm, b)
    assert bm.is_cached(a.block_table[0]) and not bm.is_cached(b.block_table[0])
    bm.check_invariants([a, b])
    bm.free(a)
    bm.free(b)
    assert bm.num_cached_free_blocks == 1 and bm.num_free_blocks == 10
    bm.check_invariants([])


def test_lru_eviction_prefers_never_cached_blocks_then_least_recently_freed():
    bm = BlockManager(3, 2)
    a = make_seq(0, [1, 2, 3])
    bm.allocate(a)
    compute(bm, a)
    a0 = a.block_table[0]
    bm.free(a)  # a0 cached, a's partial block uncached
    b = make_seq(1, [4, 5, 6])
    bm.allocate(b)  # takes the two uncached free blocks: nothing evicted
    assert a0 not in b.block_table and bm.is_cached(a0)
    compute(bm, b)
    b0 = b.block_table[0]
    bm.free(b)  # free list: a0 (older), b0 cached; b's partial block uncached
    c = make_seq(2, [7, 8, 9])
    bm.allocate(c)  # one uncached block, then evicts the least recently freed cached block: a0
    assert a0 in c.block_table and not bm.is_cached(a0) and bm.is_cached(b0)
    bm.free(c)
    d = make_seq(3, [4, 5, 6])
    assert bm.allocate(d) == 2 and d.block_table[0] == b0  # b's prefix survived
    bm.free(d)
    e = make_seq(4, [1, 2, 3])
    assert bm.allocate(e) == 0  # a's prefix is gone
    bm.check_invariants([e])


def test_a_reused_block_becomes_most_recent():
    bm = BlockManager(4, 2)
    x, y = make_seq(0, [1, 2, 0]), make_seq(1, [3, 4, 0])
    for s in (x, y):
        bm.allocate(s)
        compute(bm, s)
    x0, y0 = x.block_table[0], y.block_table[0]
    bm.free(x)
    bm.free(y)  # LRU order: x0, y0
    x2 = make_seq(2, [1, 2, 0])
    assert bm.allocate(x2) == 2  # revives x0
    bm.free(x2)  # LRU order now: y0, x0
    z = make_seq(3, [5, 6, 7, 8, 9, 10, 11])  # needs all 4 blocks: 2 uncached, then y0, then x0
    bm.allocate(z)
    assert z.block_table[2:] == [y0, x0]
    bm.check_invariants([z])


def test_can_allocate_counts_revived_cached_blocks():
    bm = BlockManager(3, 2)
    a = make_seq(0, [1, 2, 3])
    bm.allocate(a)
    compute(bm, a)
    bm.free(a)
    hog = make_seq(1, [9])
    bm.allocate(hog)  # 2 free blocks left, one of them the cached [1, 2]
    b = make_seq(2, [1, 2, 3])
    assert bm.can_allocate(b)  # revive the cached block + one fresh block
    c = make_seq(3, [1, 2, 3, 4, 5])  # cached block + 2 fresh: one too many
    assert not bm.can_allocate(c)
    assert bm.allocate(b) == 2
    bm.check_invariants([hog, b])


def test_append_slots_at_block_boundaries():
    bm = BlockManager(2, 4)
    seq = make_seq(0, range(4))
    bm.allocate(seq)
    compute(bm, seq)
    seq.append_token(7)
    assert bm.can_append(seq)
    bm.append_slots(seq)
    assert len(seq.block_table) == 2
    bm.append_slots(seq)  # the slot for position 4 already exists: no new block
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 0
    seq.num_computed_tokens = 8
    assert not bm.can_append(seq)
    with pytest.raises(RuntimeError, match="not enough free KV blocks"):
        bm.append_slots(seq)
    bm.check_invariants([seq])


def test_prompt_logprobs_requests_take_nothing_from_the_cache():
    bm = BlockManager(10, 4)
    a = make_seq(0, range(9))
    bm.allocate(a)
    compute(bm, a)
    b = make_seq(1, range(9), prompt_logprobs=2)
    assert bm.allocate(b) == 0
    assert not set(a.block_table) & set(b.block_table)
    bm.check_invariants([a, b])


def test_prefix_caching_off_never_hashes():
    bm = BlockManager(10, 4, enable_prefix_caching=False)
    a = make_seq(0, range(9))
    bm.allocate(a)
    compute(bm, a)
    assert not any(bm.is_cached(x) for x in a.block_table)
    bm.free(a)
    assert bm.allocate(make_seq(1, range(9))) == 0


def test_check_invariants_detects_corruption():
    bm = BlockManager(4, 2)
    seq = make_seq(0, [1, 2, 3])
    bm.allocate(seq)
    with pytest.raises(AssertionError, match="ref count 1 but 0 owners"):
        bm.check_invariants([])  # the owner was not reported
    bm._blocks[seq.block_table[0]].ref_count += 1
    with pytest.raises(AssertionError, match="ref count 2 but 1 owners"):
        bm.check_invariants([seq])
    bm._blocks[seq.block_table[0]].ref_count -= 1
    bm._free_uncached.pop()  # a free block vanishes from the free list
    with pytest.raises(AssertionError, match="leaked"):
        bm.check_invariants([seq])


@given(ops=st.lists(st.tuples(st.sampled_from(["alloc", "compute", "append", "free"]),
                              st.integers(0, 5), st.integers(1, 12)), max_size=60),
       num_blocks=st.integers(1, 8), block_size=st.sampled_from([1, 2, 4]), caching=st.booleans())
def test_random_operation_mixes_keep_the_invariants(ops, num_blocks, block_size, caching):
    bm = BlockManager(num_blocks, block_size, caching)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9, 9, 9, 9, 9]]
    live: dict[int, Sequence] = {}
    for op, slot, size in ops:
        seq = live.get(slot)
        if op == "alloc" and seq is None:
            seq = make_seq(slot, prompts[slot % 2][:size])
            if bm.can_allocate(seq):
                cached = bm.allocate(seq)
                assert cached % block_size == 0 and cached < seq.num_tokens
                live[slot] = seq
        elif op == "compute" and seq is not None:
            compute(bm, seq, upto=min(seq.num_tokens, seq.num_computed_tokens + size))
        elif op == "append" and seq is not None and seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(size)
            if bm.can_append(seq):
                bm.append_slots(seq)
            else:
                bm.free(live.pop(slot))
        elif op == "free" and seq is not None:
            bm.free(live.pop(slot))
        bm.check_invariants(live.values())
    for seq in live.values():
        bm.free(seq)
    bm.check_invariants([])
    assert bm.num_free_blocks == num_blocks
