"""paged_attention_ref attends every sequence of a step together (padded and masked): the bits must be those of
attending each sequence alone with `attend_ref`, whatever the other sequences' lengths."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.kernels.attention_ref import attend_ref, paged_attention_ref


def _step(kv_lens, q_lens, hq, hkv, d, bs, seed):
    g = torch.Generator().manual_seed(seed)
    blocks_per = [-(-kv // bs) for kv in kv_lens]
    num_blocks = sum(blocks_per) + 3
    perm = torch.randperm(num_blocks, generator=g)  # blocks scattered through the cache
    width = max(blocks_per) + 1
    tables = torch.full((len(kv_lens), width), num_blocks - 1, dtype=torch.int32)
    at = 0
    for s, nb in enumerate(blocks_per):
        tables[s, :nb] = perm[at:at + nb].to(torch.int32)
        at += nb
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d, generator=g)
    return q, k_cache, v_cache, tables, torch.tensor(kv_lens, dtype=torch.int32), cu


def _alone(q, k_cache, v_cache, tables, kv_lens, cu, scale, window):
    out = torch.zeros_like(q)
    bs = k_cache.shape[1]
    for s, kv in enumerate(kv_lens.tolist()):
        q0, q1 = int(cu[s]), int(cu[s + 1])
        if q0 == q1:
            continue
        slots = (tables[s, : -(-kv // bs)].long()[:, None] * bs + torch.arange(bs)).reshape(-1)[:kv]
        k = k_cache.reshape(-1, *k_cache.shape[2:])[slots]
        v = v_cache.reshape(-1, *v_cache.shape[2:])[slots]
        out[q0:q1] = attend_ref(q[q0:q1], k, v, torch.arange(kv - (q1 - q0), kv), scale, window)
    return out


@settings(max_examples=30, deadline=None)
@given(data=st.data(), seqs=st.integers(1, 5), group=st.sampled_from([1, 3]), bs=st.sampled_from([4, 16]),
       window=st.sampled_from([None, 5]), seed=st.integers(0, 2**31))
def test_batched_step_has_the_bits_of_each_sequence_alone(data, seqs, group, bs, window, seed):
    kv_lens = [data.draw(st.integers(1, 70)) for _ in range(seqs)]
    q_lens = [data.draw(st.integers(0, kv)) for kv in kv_lens]
    q, kc, vc, tables, kvl, cu = _step(kv_lens, q_lens, 2 * group, 2, 8, bs, seed)
    got = paged_attention_ref(q, kc, vc, tables, kvl, cu, 0.3, sliding_window=window)
    assert torch.equal(got, _alone(q, kc, vc, tables, kvl, cu, 0.3, window))


def test_a_sequence_gives_the_same_bits_next_to_a_longer_one():
    q, kc, vc, tables, kvl, cu = _step([9, 300], [1, 1], 6, 2, 16, 16, 1)
    both = paged_attention_ref(q, kc, vc, tables, kvl, cu, 0.25)
    alone = paged_attention_ref(q[:1], kc, vc, tables[:1], kvl[:1], cu[:2], 0.25)
    assert torch.equal(both[:1], alone)
