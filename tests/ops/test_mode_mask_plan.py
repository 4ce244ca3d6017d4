"""The drop-in mode's SDPA computes what it derives from a mask (key order, fill, dead rows) once per mask
and reuses it in every layer: a reused plan gives the bits a fresh one gives, and a mask written in place
(or a different mask) never meets a stale plan."""

import pytest
import torch

from detinfer.ops.aten_impls import AtenImpls, _sdpa


def left_padded(b=3, h=2, lq=5, d=16, pads=(0, 2, 4), seed=0, float_mask=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, lq, d, generator=g) for _ in range(3))
    allowed = torch.ones(lq, lq, dtype=torch.bool).tril().expand(b, 1, lq, lq).clone()
    for i, p in enumerate(pads):
        allowed[i, :, :, :p] = False
    mask = allowed
    if float_mask:
        mask = torch.zeros(b, 1, lq, lq).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return q, k, v, mask


@pytest.mark.parametrize("float_mask", [False, True])
def test_plan_is_reused_across_layers_with_the_same_bits(float_mask):
    q, k, v, mask = left_padded(float_mask=float_mask)
    impls = AtenImpls()
    first = _sdpa(impls, q, k, v, mask, 0.0, False, None)
    assert len(impls.mask_plans) == 1
    for layer in range(3):  # every layer of a forward pass: other q/k/v, the same mask
        ql, kl, vl = q + layer, k - layer, v * (layer + 1)
        assert torch.equal(_sdpa(impls, ql, kl, vl, mask, 0.0, False, None),
                           _sdpa(AtenImpls(), ql, kl, vl, mask.clone(), 0.0, False, None))
    assert len(impls.mask_plans) == 1
    assert torch.equal(first, _sdpa(AtenImpls(), q, k, v, mask.clone(), 0.0, False, None))


def test_a_mask_written_in_place_gets_a_new_plan():
    q, k, v, mask = left_padded()
    impls = AtenImpls()
    before = _sdpa(impls, q, k, v, mask, 0.0, False, None)
    mask[0, :, :, :3] = False  # row 0 now left-padded by 3: its keys must be re-anchored
    after = _sdpa(impls, q, k, v, mask, 0.0, False, None)
    assert torch.equal(after, _sdpa(AtenImpls(), q, k, v, mask.clone(), 0.0, False, None))
    assert not torch.equal(after[0], before[0])
    assert len(impls.mask_plans) == 2


def test_causal_without_mask_and_inference_tensors():
    q, k, v, _ = left_padded()
    impls = AtenImpls()
    want = _sdpa(AtenImpls(), q, k, v, None, 0.0, True, None)
    assert torch.equal(_sdpa(impls, q, k, v, None, 0.0, True, None), want)
    assert torch.equal(_sdpa(impls, q, k, v, None, 0.0, True, None), want)
    assert len(impls.mask_plans) == 1
    with torch.inference_mode():  # no version counter: computed per call, never cached
        q2, k2, v2, mask2 = left_padded(seed=1)
        got = _sdpa(impls, q2, k2, v2, mask2, 0.0, False, None)
    assert len(impls.mask_plans) == 1
    assert torch.equal(got, _sdpa(AtenImpls(), q2, k2, v2, mask2.clone(), 0.0, False, None))


def test_plans_are_bounded():
    impls = AtenImpls()
    for seed in range(12):
        q, k, v, mask = left_padded(seed=seed)
        _sdpa(impls, q, k, v, mask, 0.0, False, None)
    assert 1 <= len(impls.mask_plans) <= 8
