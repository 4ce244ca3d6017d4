"""The tiled FP8 weight layout (kernels/fp8_quant.py: [N/128, K/128, 128, 128], each 128-row group's K block one
contiguous tile) and the swapped decode tiles: the same values, so every op gives the same bits from either
layout (reference, fast mode, the chunk tree, the Triton kernel under every config), the engine lays its FP8
linears out at start-up only where the kernel reads them, and the GPU kernel (Hopper) matches the [N, K]
layout bitwise."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.kernels.fp8_linear import check_fp8_linear, linear_fp8_ref
from detinfer.kernels.fp8_quant import (
    BLOCK,
    can_tile,
    fp8_weight_shape,
    is_tiled,
    quantize_weight_rows,
    tile_weight,
    untile_weight,
    weight_k_blocks,
)
from detinfer.kernels.fp8_stock import linear_fp8_stock
from detinfer.ops import Ops


def _operands(m, n, k, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    q, s = quantize_weight_rows(torch.randn(n, k, generator=g) / math.sqrt(k))
    return x, q, s


@settings(max_examples=15, deadline=None)
@given(nb=st.integers(1, 4), kb=st.integers(1, 5), seed=st.integers(0, 2 ** 16))
def test_tiling_round_trips_and_puts_each_block_in_one_contiguous_tile(nb, kb, seed):
    _, q, _ = _operands(1, nb * BLOCK, kb * BLOCK, seed)
    t = tile_weight(q)
    assert is_tiled(t) and t.is_contiguous() and t.shape == (nb, kb, BLOCK, BLOCK)
    assert fp8_weight_shape(t) == fp8_weight_shape(q) == (nb * BLOCK, kb * BLOCK)
    g, b = nb - 1, kb - 1  # the last tile is block (g, b) of [N, K], byte for byte
    u8 = lambda w: w.view(torch.uint8)  # noqa: E731 - fp8 tensors compare bytewise
    assert torch.equal(u8(t[g, b]), u8(q[g * BLOCK:(g + 1) * BLOCK, b * BLOCK:(b + 1) * BLOCK]))
    assert torch.equal(u8(untile_weight(t)), u8(q)) and untile_weight(q) is q
    assert torch.equal(u8(untile_weight(weight_k_blocks(t, 0, 1))), u8(weight_k_blocks(q, 0, 1)))


def test_only_whole_blocks_tile_and_bad_shapes_are_named():
    _, q, s = _operands(2, 200, 256, seed=0)
    assert not can_tile(q) and not can_tile(q[:0])
    with pytest.raises(ValueError, match="multiples of 128"):
        tile_weight(q)
    with pytest.raises(ValueError, match=r"tiled \[N/128, K/128, 128, 128\]"):
        fp8_weight_shape(q.reshape(2, 100, 2, 128))
    x = torch.randn(2, 256).bfloat16()
    with pytest.raises(ValueError, match=r"op: weight must be a float8_e4m3fn \[N, K\] tensor \(or tiled"):
        check_fp8_linear("op", x, q.reshape(2, 100, 2, 128), s, None)
    _, q2, s2 = _operands(2, 256, 256, seed=1)
    with pytest.raises(ValueError, match="weight scales"):
        check_fp8_linear("op", x, tile_weight(q2), s2[:128], None)


@settings(max_examples=10, deadline=None)
@given(m=st.integers(1, 9), nb=st.integers(1, 3), kb=st.integers(1, 4), bias=st.booleans(), seed=st.integers(0, 999))
def test_reference_fast_mode_and_the_tree_give_the_same_bits_from_either_layout(m, nb, kb, bias, seed):
    x, q, s = _operands(m, nb * BLOCK, kb * BLOCK, seed)
    b = torch.randn(nb * BLOCK).bfloat16() if bias else None
    t = tile_weight(q)
    assert torch.equal(linear_fp8_ref(x, t, s, b), linear_fp8_ref(x, q, s, b))
    assert torch.equal(linear_fp8_stock(x, t, s, b), linear_fp8_stock(x, q, s, b))
    ops = Ops("deterministic", "cpu", torch.bfloat16)
    chunks = 2 if kb % 2 == 0 else 1
    assert torch.equal(ops.linear_fp8_tree(x, t, s, chunks), ops.linear_fp8_tree(x, q, s, chunks))
    gx, gq, gs = _operands(m, 2 * BLOCK, kb * BLOCK, seed + 1)  # a fused gate_up weight
    assert torch.equal(ops.linear_fp8_silu_mul(gx, tile_weight(gq), gs), ops.linear_fp8_silu_mul(gx, gq, gs))


def test_the_backend_tiles_only_for_the_deterministic_cuda_kernel():
    _, q, _ = _operands(1, 256, 256, seed=2)
    for mode in ("deterministic", "fast"):
        assert Ops(mode, "cpu", torch.bfloat16).fp8_weight_layout(q) is q  # CPU: the reference reads [N, K]
        back = Ops(mode, "cpu", torch.bfloat16).fp8_weight_layout(tile_weight(q))
        assert torch.equal(back.view(torch.uint8), q.view(torch.uint8))
    if torch.cuda.is_available():
        qc = q.cuda()
        assert Ops("fast", "cuda", torch.bfloat16).fp8_weight_layout(qc) is qc  # cuBLASLt reads [N, K]
        tiled = Ops("deterministic", "cuda", torch.bfloat16).fp8_weight_layout(qc)
        assert is_tiled(tiled) and torch.equal(untile_weight(tiled).cpu().view(torch.uint8), q.view(torch.uint8))
        odd = qc[:200]
        assert Ops("deterministic", "cuda", torch.bfloat16).fp8_weight_layout(odd) is odd  # no whole tiles


def test_laying_out_a_model_leaves_parameters_alone_where_the_backend_reads_n_k():
    """models/fp8.py `lay_out_fp8_linears`: where ops keep [N, K] (fast mode, CPU) nothing is touched, not even
    re-assigned (a first version compared `.data` aliases, always new objects, and re-set every weight)."""
    from torch import nn

    from detinfer.models.fp8 import lay_out_fp8_linears

    _, q, s = _operands(1, 256, 256, seed=3)
    model = nn.Module()
    model.proj = nn.Module()
    model.proj.weight, model.proj.weight_scale = nn.Parameter(q, requires_grad=False), s
    model.plain = nn.Linear(4, 4)  # no weight_scale: not an FP8 linear
    before = model.proj.weight.data
    for mode in ("deterministic", "fast"):
        assert lay_out_fp8_linears(model, Ops(mode, "cpu", torch.bfloat16)) == 0
    assert model.proj.weight.data.data_ptr() == before.data_ptr() and model.proj.weight.shape == (256, 256)

    class Tiling(Ops):
        def fp8_weight_layout(self, weight):
            return tile_weight(weight)

    assert lay_out_fp8_linears(model, Tiling("deterministic", "cpu", torch.bfloat16)) == 1
    assert is_tiled(model.proj.weight) and isinstance(model.proj.weight, nn.Parameter)
    # the same model handed to a fast-mode engine next (a benchmark switching modes): back to [N, K]
    assert lay_out_fp8_linears(model, Ops("fast", "cpu", torch.bfloat16)) == 1
    back = model.proj.weight
    assert back.shape == (256, 256) and torch.equal(back.view(torch.uint8), q.view(torch.uint8))


# -- the kernel under Triton's CPU interpreter (indexing; the GPU test checks the bits) -------------------------
@pytest.mark.parametrize("m", [1, 9, 70])
def test_interpreter_every_config_reads_either_layout_to_the_same_bits(m, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from detinfer.kernels import fp8_linear
    from detinfer.kernels.fp8_linear import _FEW, _LARGE, _SMALL, _SMALL_WIDE, linear_fp8

    monkeypatch.setattr(fp8_linear, "SPLIT_MIN_BLOCKS", 4)  # 5 K blocks: two runs (3 + 2), a pair loop's tail
    x, q, s = _operands(m, 256, 5 * BLOCK, seed=m, dtype=torch.float32)
    bias = torch.randn(256)
    t = tile_weight(q)
    outs = [linear_fp8(x, w, s, bias, config=dict(cfg, BLOCK_K=BLOCK, TMA=tma, SPLIT=split), uniform=u)
            for w in (q, t) for cfg in (_FEW, _SMALL, _SMALL_WIDE, _LARGE) for tma in (False, True)
            for split in (1, 2)
            for u in (True, False)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert torch.allclose(outs[0], linear_fp8_ref(x, q, s, bias), rtol=1e-5, atol=1e-4)


def test_interpreter_a_tiled_weight_refuses_tiles_wider_than_its_row_groups(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from detinfer.kernels.fp8_linear import _LARGE, linear_fp8

    x, q, s = _operands(3, 256, 256, seed=5, dtype=torch.float32)
    with pytest.raises(ValueError, match="BLOCK_N=256 does not divide 128"):
        linear_fp8(x, tile_weight(q), s, config=dict(_LARGE, BLOCK_N=256, BLOCK_K=BLOCK, TMA=False))


@pytest.mark.parametrize("m", [5, 70])
def test_interpreter_chunk_tree_reads_k_slices_of_a_tiled_weight(m, monkeypatch):
    """K slices of a tiled weight are views; at 70 rows the large tiles read them through TMA descriptors."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from detinfer.kernels.fp8_linear import linear_fp8, linear_fp8_tree

    x, q, s = _operands(m, 256, 4 * BLOCK, seed=6, dtype=torch.float32)
    assert torch.equal(linear_fp8_tree(linear_fp8, x, tile_weight(q), s, 2), linear_fp8_tree(linear_fp8, x, q, s, 2))


