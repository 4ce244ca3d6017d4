"""The trainer's fused attention prologue (`DifferentiableOps.qk_norm_rope`): forward bits are the backend's,
and its gradients equal, bitwise, those of the unfused chain it replaced (per-head RMSNormFn, then RotaryFn)."""

import pytest
import torch

from detinfer.ops import Ops
from detinfer.train.adapter import DifferentiableOps


def leaves(t, hq, hkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 2).to(dtype).requires_grad_()
    wq = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype).requires_grad_()
    wk = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype).requires_grad_()
    pos = torch.randint(0, 5000, (t,), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    return qkv, wq, wk, pos, inv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
def test_fused_prologue_grads_equal_the_unfused_chain(dtype, norm):
    t, hq, hkv, d = 7, 4, 2, 16
    ops = DifferentiableOps(Ops("deterministic", "cpu", dtype, head_dim=d))
    results = []
    for fused in (True, False):
        qkv, wq, wk, pos, inv = leaves(t, hq, hkv, d, dtype, seed=3)
        q = qkv[:, :hq * d].view(t, hq, d)
        k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
        w = (wq, wk) if norm else (None, None)
        if fused:
            rq, rk = ops.qk_norm_rope(pos, q, k, inv, *w, 1e-6)
        else:
            if norm:
                q, k = ops.rms_norm(q, wq, 1e-6), ops.rms_norm(k, wk, 1e-6)
            rq, rk = ops.rope(pos, q, k, inv)
        g = torch.Generator().manual_seed(9)
        loss = (rq.float() * torch.randn(rq.shape, generator=g)).sum() + \
            (rk.float() * torch.randn(rk.shape, generator=g)).sum()
        loss.backward()
        results.append((rq.detach(), rk.detach(), qkv.grad, wq.grad, wk.grad))
    for a, b in zip(*results):
        assert (a is None and b is None) or torch.equal(a, b)
    assert results[0][2] is not None and (not norm or results[0][3] is not None)
