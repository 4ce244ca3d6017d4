"""Scoring only some positions, the output layer in row chunks (train/logprobs.py), and per-layer
activation checkpointing: each gives the bits of the path it replaces (logprobs and gradients)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.kernels.linear_backward import TOKEN_CHUNK_MULTIPLE, weight_grad_ref
from detinfer.models.loader import load_model
from detinfer.ops import Ops
from detinfer.train import TrainableModel
from detinfer.train.adapter import DifferentiableOps
from detinfer.train.functions import LogprobFn
from detinfer.train.logprobs import LogprobHead, chunked_logprobs


def _unchunked(hidden, weight, targets, rows, base, temperature=1.0):
    """The path chunking replaced: logits of all the rows at once (LinearFn), divided by the temperature
    (autograd's division; none at 1.0, as score() did before temperatures), then LogprobFn."""
    h = hidden if rows is None else hidden.index_select(0, rows)
    logits = DifferentiableOps(base).logits(h, weight)
    if temperature != 1.0:
        logits = logits / temperature
    return LogprobFn.apply(logits, targets, base.log_softmax)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 300), chunk_blocks=st.integers(1, 4), subset=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**31 - 1),
       temperature=st.one_of(st.just(1.0), st.floats(0.05, 4.0)))
def test_chunked_output_layer_equals_unchunked_bitwise(n, chunk_blocks, subset, dtype, seed, temperature):
    """Chunked == unchunked (forward, d hidden, d W_out), with or without a sampling temperature."""
    gen = torch.Generator().manual_seed(seed)
    hid, vocab = 24, 80
    base = Ops("deterministic", "cpu", dtype)
    hidden0 = torch.randn(n, hid, generator=gen).to(dtype)
    weight0 = (torch.randn(vocab, hid, generator=gen) / 4).to(dtype)
    rows = None
    if subset:
        rows = torch.nonzero(torch.rand(n, generator=gen) < 0.6).reshape(-1)
    m = n if rows is None else rows.numel()
    targets = torch.randint(0, vocab, (m,), generator=gen)
    upstream = torch.randn(m, generator=gen)
    results = []
    for chunked in (True, False):
        hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
        if hasattr(weight, "grad_dtype"):
            weight.grad_dtype = torch.float32  # compare dW before any rounding to bf16
        if chunked:
            lp = chunked_logprobs(hidden, weight, targets, rows, LogprobHead(base, 64 * chunk_blocks), temperature)
        else:
            lp = _unchunked(hidden, weight, targets, rows, base, temperature)
        (lp * upstream).sum().backward()
        results.append((lp.detach(), hidden.grad, weight.grad))
    (lp_c, dh_c, dw_c), (lp_u, dh_u, dw_u) = results
    assert torch.equal(lp_c, lp_u)
    assert torch.equal(dh_c, dh_u)
    assert torch.equal(dw_c, dw_u)


@settings(max_examples=25, deadline=None)
@given(blocks=st.lists(st.integers(1, 3), min_size=1, max_size=4), tail=st.integers(0, 63),
       seed=st.integers(0, 2**31 - 1))
