"""The fused MoE op (kernels/moe.py): batch invariance f(x)[m:n] == f(x[m:n]) bitwise, for the Triton
kernel (fp32 here in the interpreter, bf16 on a GPU) and the pure-torch reference, on routing-heavy inputs
with exact ties; the tie-break rule; accuracy against a float64 reference; the stock (fast) path; errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.kernels.moe import (
    expert_config,
    fused_moe,
    fused_moe_ref,
    moe_fast,
    moe_stock,
    route_ref,
)
from detinfer.kernels.moe_routing import local_expert_ids

# The kernel tests' device: CUDA when present, else the CPU under Triton's interpreter (tests/conftest.py).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_layer(E, H, inter, seed, dtype=torch.float32, device="cpu", tie_pairs=()):
    """Random router / experts; each (a, b) in tie_pairs gives expert b the router row of expert a, so
    every token scores them exactly equal."""
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(E, H, generator=g) / H ** 0.5
    for a, b in tie_pairs:
        router[b] = router[a]
    w13 = torch.randn(E, 2 * inter, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, inter, generator=g) / inter ** 0.5
    return [t.to(device=device, dtype=dtype) for t in (router, w13, w2)]


@st.composite
def moe_cases(draw):
    E = draw(st.integers(2, 8))
    k = draw(st.integers(1, E))
    H, inter = draw(st.sampled_from([8, 24, 40])), draw(st.sampled_from([4, 16, 36]))
    T = draw(st.integers(1, 20))
    ties = [(a, b) for a, b in [(draw(st.integers(0, E - 1)), draw(st.integers(0, E - 1)))] if a != b]
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    # routing-heavy: zero rows (every expert ties), repeated rows, one row scaled to saturate the router
    for t in draw(st.lists(st.integers(0, T - 1), max_size=3)):
        x[t] = 0.0
    if T > 2 and draw(st.booleans()):
        x[T // 2] = x[0]
    if draw(st.booleans()):
        x[-1] *= 50
    m = draw(st.integers(0, T - 1))
    n = draw(st.integers(m + 1, T))
    return x, make_layer(E, H, inter, seed, tie_pairs=ties), k, draw(st.booleans()), (m, n)


@given(moe_cases())
def test_reference_slices_are_bitwise_invariant(case):
    x, (router, w13, w2), k, renorm, (m, n) = case
    full = fused_moe_ref(x, router, w13, w2, k, renorm)
    assert torch.equal(full[m:n], fused_moe_ref(x[m:n], router, w13, w2, k, renorm))
    assert torch.equal(full[m:m + 1], fused_moe_ref(x[m:m + 1].clone(), router, w13, w2, k, renorm))


@settings(max_examples=60 if torch.cuda.is_available() else 6)  # the interpreter runs ~1 s per call
@given(moe_cases())
def test_kernel_slices_are_bitwise_invariant_and_close_to_reference(case):
    device = DEVICE
    x, layer, k, renorm, (m, n) = case
    x = x.to(device)
    router, w13, w2 = (t.to(device) for t in layer)
    full = fused_moe(x, router, w13, w2, k, renorm)
    assert torch.equal(full[m:n], fused_moe(x[m:n], router, w13, w2, k, renorm))
    ref = fused_moe_ref(x.double(), router.double(), w13.double(), w2.double(), k, renorm).float()
    assert (full - ref).abs().max() <= 1e-4 * (1 + ref.abs().max())


def test_ties_go_to_the_lower_expert_id():
    router, _, _ = make_layer(6, 16, 8, seed=0, tie_pairs=[(4, 1)])
    x = torch.randn(5, 16)
    x[2] = 0.0  # all logits equal: the first k ids
    weights, ids = route_ref(x, router, 3, renormalize=True)
    assert ids[2].tolist() == [0, 1, 2]
    assert torch.equal(weights[2], torch.full((3,), 1 / 3))
    for row in ids.tolist():  # experts 1 and 4 always tie: 1 comes first whenever both are chosen
        if 1 in row and 4 in row:
            assert row.index(1) == row.index(4) - 1
    top = torch.softmax(x.double() @ router.double().T, -1).topk(3).values  # fp64 scores, no ties at 1e-6
    assert torch.allclose(route_ref(x, router, 3, renormalize=False)[0].double(), top, atol=1e-6)


def test_one_expert_with_every_token_equals_it_alone():
    device = DEVICE
    """The reduction order of a row does not depend on how many rows its expert got (config from (N, K))."""
    router, w13, w2 = make_layer(4, 32, 24, seed=3, device=device)
    router[2] += 10.0  # expert 2 is everyone's first choice
    x = torch.randn(37, 32, device=device)
    full = fused_moe(x, router, w13, w2, 2, True)
    for t in (0, 17, 36):
        assert torch.equal(full[t:t + 1], fused_moe(x[t:t + 1], router, w13, w2, 2, True))
    assert expert_config(24, 32, torch.float32, x.device) == expert_config(24, 32, torch.float32, x.device)


def test_fast_paths_match_reference():
    """Fast mode's two paths (the stock loop; stock routing + M-tuned grouped GEMMs) compute the same function."""
    router, w13, w2 = make_layer(8, 32, 16, seed=5)
    x = torch.randn(11, 32)
    for renorm in (True, False):
        ref = fused_moe_ref(x, router, w13, w2, 3, renorm)
        assert torch.allclose(moe_stock(x, router, w13, w2, 3, renorm), ref, atol=1e-5, rtol=1e-5)
        fast = moe_fast(*(t.to(DEVICE) for t in (x, router, w13, w2)), 3, renorm).cpu()
        assert torch.allclose(fast, ref, atol=1e-5, rtol=1e-5)


