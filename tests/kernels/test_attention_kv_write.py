"""write_kv (detinfer.kernels.kv_write): the step's new K/V land in exactly their slots, nothing else moves.

A pure copy, so the check is bitwise against the pure-torch write_kv_ref on NaN-poisoned pools: every slot
not named in slot_mapping (and every row with slot < 0) must stay NaN.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.kernels.kv_write import write_kv, write_kv_ref

HAS_CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if HAS_CUDA else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])


def pools(num_blocks, block_size, hkv, d, dtype):
    k = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype, device=DEV)
    return k, torch.full_like(k, float("nan"))


@settings(max_examples=max(5, settings.default.max_examples))
@given(data=st.data(), dtype=st.sampled_from(DTYPES), hkv=st.sampled_from([1, 2, 3, 8]),
       d=st.sampled_from([64, 80, 128]), block_size=st.sampled_from([1, 8, 16, 32]))
def test_write_kv_matches_reference_and_touches_nothing_else(data, dtype, hkv, d, block_size):
    num_blocks = data.draw(st.integers(1, 12), label="num_blocks")
    n_slots = num_blocks * block_size
    t = data.draw(st.integers(0, min(n_slots, 70)), label="tokens")
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
    slots = torch.randperm(n_slots, generator=g)[:t]
    skip = torch.rand(t, generator=g) < 0.2  # padded rows of a captured batch
    slots[skip] = -1
    # k/v as strided views into a fused projection output [T, (2 + extra) * Hkv, D].
    fused = torch.randn((t, 3 * hkv, d), generator=g).to(dtype).to(DEV)
    k, v = fused[:, :hkv], fused[:, hkv: 2 * hkv]
    kc, vc = pools(num_blocks, block_size, hkv, d, dtype)
    kr, vr = pools(num_blocks, block_size, hkv, d, dtype)
    write_kv(k, v, kc, vc, slots.to(DEV).to(data.draw(st.sampled_from([torch.int32, torch.int64]))))
    write_kv_ref(k, v, kr, vr, slots.to(DEV))
    for got, want in ((kc, kr), (vc, vr)):
        assert torch.equal(got.isnan(), want.isnan()), "a slot outside slot_mapping was written (or one missed)"
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert int((~kc[..., 0].isnan()).sum()) == int((slots >= 0).sum()) * hkv


def test_write_kv_rejects_bad_input():
    kc, vc = pools(4, 16, 2, 64, torch.float32)
    k = torch.randn(3, 2, 64, device=DEV)
    ok = torch.tensor([0, 5, -1], device=DEV)
    with pytest.raises(ValueError, match="slots"):
        write_kv(k, k, kc, vc, torch.tensor([0, 64, 1], device=DEV))  # past the pool
    with pytest.raises(ValueError, match="twice"):
        write_kv(k, k, kc, vc, torch.tensor([3, 3, 1], device=DEV))
    with pytest.raises(ValueError, match="do not match"):
        write_kv(torch.randn(3, 4, 64, device=DEV), torch.randn(3, 4, 64, device=DEV), kc, vc, ok)
    with pytest.raises(TypeError, match="one dtype"):
        write_kv(k.half(), k.half(), kc, vc, ok)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(k, k, kc, vc, ok[:2])
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(k, k, kc, vc, ok.float())
    with pytest.raises(ValueError, match="k_cache and v_cache"):
        write_kv(k, k, kc, vc[:2], ok)
    # An out-of-pool slot with validation off is skipped, never written out of bounds.
    write_kv(k, k, kc, vc, torch.tensor([0, 64, -5], device=DEV), validate=False)
    assert int((~kc[..., 0].isnan()).sum()) == 2  # slot 0, both heads