def test_weight_grad_continued_over_token_chunks_equals_one_call(blocks, tail, seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = [b * TOKEN_CHUNK_MULTIPLE for b in blocks] + [tail]
    dy = torch.randn(sum(lengths), 7, generator=gen)
    x = torch.randn(sum(lengths), 5, generator=gen)
    dw, start = None, 0
    for length in lengths:
        dw = weight_grad_ref(dy[start:start + length], x[start:start + length], out=dw)
        start += length
    assert torch.equal(dw, weight_grad_ref(dy, x))


def test_chunked_rows_must_be_a_multiple_of_the_token_block():
    base = Ops("deterministic", "cpu", torch.float32)
    for bad in (0, 100, -64, 64.0, True):
        with pytest.raises(ValueError, match="multiple of"):
            LogprobHead(base, bad)
    with pytest.raises(ValueError, match="out must be"):
        weight_grad_ref(torch.zeros(4, 3), torch.zeros(4, 2), out=torch.zeros(2, 3))


def _old_score(trainer, ids, cu, temperature=1.0):
    """score() before chunking: logits of every packed position (divided by the temperature unless 1.0),
    LogprobFn, ends masked to 0."""
    n = ids.shape[0]
    tg = torch.zeros_like(ids)
    tg[:-1] = ids[1:]
    has = torch.ones(n, dtype=torch.bool, device=ids.device)
    ends = [b - 1 for b in cu[1:]]
    has[ends], tg[ends] = False, 0
    _, logits = trainer.forward_runner.run(ids, trainer._positions_of(cu, ids.device),
                                           trainer._attention(cu, ids.device))
    if temperature != 1.0:
        logits = logits / temperature
    lp = LogprobFn.apply(logits, tg, trainer.ops.log_softmax)
    return torch.where(has, lp, torch.zeros_like(lp))


def _grads(trainer, lp, weights):
    """{name: grad} of sum(lp * weights), leaving the trainer's grads cleared."""
    trainer.zero_grad()
    (lp * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in trainer.named_parameters()}
    trainer.zero_grad()
    return grads


def _batch(lengths):
    seqs = [[1] + [(31 * i + 7 * j) % 500 + 2 for j in range(n - 1)] for i, n in enumerate(lengths)]
    return torch.tensor([t for s in seqs for t in s]), [0] + torch.tensor(lengths).cumsum(0).tolist()


@settings(max_examples=6, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       lengths=st.one_of(st.just([70, 3, 72]), st.lists(st.integers(1, 90), min_size=1, max_size=4)),
       chunk_rows=st.sampled_from([64, 128, 512]))
def test_score_gradients_equal_the_unchunked_path_bitwise(stories_dir, dtype, lengths, chunk_rows):
    """The whole model (tied embeddings: the output layer's dW meets the embedding's), every gradient."""
    model, _ = load_model(stories_dir, dtype, "cpu", "deterministic")
    trainer = TrainableModel(model, logprob_chunk_rows=chunk_rows)
    ids, cu = _batch(lengths)  # e.g. 145 rows: three 64-row chunks, the last partial
    weights = torch.linspace(-1, 1, ids.shape[0])
    lp = trainer.score(ids, cu)
    old = _old_score(trainer, ids, cu)
    assert torch.equal(lp.detach(), old.detach())
    new_grads, old_grads = _grads(trainer, lp, weights), _grads(trainer, old, weights)
    assert new_grads.keys() == old_grads.keys() and len(new_grads) > 5
    for name in new_grads:
        assert torch.equal(new_grads[name], old_grads[name]), name


@settings(max_examples=4, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16]), temperature=st.sampled_from([0.6, 1.7]),
       lengths=st.lists(st.integers(1, 70), min_size=1, max_size=3), data=st.data())
def test_tempered_scored_positions_equal_the_unchunked_tempered_path_bitwise(stories_dir, dtype, temperature,
                                                                            lengths, data):
    """score(positions=, temperature=) (the RL update's call) == the unchunked path over the same rows:
    their logits at once (LinearFn), `/ T`, LogprobFn; the logprobs and every gradient. (Against the full
    score only the logprobs match: d W_out sums over other rows there, in other token blocks.)"""
    model, _ = load_model(stories_dir, dtype, "cpu", "deterministic")
    trainer = TrainableModel(model, logprob_chunk_rows=64)
    ids, cu = _batch(lengths)
    ends = {b - 1 for b in cu[1:]}
    picked = data.draw(st.lists(st.booleans(), min_size=len(ids), max_size=len(ids)))
    positions = torch.tensor([i for i, p in enumerate(picked) if p and i not in ends], dtype=torch.int64)
    weights = torch.linspace(-1, 1, positions.numel())
    lp = trainer.score(ids, cu, positions=positions, temperature=temperature)
    with torch.no_grad():
        assert torch.equal(lp.detach(), _old_score(trainer, ids, cu, temperature)[positions])
    hidden = trainer.forward_runner.hidden(ids, trainer._positions_of(cu, ids.device),
                                           trainer._attention(cu, ids.device))
    old = _unchunked(hidden, model.output_weight, ids[positions + 1], positions, trainer.head.base, temperature)
    assert torch.equal(lp.detach(), old.detach())
    new_grads, old_grads = _grads(trainer, lp, weights), _grads(trainer, old, weights)
    for name in new_grads:
        assert torch.equal(new_grads[name], old_grads[name]), name


