"""The chunk-tree linear (kernels/chunked_linear.py) behind tensor parallelism's same-bits-at-every-TP-size.

The property tensor parallelism relies on, asserted bitwise: for P ranks each owning a contiguous 1/P of K
(C/P chunks), "each rank's tree over its chunks, then the tree over the ranks' results" equals the tree over
all C chunks (what TP=1 computes). Also: rows are independent (f(x)[m:n] == f(x[m:n])), the result is
accurate against float64, and the tree's order is the documented one. The Triton path runs in Triton's
interpreter on CPU (fp32) and for real on a GPU (bf16, fp32; marker gpu).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.kernels import chunked_linear as cl
from detinfer.ops import Ops

HAS_CUDA = torch.cuda.is_available()


def rand(shape, seed, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1).to(dtype).to(device)


IMPLS = [pytest.param(cl.linear_tree_ref, id="ref"), pytest.param(cl.linear_tree, id="triton")]


def _ranks_then_tree(fn, x, w, chunks, ranks):
    kp = w.shape[1] // ranks
    parts = [fn(x[:, r * kp:(r + 1) * kp], w[:, r * kp:(r + 1) * kp].contiguous(), chunks // ranks)
             for r in range(ranks)]
    return cl.pairwise_tree_sum(torch.stack(parts))


def _check_rank_subtrees(fn, m, n, unit, seed):
    chunks = 8
    k = chunks * unit
    x, w = rand((m, k), seed), rand((n, k), seed + 1)
    full = fn(x, w, chunks)
    assert full.dtype == torch.float32
    for ranks in (2, 4, 8):
        assert torch.equal(_ranks_then_tree(fn, x, w, chunks, ranks), full), f"{ranks} ranks differ"


@settings(deadline=None)
@given(m=st.integers(1, 9), n=st.integers(1, 40), unit=st.integers(1, 24), seed=st.integers(0, 2**31))
def test_rank_subtrees_equal_the_full_tree(m, n, unit, seed):
    """What TP = 2, 4, 8 compute (each rank its chunks, then the ranks) == what TP=1 computes, bitwise."""
    _check_rank_subtrees(cl.linear_tree_ref, m, n, unit, seed)


def test_rank_subtrees_equal_the_full_tree_triton():
    """The same for the Triton path (few shapes: every new shape compiles again in the interpreter)."""
    _check_rank_subtrees(cl.linear_tree, 7, 33, 9, 1)


@settings(deadline=None)
@given(m=st.integers(2, 12), data=st.data(), seed=st.integers(0, 2**31))
def test_rows_are_independent(m, data, seed):
    a = data.draw(st.integers(0, m - 1))
    b = data.draw(st.integers(a + 1, m))
    x, w = rand((m, 96), seed), rand((24, 96), seed + 1)
    assert torch.equal(cl.linear_tree_ref(x, w, 4)[a:b], cl.linear_tree_ref(x[a:b], w, 4))


def test_rows_are_independent_triton():
    x, w = rand((9, 96), 2), rand((24, 96), 3)
    assert torch.equal(cl.linear_tree(x, w, 4)[2:5], cl.linear_tree(x[2:5], w, 4))


def test_one_chunk_written_in_place_keeps_row_bits(monkeypatch):
    """One chunk (a TP rank's partial without tp_invariant_reduction): the kernel writes straight into the
    result, also across row blocks; every row equals that row computed alone."""
    x, w = rand((9, 48), 4), rand((20, 48), 5)
    whole = cl.linear_tree(x, w, 1)
    monkeypatch.setattr(cl, "TREE_MAX_PARTIAL_ELEMS", 3 * 20)  # 3 rows per block
    blocked = cl.linear_tree(x, w, 1)
    alone = torch.cat([cl.linear_tree(x[i:i + 1], w, 1) for i in range(9)])
    assert torch.equal(whole, blocked) and torch.equal(whole, alone)
    assert torch.allclose(whole.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fn", IMPLS)
def test_accurate_against_float64(fn):
    x, w = rand((5, 256), 3), rand((33, 256), 4)
    exact = x.double() @ w.double().T
    err = (fn(x, w, 8).double() - exact).abs().max().item()
    assert err <= 256 * 2.0**-24 * (x.abs().double() @ w.abs().double().T).max().item()


def test_tree_order_is_adjacent_pairs():
    """((p0 + p1) + (p2 + p3)), not the halves fold ((p0 + p2) + (p1 + p3)): values where the two differ."""
    tiny = 2.0**-24
    p = torch.tensor([1.0, -1.0, tiny, tiny], dtype=torch.float32)
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    tree = (f32(1.0) + f32(-1.0)) + (f32(tiny) + f32(tiny))
    halves = (f32(1.0) + f32(tiny)) + (f32(-1.0) + f32(tiny))
    assert tree.item() != halves.item()
    assert torch.equal(cl.pairwise_tree_sum(p), tree)
    odd = torch.arange(5, dtype=torch.float32)
    assert cl.pairwise_tree_sum(odd).item() == ((0 + 1) + (2 + 3)) + 4


def test_bad_chunks_are_refused():
    x, w = rand((2, 30), 0), rand((4, 30), 1)
    with pytest.raises(ValueError, match="not a multiple of num_chunks=4"):
        cl.linear_tree_ref(x, w, 4)
    with pytest.raises(ValueError, match="num_chunks must be a positive int"):
        cl.linear_tree_ref(x, w, 0)
    with pytest.raises(ValueError, match="at least one part"):
        cl.pairwise_tree_sum(torch.empty(0, 3))


def test_ops_dispatch_and_fast_mode():
    x, w = rand((3, 64), 5), rand((16, 64), 6)
    det = Ops("deterministic", "cpu", torch.float32)
    assert torch.equal(det.linear_tree(x, w, 4), cl.linear_tree_ref(x, w, 4))
    fast = Ops("fast", "cpu", torch.float32).linear_tree(x, w, 4)
    torch.testing.assert_close(fast, x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_rank_subtrees_equal_the_full_tree(dtype):
    """The Triton path on a GPU, at Qwen3-8B's row-parallel shapes (o_proj K=4096, down_proj K=12288)."""
    for m, n, k in ((1, 4096, 4096), (37, 4096, 12288), (300, 1024, 4096)):
        x, w = rand((m, k), m, dtype, "cuda"), rand((n, k), k, dtype, "cuda") / 64
        full = cl.linear_tree(x, w, 8)
        for ranks in (2, 4, 8):
            assert torch.equal(_ranks_then_tree(cl.linear_tree, x, w, 8, ranks), full)
        assert torch.equal(cl.linear_tree(x[: m // 2 + 1], w, 8), full[: m // 2 + 1])


@settings(deadline=None)
@given(m=st.integers(1, 6), n=st.integers(1, 20), kc=st.sampled_from([1, 16, 100, 128, 200, 256]),
       chunks=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 2**31))
def test_ref_batched_partials_equal_per_chunk_linear_ref(m, n, kc, chunks, seed):
    """The ref's one-product path gives each chunk exactly `linear_ref` of that K slice."""
    from detinfer.kernels import matmul as mm

    x, w = rand((m, kc * chunks), seed), rand((n, kc * chunks), seed + 1)
    parts = torch.stack([mm.linear_ref(x[:, c * kc:(c + 1) * kc], w[:, c * kc:(c + 1) * kc]) for c in range(chunks)])
    assert torch.equal(cl.linear_tree_ref(x, w, chunks), cl.pairwise_tree_sum(parts))
    x[0, 0] = float("inf")  # the per-chunk fallback: the same definition
    parts = torch.stack([mm.linear_ref(x[:, c * kc:(c + 1) * kc], w[:, c * kc:(c + 1) * kc]) for c in range(chunks)])
    # zero tolerance, NaN == NaN (an inf row's products may hold inf - inf)
    torch.testing.assert_close(cl.linear_tree_ref(x, w, chunks), cl.pairwise_tree_sum(parts), rtol=0, atol=0,
                               equal_nan=True)


def test_wide_outputs_of_16_bit_inputs_cap_the_tile():
    from detinfer.kernels.matmul import fit_to_output
    from detinfer.kernels.matmul_configs import WIDE_OUTPUT_CONFIG, MatmulConfig, gpu_configs

    big = MatmulConfig(128, 256, 64, 8, 3, tma=True, persistent=True, warp_specialize=True)
    assert fit_to_output(big, 4, 2) == WIDE_OUTPUT_CONFIG  # fp32 partials of bf16 inputs
    assert WIDE_OUTPUT_CONFIG in gpu_configs(torch.bfloat16)  # swept by the GPU config tests
    assert fit_to_output(big, 2, 2) == big  # a bf16 output keeps the dispatcher's choice
    small = MatmulConfig(16, 64, 256, 4, 4)
    assert fit_to_output(small, 4, 2) == small


@pytest.mark.gpu
def test_gpu_prefill_sized_partials_fit_and_keep_row_bits():
    """Row-parallel partials at prefill-sized M (the engine's profiling step under TP): the fp32-output launch
    fits in shared memory, and a row's bits do not depend on how many rows came with it."""
    torch.manual_seed(0)
    x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16) / 32
    full = cl.linear_tree(x, w, 8)
    assert torch.equal(full[100:117], cl.linear_tree(x[100:117], w, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [576, 1000, 4096])
def test_gpu_one_chunk_fp32_partials_at_prefill_rows_keep_row_bits(m):
    """TP=2's row-parallel partials without the flag (one chunk: the descriptor kernel with the capped 128x128
    tile): they fit, rows equal those of a decode-sized launch (another kernel and config), and they are
    accurate against float64."""
    torch.manual_seed(m)
    x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16) / 32
    full = cl.linear_parts(x, w, 1)
    assert full.dtype == torch.float32
    for a, b in ((0, 1), (100, 117), (m - 5, m)):
        assert torch.equal(full[0, a:b], cl.linear_parts(x[a:b], w, 1)[0])
    want = x[:64].double() @ w.double().T
    torch.testing.assert_close(full[0, :64].double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("parts_fn, tree_fn", [pytest.param(cl.linear_parts_ref, cl.linear_tree_ref, id="ref"),
                                               pytest.param(cl.linear_parts, cl.linear_tree, id="triton")])
def test_parts_before_the_tree_give_the_tree_bits(parts_fn, tree_fn):
    """`linear_parts` is `linear_tree` before its tree: the tree of the parts == linear_tree, bitwise."""
    x, w = rand((2, 3, 96), 7), rand((24, 96), 8)
    for chunks in (1, 2, 4, 8):
        parts = parts_fn(x, w, chunks)
        assert parts.shape == (chunks, 2, 3, 24) and parts.dtype == torch.float32
        assert torch.equal(cl.pairwise_tree_sum(parts), tree_fn(x, w, chunks))


@pytest.mark.parametrize("cpu_triton", [False, True])
def test_ops_tree_sum_rounded_is_the_unfused_epilogue(cpu_triton):
    """Ops.tree_sum_rounded (TP=1's row-parallel epilogue with the chunk tree: one launch on the kernel path)
    == tree, + bias in fp32, rounded once; and fast mode's linear_parts are stock matmuls per chunk."""
    x, w, bias = rand((3, 64), 5), rand((16, 64), 6), rand((16,), 9, torch.float16)
    det = Ops("deterministic", "cpu", torch.float32, cpu_triton=cpu_triton)
    parts = det.linear_parts(x, w, 4)
    for b in (None, bias):
        want = cl.pairwise_tree_sum(parts)
        want = (want if b is None else want + b.float()).to(torch.float16)
        assert torch.equal(det.tree_sum_rounded(parts, b, torch.float16).view(torch.int16), want.view(torch.int16))
    fast = Ops("fast", "cpu", torch.float32).linear_parts(x, w, 4)
    torch.testing.assert_close(cl.pairwise_tree_sum(fast), x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_decode_rows_walk_their_chunks_in_one_program_with_the_same_bits(dtype):
    """Up to CHUNK_LOOP_MAX_M rows, one program walks all C chunks of its tile (matmul._run's z_per_program); more take
    one program per (tile, chunk). A row's partials are the same bits either way, at Qwen3-8B's TP=2 o_proj
    and down_proj shapes (K per rank 2048 / 6144, 4 chunks per rank)."""
    torch.manual_seed(3)
    for n, k in ((4096, 2048), (4096, 6144)):
        x = torch.randn(100, k, device="cuda").to(dtype)
        w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(dtype)
        many = cl.linear_parts(x, w, 4)
        for m, r in ((1, 0), (1, 99), (5, 40), (16, 84), (64, 36), (65, 35)):
            assert torch.equal(cl.linear_parts(x[r:r + m], w, 4), many[:, r:r + m]), (n, k, m, r)


def test_z_per_program_must_divide_the_batch():
    from detinfer.kernels import matmul as mm

    a, b, c = torch.zeros(4, 2, 8), torch.zeros(4, 8, 3), torch.zeros(4, 2, 3)
    with pytest.raises(ValueError, match="must divide the batch size 4"):
        mm._run(a, a.stride(), b, b.stride(), c, c.stride(), None, 4, 2, 3, 8, None, 3)
