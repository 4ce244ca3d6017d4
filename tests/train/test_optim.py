"""The RL loop's AdamW (train/optim.py): the low-temporary implementation per device, deterministic."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.models.loader import load_model
from detinfer.train import TrainableModel
from detinfer.train.optim import adamw, state_bytes_per_param


def _run(stories_dir, steps=3):
    model, _ = load_model(stories_dir, torch.bfloat16, "cpu", "deterministic")
    trainer = TrainableModel(model)  # fp32 masters
    opt = adamw(trainer.parameters(), lr=0.01, weight_decay=0.1)
    ids = torch.tensor([1, 5, 9, 33, 100, 7, 8, 1, 44, 55, 66])
    cu = [0, 7, 11]
    for _ in range(steps):
        trainer.zero_grad()
        (-trainer.score(ids, cu).sum()).backward()
        opt.step()
        trainer.push_weights()
    return opt, [p.detach().clone() for p in trainer.parameters()], \
        [t.clone() for s in opt.state.values() for t in s.values()]


def test_adamw_on_cpu_is_single_tensor_and_two_runs_are_bitwise_equal(stories_dir):
    opt, weights, state = _run(stories_dir)
    group = opt.param_groups[0]
    assert group["foreach"] is False and not group["fused"]
    _, weights2, state2 = _run(stories_dir)
    assert len(state) == 3 * len(weights) and len(weights) > 5  # step, exp_avg, exp_avg_sq per parameter
    assert all(torch.equal(a, b) for a, b in zip(weights, weights2))
    assert all(torch.equal(a, b) for a, b in zip(state, state2))


def test_adamw_rejects_an_empty_parameter_list_and_keeps_explicit_choices():
    with pytest.raises(ValueError, match="no parameters"):
        adamw([], lr=1e-3)
    with pytest.raises(ValueError, match="no parameters"):
        adamw([{"params": []}, {"params": [], "weight_decay": 0.0}], lr=1e-3)
    p = torch.nn.Parameter(torch.zeros(3))
    assert adamw([p], lr=1e-3, foreach=True).param_groups[0]["foreach"] is True


def test_adamw_takes_param_groups_each_with_the_same_implementation():
    a, b = torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(3))
    opt = adamw([{"params": [a], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}], lr=1e-3)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert all(g["foreach"] is False and not g["fused"] for g in opt.param_groups)


def test_state_bytes_per_param():
    assert state_bytes_per_param(torch.bfloat16) == 18  # bf16 weight + fp32 master, grad, exp_avg, exp_avg_sq
    assert state_bytes_per_param(torch.float32) == 16
    assert state_bytes_per_param(torch.bfloat16, master_weights=False) == 8


@pytest.mark.gpu
def test_adamw_on_cuda_is_fused_and_deterministic():
    results = []
    for _ in range(2):
        gen = torch.Generator(device="cuda").manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(1000, 77, device="cuda", generator=gen)) for _ in range(3)]
        opt = adamw([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}], lr=1e-2,
                    weight_decay=0.1)  # the two groups of detinfer rl's build_optimizer
        assert all(g["fused"] is True for g in opt.param_groups)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, device="cuda", generator=gen)
            opt.step()
        results.append([p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def _fused_cpu_adamw(params, **kwargs):
    return torch.optim.AdamW(params, fused=True, **kwargs)


def test_offloaded_adamw_equals_torchs_fused_cpu_adamw(stories_dir):
    """The host-memory AdamW steps like torch's fused CPU AdamW on the parameters themselves, bit for bit,
    and sees device-side rewrites."""
    from detinfer.train.optim import OffloadedAdamW

    runs = []
    for optimizer in (_fused_cpu_adamw, OffloadedAdamW):
        model, _ = load_model(stories_dir, torch.bfloat16, "cpu", "deterministic")
        trainer = TrainableModel(model)
        opt = optimizer(trainer.parameters(), lr=0.01, weight_decay=0.1)
        ids, cu = torch.tensor([1, 5, 9, 33, 100, 7, 8, 1, 44, 55, 66]), [0, 7, 11]
        for step in range(3):
            opt.zero_grad()
            (-trainer.score(ids, cu).sum()).backward()
            if step == 1:
                with torch.no_grad():
                    next(trainer.parameters()).mul_(0.5)  # a rewrite between steps (a restore)
            opt.step()
            trainer.push_weights()
        params = list(trainer.parameters())
        runs.append(([p.detach().clone() for p in params],
                     [t.clone() for p in params for t in opt.state[p].values()]))
    (w0, s0), (w1, s1) = runs
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))
    assert len(s0) == len(s1) > 0 and all(torch.equal(a, b) for a, b in zip(s0, s1))
    assert state_bytes_per_param(torch.bfloat16, offload_optimizer=True) == 10


@pytest.mark.gpu
def test_offloaded_adamw_on_cuda_is_deterministic_and_keeps_no_state_on_the_gpu():
    from detinfer.train.optim import OffloadedAdamW

    results, growth = [], {}
    for optimizer in (OffloadedAdamW, OffloadedAdamW, adamw):
        gen = torch.Generator(device="cuda").manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(1000, 77, device="cuda", generator=gen)) for _ in range(3)]
        opt = optimizer(params, lr=1e-2, weight_decay=0.1)
        for p in params:
            p.grad = torch.randn(p.shape, device="cuda", generator=gen)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        opt.step()
        torch.cuda.synchronize()
        growth[optimizer] = torch.cuda.memory_allocated() - before
        results.append([p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1]))
    assert growth[OffloadedAdamW] == 0 and growth[adamw] >= 2 * 4 * 3 * 1000 * 77  # two fp32 moments


_shapes = st.lists(st.tuples(st.integers(1, 5), st.integers(1, 7)), min_size=1, max_size=3)


@settings(max_examples=15, deadline=None)
@given(decayed=_shapes, plain=st.lists(st.integers(1, 9), min_size=1, max_size=3), seed=st.integers(0, 2**16))
def test_offloaded_adamw_with_param_groups_equals_torch_adamw_bitwise(decayed, plain, seed):
    """Two groups with their own weight decay (detinfer rl's build_optimizer): OffloadedAdamW steps like
    torch's fused CPU AdamW over the same groups, bit for bit, weights and moments."""
    from detinfer.train.optim import OffloadedAdamW

    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen) for s in decayed] + [torch.randn(n, generator=gen) for n in plain]
    grads = [[torch.randn(t.shape, generator=gen) for t in init] for _ in range(3)]
    runs = []
    for make in (lambda g: _fused_cpu_adamw(g, lr=1e-2), lambda g: OffloadedAdamW(g, lr=1e-2)):
        params = [torch.nn.Parameter(t.clone()) for t in init]
        opt = make([{"params": params[:len(decayed)], "weight_decay": 0.1},
                    {"params": params[len(decayed):], "weight_decay": 0.0}])
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
        runs.append(([p.detach().clone() for p in params],
                     [opt.state[p][k].clone() for p in params for k in ("exp_avg", "exp_avg_sq", "step")]))
    (w0, s0), (w1, s1) = runs
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))
    assert all(torch.equal(a, b) for a, b in zip(s0, s1))
    assert any(not torch.equal(a, b) for a, b in zip(w0, init))  # the weights moved


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 5000), cut=st.integers(0, 5000), seed=st.integers(0, 2**16))
def test_offloaded_adamw_steps_a_shard_like_the_whole_tensor(n, cut, seed):
    """FSDP ranks step their shards' host copies: the fused CPU step of two pieces of a tensor gives the
    whole tensor's bits (each element's update is its own arithmetic, whichever vector lane or scalar tail
    of the kernel it falls in), so an offloaded run has the same bits at any number of trainer ranks."""
    from detinfer.train.optim import OffloadedAdamW

    cut = min(cut, n)
    gen = torch.Generator().manual_seed(seed)
    init = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(3)]

    def run(pieces):
        params = [torch.nn.Parameter(init[a:b].clone()) for a, b in pieces]
        opt = OffloadedAdamW(params, lr=1e-2, weight_decay=0.1)
        for g in grads:
            for p, (a, b) in zip(params, pieces):
                p.grad = g[a:b].clone()
            opt.step()
        return torch.cat([p.detach() for p in params])

    whole = run([(0, n)])
    assert torch.equal(whole, run([(0, cut), (cut, n)]))
    assert not torch.equal(whole, init)


