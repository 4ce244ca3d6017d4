"""The MoE routing kernels (kernels/moe_routing.py): the stable top-k and the grouping by expert give their
torch references' outputs bitwise (`torch.equal`; fp32 bits compared as integers where NaN may occur), on
inputs full of exact ties and zeros, with and without renormalisation and expert-parallel foreign slots,
on both sides of the grouping's kernel/reference switch; rows are independent (slices); `route` takes the
kernel; CUDA-graph capture and replay (GPU); errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.kernels import moe, moe_routing
from detinfer.kernels.matmul import linear
from detinfer.kernels.moe_routing import (
    GROUP_KERNEL_MAX_PAIRS,
    TOPK_MAX_EXPERTS,
    _group_by_expert_kernel,
    group_by_expert,
    group_by_expert_ref,
    local_expert_ids,
    topk_stable,
    topk_stable_ref,
)
from detinfer.kernels.softmax import softmax

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EXAMPLES = 40 if DEVICE.type == "cuda" else 12


def bits(t: torch.Tensor) -> torch.Tensor:
    """fp32 values as their int32 bit patterns (NaN == NaN, -0.0 != 0.0)."""
    return t.contiguous().view(torch.int32)


def assert_topk_equal(got, want):
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.int64
    assert torch.equal(bits(got[0].cpu()), bits(want[0].cpu())) and torch.equal(got[1].cpu(), want[1].cpu())


@st.composite
def probs_cases(draw):
    T = draw(st.sampled_from([1, 2, 7, 33, 333]))
    E = draw(st.sampled_from([8, 60, 128, 256]))
    k = draw(st.integers(1, 8))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if draw(st.booleans()):  # a few levels (exact ties everywhere), zeros and subnormals among them
        levels = torch.tensor([0.0, 1e-40, 3e-39, 0.0625, 0.1, 0.125, 0.3])[:draw(st.integers(2, 7))]
        probs = levels[torch.randint(0, len(levels), (T, E), generator=g)]
    else:  # a real softmax, some rows with tied or saturated logits
        logits = torch.randn(T, E, generator=g) * draw(st.sampled_from([0.1, 3.0, 60.0]))
        logits[:, E // 2] = logits[:, 0]
        logits[0] = 0.0
        probs = torch.softmax(logits, dim=-1)
    m = draw(st.integers(0, T - 1))
    return probs, k, draw(st.booleans()), (m, draw(st.integers(m + 1, T)))


@settings(max_examples=EXAMPLES)
@given(probs_cases())
def test_topk_kernel_equals_reference(case):
    probs, k, renorm, (m, n) = case
    got = topk_stable(probs.to(DEVICE), k, renorm)
    assert_topk_equal(got, topk_stable_ref(probs, k, renorm))  # the CPU reference's bits
    assert_topk_equal(got, topk_stable_ref(probs.to(DEVICE), k, renorm))
    part = topk_stable(probs[m:n].to(DEVICE), k, renorm)
    assert torch.equal(part[0], got[0][m:n]) and torch.equal(part[1], got[1][m:n])


@pytest.mark.parametrize("renorm", [False, True])
def test_topk_ties_nan_negative_zero_and_widest_rows(renorm):
    """The tie rule (lowest id first), NaN above everything as torch's sort has it, -0.0 kept bit-exact,
    a row of zeros (renormalised: 0 / 0), and rows of the widest supported width."""
    probs = torch.tensor([[0.25, 0.5, 0.25, 0.5, 0.0, 0.0, 0.0, 0.0],
                          [0.1, float("nan"), 0.2, float("nan"), 0.3, 0.0, 0.1, 0.2],
                          [-0.0, 0.0, -0.0, 0.0, 0.5, 0.5, float("inf"), 0.0],
                          [0.0] * 8,
                          [1e-45, 2e-45, 1e-40, 1e-45, 0.0, 3e-39, 0.0, 2e-45]])  # subnormals: no flush to 0
    for k in (1, 3, 8):
        assert_topk_equal(topk_stable(probs.to(DEVICE), k, renorm), topk_stable_ref(probs, k, renorm))
    assert topk_stable(probs[:1].to(DEVICE), 4, False)[1].tolist() == [[1, 3, 0, 2]]
    wide = torch.softmax(torch.randn(3, TOPK_MAX_EXPERTS, generator=torch.Generator().manual_seed(0)), -1)
    wide[1, 300] = wide[1, 7] = wide[1].max() * 2
    assert_topk_equal(topk_stable(wide.to(DEVICE), 8, renorm), topk_stable_ref(wide, 8, renorm))


def test_route_uses_the_topk_kernel_with_the_reference_bits(monkeypatch):
    calls = []
    monkeypatch.setattr(moe, "topk_stable", lambda *a: calls.append(1) or topk_stable(*a))
    g = torch.Generator().manual_seed(3)
    router = torch.randn(16, 32, generator=g)
    router[5] = router[2]  # experts 2 and 5 tie for every token
    x = torch.randn(9, 32, generator=g)
    x[4] = 0.0  # every expert ties
    x, router = x.to(DEVICE), router.to(DEVICE)
    probs = softmax(linear(x, router), dim=-1)  # route's probabilities (the Triton matmul and softmax)
    for renorm in (False, True):
        assert_topk_equal(moe.route(x, router, 4, renorm), topk_stable_ref(probs, 4, renorm))
    assert len(calls) == 2


@st.composite
def grouping_cases(draw):
    T = draw(st.sampled_from([1, 2, 7, 33, 333]))
    k = draw(st.integers(1, 8))
    E = draw(st.sampled_from([1, 4, 8, 60, 128, 256]))
    block_m = draw(st.sampled_from([1, 16, 64]))
    ranks = draw(st.sampled_from([None, 2, 4]))  # None: no expert parallelism
    first = None if ranks is None else E * draw(st.integers(0, ranks - 1))
    hot = draw(st.integers(1, E * (ranks or 1)))  # few hit experts: long groups; many: short ones
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    ids = torch.randint(0, hot, (T, k), generator=g)
    ids = torch.randperm(E * (ranks or 1), generator=g)[ids]
    return ids, E, block_m, first


def grouping_ref(ids, num_experts, block_m, first):
    """What the model code did before the kernel: `local_expert_ids`, then the torch grouping."""
    local, foreign = local_expert_ids(ids, first, num_experts)
    return group_by_expert_ref(local, num_experts, block_m, foreign)


def assert_grouping_equal(got, want):
    assert got[2] == want[2] and got[0].dtype == got[1].dtype == torch.int32
    assert torch.equal(got[0].cpu(), want[0].cpu()) and torch.equal(got[1].cpu(), want[1].cpu())


@settings(max_examples=EXAMPLES)
@given(grouping_cases())
def test_grouping_kernel_equals_reference(case):
    ids, E, block_m, first = case
    want = grouping_ref(ids, E, block_m, first)
    assert_grouping_equal(group_by_expert(ids.to(DEVICE), E, block_m, first), want)
    assert_grouping_equal(grouping_ref(ids.to(DEVICE), E, block_m, first), want)


@pytest.mark.parametrize(("pairs", "block_m", "first"), [(GROUP_KERNEL_MAX_PAIRS, 16, None),
                                                         (GROUP_KERNEL_MAX_PAIRS + 8, 1, 128),
                                                         (GROUP_KERNEL_MAX_PAIRS + 8, 64, None)])
def test_grouping_switch_between_kernel_and_reference_changes_nothing(pairs, block_m, first, monkeypatch):
    """Up to GROUP_KERNEL_MAX_PAIRS pairs the public function runs the kernel, above it the reference; the
    kernel gives the reference's integers on both sides of the switch, so the switch changes nothing."""
    experts = 128 if first is None else 256  # global ids: this rank's 128 experts and another rank's
    ids = torch.randint(0, experts, (pairs // 8, 8), generator=torch.Generator().manual_seed(pairs + block_m))
    want = grouping_ref(ids, 128, block_m, first)
    kernel_path = pairs <= GROUP_KERNEL_MAX_PAIRS
    with monkeypatch.context() as patch:  # prove which path the public function takes
        if kernel_path:
            patch.setattr(moe_routing, "group_by_expert_ref", None)
        else:
            patch.setattr(moe_routing, "_group_by_expert_kernel", None)
        assert_grouping_equal(group_by_expert(ids.to(DEVICE), 128, block_m, first), want)
    assert_grouping_equal(_group_by_expert_kernel(ids.to(DEVICE), 128, block_m, first), want)


def test_empty_routing():
    values, ids = topk_stable(torch.zeros(0, 8, device=DEVICE), 2, True)
    assert values.shape == ids.shape == (0, 2)
    empty = torch.zeros(0, 2, dtype=torch.int64, device=DEVICE)
    assert_grouping_equal(group_by_expert(empty, 8, 16, 8), grouping_ref(empty.cpu(), 8, 16, 8))


def test_errors_name_the_problem():
    probs = torch.rand(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match=f"at most {TOPK_MAX_EXPERTS}"):
        topk_stable(torch.rand(2, TOPK_MAX_EXPERTS + 1, device=DEVICE), 2, False)
    with pytest.raises(TypeError, match="dtype float64 is not supported"):
        topk_stable(probs.double(), 2, False)
    with pytest.raises(ValueError, match=r"top_k must be an int in \[1, 8\]"):
        topk_stable(probs, 9, False)
    with pytest.raises(ValueError, match="probs must be a 2-D tensor"):
        topk_stable(probs[0], 2, False)
    ids = torch.zeros(3, 2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(TypeError, match="ids must be int64"):
        group_by_expert(ids.int(), 8, 16)
    with pytest.raises(ValueError, match="ids must be a 2-D tensor"):
        group_by_expert(ids[0], 8, 16)
    with pytest.raises(ValueError, match="positive ints"):
        group_by_expert(ids, 8, 0)


@pytest.mark.gpu
def test_routing_kernels_replay_in_a_cuda_graph_with_new_inputs():
    g = torch.Generator().manual_seed(7)
    probs = torch.softmax(torch.randn(5, 128, generator=g), -1).cuda()
    ids = torch.randint(0, 256, (5, 8), generator=g).cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles) outside the capture
        topk_stable(probs, 8, True)
        group_by_expert(ids, 128, 16, 128)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        top = topk_stable(probs, 8, True)
        grouping = group_by_expert(ids, 128, 16, 128)
    for seed in (8, 9):
        g.manual_seed(seed)
        probs.copy_(torch.softmax(torch.randn(5, 128, generator=g), -1))
        probs[0, 3] = probs[0, 70] = 0.5  # a tie
        ids.copy_(torch.randint(0, 256, (5, 8), generator=g))
        graph.replay()
        torch.cuda.synchronize()
        assert_topk_equal(top, topk_stable_ref(probs.cpu(), 8, True))
        assert_grouping_equal(grouping, grouping_ref(ids.cpu(), 128, 16, 128))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4, 64, 512, 4096])
def test_routing_kernels_at_model_sizes(tokens):
    """Qwen3-30B-A3B's routing (128 experts, top-8) at decode and prefill sizes, on the GPU: the kernels
    equal the CPU references (the grouping on both sides of its switch), with and without expert parallelism."""
    g = torch.Generator().manual_seed(tokens)
    logits = torch.randn(tokens, 128, generator=g) * 4
    logits[:, 77] = logits[:, 3]
    probs = torch.softmax(logits, -1)
    for renorm in (False, True):
        assert_topk_equal(topk_stable(probs.cuda(), 8, renorm), topk_stable_ref(probs, 8, renorm))
    ids = topk_stable_ref(probs, 8, True)[1]
    for first in (None, 0, 64):
        experts = 128 if first is None else 64
        for block_m in (16, 64):
            want = grouping_ref(ids, experts, block_m, first)
            assert_grouping_equal(group_by_expert(ids.cuda(), experts, block_m, first), want)
            assert_grouping_equal(_group_by_expert_kernel(ids.cuda(), experts, block_m, first), want)
