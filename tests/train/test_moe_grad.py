"""Mixture-of-experts layers are trainable: `MoEFn` (forward = the engine's op, backward = kernels/
moe_backward.py's fixed order) gives float64 autograd's gradients of the same routing, two backward passes
are bitwise identical, and a trainer on a tiny Qwen3-MoE / Mixtral checkpoint scores the sampler's tokens
bit for bit, before and after an optimizer step."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.engine import LLM, SamplingParams
from detinfer.models.testing import write_tiny_checkpoint
from detinfer.ops import Ops
from detinfer.train import TrainableModel
from detinfer.train.adapter import DifferentiableOps


def _layer(E, H, inter, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(E, H, generator=g) / H ** 0.5
    w13 = torch.randn(E, 2 * inter, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, inter, generator=g) / inter ** 0.5
    x = torch.randn(7, H, generator=g)
    return [t.to(dtype) for t in (x, router, w13, w2)]


def _autograd_moe(x, router, w13, w2, ids, renorm):
    """The layer in differentiable torch for given expert ids (the routing choice has no gradient)."""
    probs = torch.softmax(x @ router.T, dim=-1)
    v = probs.gather(1, ids)
    w = v / v.sum(dim=-1, keepdim=True) if renorm else v
    gate, up = torch.einsum("th,tkih->tki", x, w13[ids]).chunk(2, dim=-1)
    y = torch.einsum("tki,tkhi->tkh", F.silu(gate) * up, w2[ids])
    return (w[..., None] * y).sum(dim=1)


def _grads(fn, tensors, dout):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    fn(*leaves).backward(dout)
    return [t.grad for t in leaves]


@settings(max_examples=8)
@given(E=st.integers(2, 6), k=st.integers(1, 3), renorm=st.booleans(), seed=st.integers(0, 1000))
def test_gradients_match_float64_autograd(E, k, renorm, seed):
    k = min(k, E)
    x, router, w13, w2 = _layer(E, 16, 12, seed, torch.float64)
    ops = Ops("deterministic", "cpu", torch.float64)
    _, ids = ops.moe_route(x, router, k, renorm)
    dout = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    diff = DifferentiableOps(ops)
    ours = _grads(lambda *t: diff.moe(*t, k, renorm), (x, router, w13, w2), dout)
    ref = _grads(lambda *t: _autograd_moe(*t, ids, renorm), (x, router, w13, w2), dout)
    for name, a, b in zip(("x", "router", "w_gate_up", "w_down"), ours, ref):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def test_forward_is_the_engine_op_and_backward_is_bitwise_repeatable():
    x, router, w13, w2 = _layer(6, 32, 20, 3, torch.float32)
    ops = Ops("deterministic")
    diff = DifferentiableOps(ops)
    leaves = [t.clone().requires_grad_() for t in (x, router, w13, w2)]
    out = diff.moe(*leaves, 2, True)
    assert torch.equal(out.detach(), ops.moe(x, router, w13, w2, 2, True))
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    first = _grads(lambda *t: diff.moe(*t, 2, True), (x, router, w13, w2), dout)
    second = _grads(lambda *t: diff.moe(*t, 2, True), (x, router, w13, w2), dout)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in first)


def test_fast_mode_trains_through_the_stock_loop():
    x, router, w13, w2 = _layer(4, 16, 12, 5, torch.float32)
    grads = _grads(lambda *t: Ops("fast").moe(*t, 2, True), (x, router, w13, w2), torch.ones(7, 16))
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


MOE = {"qwen3-moe": ("Qwen3MoeForCausalLM", dict(
            hidden_size=64, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
            extra={"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32})),
       "mixtral": ("MixtralForCausalLM", dict(
            hidden_size=64, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
            extra={"num_local_experts": 4, "num_experts_per_tok": 2}))}


@pytest.mark.parametrize("name", list(MOE))
def test_trainer_scores_sampler_tokens_bitwise_before_and_after_a_step(tmp_path, name):
    arch, kw = MOE[name]
    model_dir = write_tiny_checkpoint(tmp_path / name, arch, seed=7, **kw)
    llm = LLM(str(model_dir), device="cpu", mode="deterministic", max_model_len=64, max_num_batched_tokens=16,
              max_num_seqs=2)
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=3, logprobs=0)
    prompts = [[1, 5, 9, 13], [1, 22, 7], [1, 40, 41, 42, 43, 44]]
    trainer = TrainableModel(llm)
    opt = torch.optim.SGD(trainer.parameters(), lr=1e-2)
    for step in range(2):
        outs = llm.generate(prompts, params, use_tqdm=False)
        seqs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
        ids = torch.tensor([t for s in seqs for t in s])
        cu = [0]
        for s in seqs:
            cu.append(cu[-1] + len(s))
        lp = trainer.score(ids, cu)
        for o, a, b in zip(outs, cu[:-1], cu[1:]):
            n = len(o.prompt_token_ids)
            expected = torch.tensor([e.logprob for e in o.outputs[0].logprobs])
            assert torch.equal(lp[a + n - 1:b - 1].detach(), expected), f"step {step}"
        opt.zero_grad()
        (-lp.sum()).backward()
        experts = [p for n_, p in trainer.named_parameters() if "gate_up_proj" in n_ and p.dim() == 3]
        assert experts and all(p.grad is not None and p.grad.abs().sum() > 0 for p in experts)
        opt.step()
        trainer.push_weights()


@pytest.mark.gpu
def test_gpu_bf16_forward_is_the_engine_op_and_backward_is_bitwise_repeatable():
    x, router, w13, w2 = (t.cuda() for t in _layer(8, 256, 128, 4, torch.bfloat16))
    x = torch.cat([x] * 40)  # 280 tokens: every expert gets several slots
    ops = Ops("deterministic", "cuda", torch.bfloat16)
    diff = DifferentiableOps(ops)
    dout = torch.randn(x.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(2)).to(torch.bfloat16)
    first = _grads(lambda *t: diff.moe(*t, 2, True), (x, router, w13, w2), dout)
    second = _grads(lambda *t: diff.moe(*t, 2, True), (x, router, w13, w2), dout)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    ref = _grads(lambda *t: _autograd_moe(*t, ops.moe_route(x, router, 2, True)[1], True),
                 [t.double() for t in (x, router, w13, w2)], dout.double())
    for a, b in zip(first, ref):  # bf16 activations: a loose bound against float64 autograd
        assert (a.double() - b).norm() <= 0.05 * b.norm()