@settings(max_examples=4, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4), data=st.data())
def test_scored_positions_equal_the_full_score(stories_dir, lengths, data):
    model, _ = load_model(stories_dir, torch.float32, "cpu", "deterministic")
    trainer = TrainableModel(model, logprob_chunk_rows=64)
    ids, cu = _batch(lengths)
    picked = data.draw(st.lists(st.booleans(), min_size=len(ids), max_size=len(ids)))
    positions = [i for i, p in enumerate(picked) if p]
    with torch.no_grad():
        full = trainer.score(ids, cu)
    lp = trainer.score(ids, cu, positions=torch.tensor(positions, dtype=torch.int64))
    assert torch.equal(lp.detach(), full[positions])
    if positions:
        (lp * torch.linspace(-1, 1, len(positions))).sum().backward()
        assert all(torch.isfinite(p.grad).all() for p in trainer.parameters() if p.grad is not None)


def test_positions_are_validated(stories_dir):
    model, _ = load_model(stories_dir, torch.float32, "cpu", "deterministic")
    trainer = TrainableModel(model)
    ids, cu = _batch([5, 4])
    assert trainer.score(ids, cu, positions=[]).shape == (0,)
    for bad in ([3, 2], [0, 0], [9], [-1], [1.0], [True], torch.tensor([[1]]), torch.tensor([0.0])):
        with pytest.raises(ValueError, match="positions"):
            trainer.score(ids, cu, positions=bad)
    with pytest.raises(ValueError, match="mask"):
        trainer.score(ids.reshape(1, -1), mask=torch.ones(1, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="padded"):
        trainer.score(ids, cu, mask=torch.ones(9, dtype=torch.bool))
    with pytest.raises(TypeError, match="activation_checkpointing"):
        TrainableModel(model, activation_checkpointing=1)


def _saved_bytes(fn) -> int:
    """Bytes of the tensors autograd saves for backward while running fn (unique storages)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_checkpointing_gives_the_same_gradients_with_less_saved(stories_dir, dtype):
    model, _ = load_model(stories_dir, dtype, "cpu", "deterministic")
    ids, cu = _batch([40, 30])
    weights = torch.linspace(-1, 1, ids.shape[0])
    results = []
    for checkpointing in (False, True):
        trainer = TrainableModel(model, activation_checkpointing=checkpointing)
        saved, lp = _saved_bytes(lambda: trainer.score(ids, cu))  # noqa: B023 (called at once)
        results.append((saved, lp.detach(), _grads(trainer, lp, weights)))
        trainer.close()
    (saved_off, lp_off, grads_off), (saved_on, lp_on, grads_on) = results
    assert torch.equal(lp_off, lp_on)
    for name in grads_off:
        assert torch.equal(grads_off[name], grads_on[name]), name
    # the weights are saved either way; the activations of the layers' insides only without checkpointing
    assert saved_on < saved_off
    assert not any("forward" in vars(layer) for layer in model.layers)  # the wrappers are removed


def test_fast_mode_chunked_logprobs_match_stock_autograd():
    gen = torch.Generator().manual_seed(0)
    base = Ops("fast", "cpu", torch.float64)
    hidden = torch.randn(150, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 40, (150,), generator=gen)
    lp = chunked_logprobs(hidden, weight, targets, None, LogprobHead(base, 64))
    dh, dw = torch.autograd.grad(lp.sum(), (hidden, weight))
    want = torch.log_softmax((hidden @ weight.t()).float(), -1).gather(1, targets[:, None])[:, 0]
    dh_want, dw_want = torch.autograd.grad(want.sum(), (hidden, weight))
    torch.testing.assert_close(lp, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dh, dh_want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw.to(torch.float64), dw_want, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunked_output_layer_equals_unchunked_on_cuda(dtype):
    """The Triton path: the engine's linear and log_softmax kernels, weight_grad continuing its fp32
    accumulator across chunks (out=)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, hid, vocab = 1100, 256, 3000
    base = Ops("deterministic", "cuda", dtype)
    hidden0 = torch.randn(n, hid, device="cuda", generator=gen).to(dtype)
    weight0 = (torch.randn(vocab, hid, device="cuda", generator=gen) / 16).to(dtype)
    subset = torch.nonzero(torch.rand(n, device="cuda", generator=gen) < 0.5).reshape(-1)
    for rows, temperature in ((None, 1.0), (subset, 1.0), (subset, 0.7)):
        m = n if rows is None else rows.numel()
        targets = torch.randint(0, vocab, (m,), device="cuda", generator=gen)
        upstream = torch.randn(m, device="cuda", generator=gen)
        results = []
        for chunked in (True, False):
            hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
            weight.grad_dtype = torch.float32
            lp = chunked_logprobs(hidden, weight, targets, rows, LogprobHead(base, 128), temperature) \
                if chunked else _unchunked(hidden, weight, targets, rows, base, temperature)
            (lp * upstream).sum().backward()
            results.append((lp.detach(), hidden.grad, weight.grad))
        for got, want in zip(*results):
            assert torch.equal(got, want)


def test_weight_grad_kernel_continued_over_token_chunks_equals_one_call():
    """The Triton dW kernel's `out=` (CUDA; Triton's interpreter on CPU, fp32 there)."""
    from detinfer.kernels.linear_backward import weight_grad

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    t, n, k = (1000, 384, 320) if cuda else (300, 70, 50)
    chunks = ((0, 128), (128, 640), (768, 232)) if cuda else ((0, 64), (64, 128), (192, 108))
    for dtype in (torch.bfloat16, torch.float32) if cuda else (torch.float32,):
        dy = torch.randn(t, n, device=dev, generator=gen).to(dtype)
        x = torch.randn(t, k, device=dev, generator=gen).to(dtype)
        dw = None
        for start, length in chunks:
            dw = weight_grad(dy[start:start + length], x[start:start + length], out=dw)
        assert torch.equal(dw, weight_grad(dy, x))


@pytest.mark.gpu
def test_score_and_checkpointing_on_cuda_equal_the_unchunked_path():
    """bf16, real-shaped layers, 1300 rows (three 512-row chunks): the new score == the unchunked path,
    and activation checkpointing gives the same gradients, keeping less memory between forward and backward."""
    from detinfer.train.testing import pack, random_model

    model, cfg = random_model("smollm2-135m", layers=4, device="cuda", dtype=torch.bfloat16, seed=3)
    gen = torch.Generator().manual_seed(0)
    ids, cu = pack([torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (700, 1, 599)])
    ids = ids.cuda()
    weights = torch.randn(ids.shape[0], generator=gen).cuda()
    trainer = TrainableModel(model)
    old = _grads(trainer, _old_score(trainer, ids, cu), weights)
    results = {}
    for checkpointing in (False, True):
        trainer = TrainableModel(model, activation_checkpointing=checkpointing)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        lp = trainer.score(ids, cu)
        kept = torch.cuda.memory_allocated() - base  # what the graph holds for the backward
        results[checkpointing] = (_grads(trainer, lp, weights), kept)
    for name in old:
        assert torch.equal(results[False][0][name], old[name]), name
        assert torch.equal(results[True][0][name], old[name]), name
    assert results[True][1] < results[False][1]
