"""Mixture-of-experts layers are inference-only: the trainer's ops refuse a gradient through them with a
clear error, and without autograd they compute exactly the engine's op."""

import pytest
import torch

from detinfer.ops import Ops
from detinfer.train.adapter import DifferentiableOps


def test_moe_refuses_gradients_and_forwards_the_engine_op_without_them():
    g = torch.Generator().manual_seed(0)
    x, router = torch.randn(5, 16, generator=g), torch.randn(4, 16, generator=g)
    w13, w2 = torch.randn(4, 24, 16, generator=g), torch.randn(4, 16, 12, generator=g)
    ops = DifferentiableOps(Ops("deterministic"))
    with pytest.raises(NotImplementedError, match="mixture-of-experts"):
        ops.moe(x.requires_grad_(), router, w13, w2, 2, True)
    with torch.no_grad():
        assert torch.equal(ops.moe(x, router, w13, w2, 2, True), Ops("deterministic").moe(x, router, w13, w2, 2, True))