@given(st.integers(1, 8), st.integers(1, 4), st.integers(0, 2**31 - 1), st.data())
def test_local_expert_ids_keep_this_ranks_experts_and_bucket_the_rest(num_local, ranks, seed, data):
    first = num_local * data.draw(st.integers(0, ranks - 1))
    ids = torch.randint(0, num_local * ranks, (data.draw(st.integers(0, 12)), 3),
                        generator=torch.Generator().manual_seed(seed))
    local, foreign = local_expert_ids(ids, first, num_local)
    mine = (ids >= first) & (ids < first + num_local)
    assert foreign and torch.equal(local, torch.where(mine, ids - first, torch.full_like(ids, num_local)))
    unchanged, foreign = local_expert_ids(ids, None, num_local)
    assert unchanged is ids and not foreign


def test_empty_input():
    router, w13, w2 = make_layer(4, 8, 4, seed=0)
    assert fused_moe_ref(torch.zeros(0, 8), router, w13, w2, 2, True).shape == (0, 8)


@pytest.mark.parametrize(("change", "message"), [
    (dict(top_k=5), r"top_k must be an int in \[1, 4\]"),
    (dict(top_k=0), r"top_k must be an int in \[1, 4\]"),
    (dict(x=torch.zeros(3, 9)), "shapes do not fit"),
    (dict(w_down=torch.zeros(4, 8, 5)), "shapes do not fit"),
    (dict(x=torch.zeros(3, 8, 1)), "x must be a 2-D tensor"),
    (dict(x=torch.zeros(3, 8, dtype=torch.float64)), "must share one floating dtype"),
])
def test_bad_inputs_are_refused(change, message):
    router, w13, w2 = make_layer(4, 8, 4, seed=0)
    args = dict(x=torch.zeros(3, 8), router_weight=router, w_gate_up=w13, w_down=w2, top_k=2, renormalize=True)
    args.update(change)
    for fn in (fused_moe_ref, fused_moe):
        with pytest.raises((ValueError, TypeError), match=message):
            fn(**args)


# ------------------------------------------------------------------------------------------- GPU (bf16)
QWEN3_30B_LAYER = dict(E=128, H=2048, inter=768, k=8)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_qwen3_30b_layer_is_batch_invariant(dtype):
    E, H, inter, k = QWEN3_30B_LAYER.values()
    router, w13, w2 = make_layer(E, H, inter, seed=1, dtype=dtype, device="cuda", tie_pairs=[(3, 70)])
    x = torch.randn(2048, H, device="cuda", dtype=dtype)
    x[5] = 0
    full = fused_moe(x, router, w13, w2, k, True)
    for m, n in [(0, 1), (5, 6), (100, 164), (0, 7), (1000, 2048), (2047, 2048)]:
        assert torch.equal(full[m:n], fused_moe(x[m:n], router, w13, w2, k, True)), (m, n)
    ref = fused_moe_ref(x[:64].double(), router.double(), w13.double(), w2.double(), k, True)
    err = (full[:64].double() - ref).abs().max().item()
    assert err <= 2e-2 * (1 + ref.abs().max().item()), err


@pytest.mark.gpu
@pytest.mark.parametrize("fn", [fused_moe, moe_fast], ids=["deterministic", "fast"])
def test_gpu_moe_captures_in_a_cuda_graph(fn):
    """No host syncs (both modes' GPU paths): a decode-sized call replays from a CUDA graph with the same
    bits as eager."""
    E, H, inter, k = QWEN3_30B_LAYER.values()
    router, w13, w2 = make_layer(E, H, inter, seed=2, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(16, H, device="cuda", dtype=torch.bfloat16)
    eager = fn(x, router, w13, w2, k, True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(x, router, w13, w2, k, True)  # warm-up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x, router, w13, w2, k, True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_router_logits_are_row_invariant_and_fp32_accurate(dtype):
    """The 16-bit router GEMM with an fp32 output (kernels.moe.router_logits): a row's logits do not depend on
    the other rows (any slice == the same rows alone, bitwise), and they are the fp32-accumulated sum of exact
    products (against float64: within K fp32 roundings of the sum of |products|)."""
    from detinfer.kernels.moe import router_logits

    E, H = 128, 2048
    router = (torch.randn(E, H, device="cuda") / H ** 0.5).to(dtype)
    x = torch.randn(333, H, device="cuda").to(dtype)
    full = router_logits(x, router)
    assert full.dtype == torch.float32 and full.shape == (333, E)
    for m, n in [(0, 1), (7, 8), (5, 69), (300, 333)]:
        assert torch.equal(full[m:n], router_logits(x[m:n], router)), (m, n)
    ref = x.double() @ router.double().T
    bound = H * 2.0 ** -24 * (x.double().abs() @ router.double().abs().T)
    assert bool(((full.double() - ref).abs() <= bound).all())