@settings(max_examples=15, deadline=None)
@given(sizes=st.lists(st.integers(1, 300), min_size=1, max_size=6), stage=st.sampled_from([64, 128, 1000]),
       seed=st.integers(0, 2**16))
def test_offloaded_adamw_staged_in_chunks_equals_torch_adamw_and_keeps_only_the_moments(sizes, stage, seed):
    """Masters and gradients pass through a staging area a few tensors at a time (a tensor larger than the
    area gets an area of its size): the same bits as torch's fused CPU AdamW on the parameters, and between
    steps the host holds no per-parameter copy of them, only the moments."""
    from detinfer.train.optim import OffloadedAdamW

    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(n, generator=gen) for n in sizes]
    grads = [[torch.randn(n, generator=gen) for n in sizes] for _ in range(3)]
    runs = []
    for make in (lambda p: _fused_cpu_adamw(p, lr=1e-2, weight_decay=0.1),
                 lambda p: OffloadedAdamW(p, lr=1e-2, weight_decay=0.1)):
        params = [torch.nn.Parameter(t.clone()) for t in init]
        opt = make(params)
        if isinstance(opt, OffloadedAdamW):
            opt.stage_elements = stage
        for step, step_grads in enumerate(grads):
            for i, (p, g) in enumerate(zip(params, step_grads)):
                p.grad = None if (step == 1 and i == 0) else g.clone()  # a parameter without a gradient: skipped
            opt.step()
        runs.append([p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    staging = {t.untyped_storage().data_ptr() for pair in opt._staging.values() for t in pair}
    assert all(h.numel() == 0 or h.untyped_storage().data_ptr() in staging for h in opt.host)
    assert all(h.grad is None for h in opt.host)
