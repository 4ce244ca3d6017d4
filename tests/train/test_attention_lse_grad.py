"""The trainer's attention backward reads the row log-sum-exps its forward stored (paged_attention's
lse_out) instead of recomputing them: whole-model gradients equal the recompute path's within rounding
(not bitwise: the two LSEs differ in their last bits); two runs, and a run with activation checkpointing,
give one set of bits. CPU: fp32 tiny
checkpoints with head_dim 64, so the engine's attention kernel and the Triton backward run in Triton's
interpreter."""

import pytest
import torch

import detinfer.train.functions as functions
from detinfer.models.loader import load_model
from detinfer.train import TrainableModel
from detinfer.train.adapter import PackedPagedAttention


def _grads(trainer, ids, cu):
    for p in trainer.parameters():
        p.grad = None
    w = torch.linspace(-1, 1, ids.shape[0])
    (trainer.score(ids, cu) * w).sum().backward()
    return {n: p.grad.clone() for n, p in trainer.named_parameters()}


@pytest.mark.parametrize("name", ["llama-bias-tied", "qwen3-mqa"])
def test_gradients_with_the_forward_lse_match_the_recompute_and_repeat(model_dirs, name, monkeypatch):
    model, _ = load_model(model_dirs[name], torch.float32, "cpu", "deterministic")
    trainer = TrainableModel(model)
    ids = torch.tensor([1, 5, 9, 33, 100, 7, 8, 1, 44, 55, 1, 12, 300, 301, 302, 303] + list(range(2, 72)))
    cu = [0, 7, 10, 16, ids.shape[0]]
    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs.get("lse"))
        return real(*args, **kwargs)
    real = functions.attention_backward
    monkeypatch.setattr(functions, "attention_backward", spy)
    with_lse = _grads(trainer, ids, cu)
    assert seen and all(lse is not None and lse.shape == (ids.shape[0], model.config.num_attention_heads)
                        for lse in seen)  # every layer's backward got its forward's LSE
    assert all(torch.equal(a, b) for a, b in zip(with_lse.values(), _grads(trainer, ids, cu).values()))
    # activation checkpointing recomputes the forward (and its LSE) in backward: the same bits
    checkpointed = _grads(TrainableModel(model, activation_checkpointing=True), ids, cu)
    assert all(torch.equal(a, b) for a, b in zip(with_lse.values(), checkpointed.values(), strict=True))

    seen.clear()
    monkeypatch.setattr(PackedPagedAttention, "reuse_forward_lse", False)
    recomputed = _grads(TrainableModel(model), ids, cu)
    assert seen and all(lse is None for lse in seen)
    for n, g in recomputed.items():
        scale = g.abs().max().item()
        assert scale > 0, n
        assert (with_lse[n] - g).abs().max().item() <= 1e-5 * scale, n