# -- GPU (Hopper) ------------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (fp8 tensor cores)")


def _fp8_gpu():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("m", [1, 7, 16, 17, 64, 65, 300])
@pytest.mark.parametrize("n,k", [(512, 2048), (384, 8320), (256, 384), (384, 8448)])
def test_gpu_either_layout_every_config_gives_the_same_bits(m, n, k):
    """Tiled or [N, K]; swapped 16-token, small and large tiles; TMA or pointer loads; one or two K blocks per
    iteration; per-tile or per-element scale products; (K >= 64 blocks) the two K runs in one program or two:
    one result. (384, 8448): 66 blocks, two runs of 33."""
    if not _fp8_gpu():
        pytest.skip("fp8 tl.dot needs sm89+")
    from detinfer.kernels.fp8_linear import _FEW, _LARGE, _SMALL, _SMALL_WIDE, linear_fp8

    x, q, s = _operands(m, n, k, seed=m + n)
    x, q, s, bias = x.cuda(), q.cuda(), s.cuda(), torch.randn(n, device="cuda").to(torch.bfloat16)
    t = tile_weight(q)
    splits = (1, 2) if k >= 64 * BLOCK else (None,)
    outs = [linear_fp8(x, w, s, bias, config=dict(cfg, BLOCK_K=BLOCK, TMA=tma, PAIRED=paired, SPLIT=sp), uniform=u)
            for w in (q, t) for cfg in (_FEW, _SMALL, _SMALL_WIDE, _LARGE) for tma in (True, False)
            for paired in (True, False)
            for u in (True, False) for sp in splits]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert torch.equal(outs[0], linear_fp8(x, t, s, bias)) and torch.equal(outs[0], linear_fp8(x, q, s, bias))
    ref = linear_fp8_ref(x.cpu(), q.cpu(), s.cpu(), bias.cpu()).float()
    assert float((outs[0].float().cpu() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.gpu
@cuda
@settings(max_examples=10, deadline=None)
@given(m=st.integers(1, 300), a=st.integers(0, 300), b=st.integers(0, 300), seed=st.integers(0, 100),
       nk=st.sampled_from([(1024, 768), (512, 2048), (256, 8192)]))
def test_gpu_tiled_slice_invariance_bitwise(m, a, b, seed, nk):
    """M up to 300 crosses the swapped (<= 16 rows), small (<= 64) and large tiles: a slice and the whole batch
    may run different ones."""
    if not _fp8_gpu():
        pytest.skip("fp8 tl.dot needs sm89+")
    from detinfer.kernels.fp8_linear import linear_fp8

    x, q, s = _operands(m, *nk, seed)
    x, t, s = x.cuda(), tile_weight(q.cuda()), s.cuda()
    a, b = sorted((min(a, m), min(b, m)))
    assert torch.equal(linear_fp8(x, t, s)[a:b], linear_fp8(x[a:b], t, s))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("m", [1, 100])
def test_gpu_chunk_tree_reads_k_slices_of_a_tiled_weight_in_place(m):
    """The row-parallel tree's K slices of a tiled weight are views (the 3-D TMA descriptor at M > 64)."""
    if not _fp8_gpu():
        pytest.skip("fp8 tl.dot needs sm89+")
    x, q, s = _operands(m, 512, 2048, seed=m)
    x, q, s = x.cuda(), q.cuda(), s.cuda()
    ops = Ops("deterministic", "cuda", torch.bfloat16)
    assert torch.equal(ops.linear_fp8_tree(x, tile_weight(q), s, 4), ops.linear_fp8_tree(x, q, s, 4))
