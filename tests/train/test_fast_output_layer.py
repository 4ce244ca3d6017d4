"""The unchunked output layer (logprob_chunk_rows=None: no recompute; fast mode: plain autograd, the stock
baseline; deterministic: the chunked bits) and fast mode's chunked fp32 dW accumulation
(Ops.linear_backward, one GEMM per chunk on CUDA)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

from detinfer.ops import Ops
from detinfer.train import TrainableModel
from detinfer.train.logprobs import LogprobHead, chunked_logprobs
from detinfer.train.testing import random_model


def _f64_logprobs(hidden, weight, targets, rows, temperature):
    h = hidden if rows is None else hidden.index_select(0, rows)
    logits = (h.double() @ weight.double().t()) / temperature
    return torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 200), subset=st.booleans(), seed=st.integers(0, 2**31 - 1),
       temperature=st.one_of(st.just(1.0), st.floats(0.1, 4.0)))
def test_stock_head_matches_float64_and_uses_torch_autograd(n, subset, seed, temperature):
    """chunk_rows=None: values and gradients of a float64 reference; the graph is torch's own nodes (no
    ChunkedLogprobFn), so its backward recomputes nothing."""
    gen = torch.Generator().manual_seed(seed)
    hid, vocab = 24, 80
    hidden = torch.randn(n, hid, generator=gen).requires_grad_()
    weight = (torch.randn(vocab, hid, generator=gen) / 4).requires_grad_()
    rows = torch.nonzero(torch.rand(n, generator=gen) < 0.6).reshape(-1) if subset else None
    m = n if rows is None else rows.numel()
    targets = torch.randint(0, vocab, (m,), generator=gen)
    upstream = torch.randn(m, generator=gen)
    lp = chunked_logprobs(hidden, weight, targets, rows, LogprobHead(Ops("fast", "cpu"), None), temperature)
    if m:
        assert "ChunkedLogprob" not in type(lp.grad_fn).__name__
    (lp * upstream).sum().backward()
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref = _f64_logprobs(h64, w64, targets, rows, temperature)
    (ref * upstream.double()).sum().backward()
    torch.testing.assert_close(lp.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    for got, want in ((hidden.grad, h64.grad), (weight.grad, w64.grad)):
        if got is None:  # no rows scored: nothing reached this tensor
            assert want is None or not want.any()
        else:
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_deterministic_unchunked_head_gives_the_chunked_bits_and_recomputes_nothing():
    """logprob_chunk_rows=None in deterministic mode: the [M, V] logits kept for backward instead of a
    recompute per chunk, with the chunked head's logprobs and gradients bit for bit."""
    model, cfg = _tiny()
    ids = torch.randint(0, cfg.vocab_size, (150,), generator=torch.Generator().manual_seed(1))
    cu = [0, 64, 150]
    grads, logprobs, recomputes = {}, {}, {}
    for rows in (None, 64):
        trainer = TrainableModel(model, logprob_chunk_rows=rows)
        logprobs[rows] = trainer.score(ids, cu).detach()
        events = _backward_ops(trainer, ids, cu)
        recomputes[rows] = sum(e.name == "ChunkedLogprobFnBackward" for e in events)
        grads[rows] = [p.grad.clone() for p in trainer.parameters()]
    assert recomputes[None] == 0 and recomputes[64] == 1
    assert torch.equal(logprobs[None], logprobs[64])
    assert all(torch.equal(a, b) for a, b in zip(grads[None], grads[64]))
    with pytest.raises(ValueError, match="positive multiple"):
        LogprobHead(Ops("deterministic", "cpu"), 100)


def _tiny():
    from detinfer.train import testing

    testing.SHAPES.setdefault("fast-head-test", dict(
        testing.SHAPES["qwen3-8b"], vocab_size=512, hidden_size=32, intermediate_size=48, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, eos_token_id=2))
    return random_model("fast-head-test", layers=1, dtype=torch.float32, seed=0)


def _backward_ops(trainer, ids, cu):
    trainer.zero_grad()
    loss = trainer.score(ids, cu).sum()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        loss.backward()
    return prof.events()


def test_fast_stock_head_backward_recomputes_nothing():
    """The bench's fast arm: its backward runs no log_softmax forward and no [rows, V] logits GEMM (the
    chunked head recomputes both), and gives the chunked head's gradients."""
    model, cfg = _tiny()
    ids = torch.randint(0, cfg.vocab_size, (150,), generator=torch.Generator().manual_seed(0))
    cu = [0, 64, 150]
    grads, recomputes = {}, {}
    for rows in (None, 64):
        trainer = TrainableModel(model, mode="fast", logprob_chunk_rows=rows)
        events = _backward_ops(trainer, ids, cu)
        recomputes[rows] = sum(e.name == "aten::_log_softmax" for e in events)
        grads[rows] = [p.grad.clone() for p in trainer.parameters()]
    assert recomputes[None] == 0
    assert recomputes[64] == 3  # the chunked head's recompute, one per 64-row chunk: the probe sees it
    for a, b in zip(grads[None], grads[64]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def _weight_grad_case(dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dys = [torch.randn(64, 96, generator=gen).to(device=device, dtype=dtype) for _ in range(3)]
    xs = [torch.randn(64, 40, generator=gen).to(device=device, dtype=dtype) for _ in range(3)]
    weight = torch.randn(96, 40, generator=gen).to(device=device, dtype=dtype)
    ref = sum(dy.double().t() @ x.double() for dy, x in zip(dys, xs))
    return dys, xs, weight, ref


def _fast_chunked_weight_grad(ops, dys, xs, weight):
    dw = None
    for dy, x in zip(dys, xs):
        _, dw = ops.linear_backward(dy, x, weight, dw_out=dw)
    return dw


def test_fast_linear_backward_accumulates_fp32():
    dys, xs, weight, ref = _weight_grad_case(torch.float32, "cpu")
    dw = _fast_chunked_weight_grad(Ops("fast", "cpu"), dys, xs, weight)
    assert dw.dtype == torch.float32
    torch.testing.assert_close(dw.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fast_linear_backward_one_gemm_per_chunk(dtype):
    """16-bit CUDA: each chunk's dW is one fp32-output GEMM adding the accumulator (no 16-bit dW, no cast,
    no separate add of a weight-sized tensor), and the sum is accurate (fp32 accumulation, never rounded
    to 16 bits between chunks)."""
    dys, xs, weight, ref = _weight_grad_case(dtype, "cuda")
    ops = Ops("fast", "cuda", dtype)
    _fast_chunked_weight_grad(ops, dys, xs, weight)  # warm-up
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        dw = _fast_chunked_weight_grad(ops, dys, xs, weight)
    torch.cuda.synchronize()
    weight_sized = [e.name for e in prof.events() if e.name in ("aten::copy_", "aten::add_", "aten::_to_copy")
                    and any(list(s) == [96, 40] for s in e.input_shapes)]
    assert weight_sized == []
    assert dw.dtype == torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(dw.double(), ref, rtol=tol, atol=tol)
