"""Block-scaled FP8 linear: quantization round trips, the CPU reference against float64, its batch
invariance (bitwise), the backend's choice, and (GPU only) the Triton kernel."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.kernels.fp8_linear import check_fp8_linear, linear_fp8_ref
from detinfer.kernels.fp8_quant import (
    BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    dequantize_weight,
    expand_block_rows,
    quantize_activations,
    quantize_weight,
    quantize_weight_rows,
)
from detinfer.kernels.fp8_stock import linear_fp8_stock
from detinfer.ops import Ops

E4M3_REL = 2.0 ** -4  # half an ulp of a 4-significant-bit value, relative


def _operands(m, n, k, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    w = torch.randn(n, k, generator=g) / math.sqrt(k)
    q, s = quantize_weight_rows(w)
    return x, w, q, s


def _float64_of_quantized(x, q, s):
    """The same quantized operands, combined in float64: sum over K blocks of dot * sx * sw."""
    x_q, sx = quantize_activations(x.reshape(-1, x.shape[-1]))
    xd = x_q.double() * sx.double().repeat_interleave(BLOCK, -1)[:, :x.shape[-1]]
    return xd @ dequantize_weight(q, s).double().t()


# -- quantization ------------------------------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 300), k=st.integers(1, 300), seed=st.integers(0, 2 ** 16))
def test_weight_round_trip_within_half_an_fp8_step(n, k, seed):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 5
    q, scales = quantize_weight(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert scales.shape == (-(-n // BLOCK), -(-k // BLOCK)) and scales.dtype == torch.float32
    rows = expand_block_rows(scales, n)
    back = dequantize_weight(q, rows)
    step = rows.repeat_interleave(BLOCK, -1)[:, :k]  # the block's scale: values in units of it
    # e4m3 keeps 4 significant bits: error <= half an ulp of the value (and of the smallest normal 2^-6)
    bound = torch.maximum(w.abs() * E4M3_REL, step * 2.0 ** -10)
    assert bool(((back - w).abs() <= bound * (1 + 1e-6)).all())
    assert float(q.float().abs().max()) <= FP8_MAX  # every block's largest value maps to at most 448


def test_quantize_exact_values_round_trip_bitwise():
    # values already on the e4m3 grid times a power-of-two scale come back exactly
    grid = torch.tensor([0.0, 1.0, -1.5, 448.0, -448.0, 2.0 ** -6, 3.5, 240.0]).repeat(16, 16)[:, :128]
    q, s = quantize_weight(grid)
    assert torch.equal(dequantize_weight(q, expand_block_rows(s, grid.shape[0])), grid)


def test_zero_block_quantizes_to_zero_with_a_finite_scale():
    x = torch.zeros(2, 300)
    x[1, 200] = 3.0
    x_q, sx = quantize_activations(x)
    assert bool(torch.isfinite(sx).all()) and torch.equal(x_q.float()[0], torch.zeros(300))
    assert float(x_q.float()[1, 200]) * float(sx[1, 1]) == pytest.approx(3.0)


@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 12), k=st.integers(1, 400), a=st.integers(0, 12), b=st.integers(0, 12),
       seed=st.integers(0, 2 ** 16))
def test_activation_scales_are_per_row(m, k, a, b, seed):
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    a, b = sorted((min(a, m), min(b, m)))
    q, s = quantize_activations(x)
    q2, s2 = quantize_activations(x[a:b])
    assert torch.equal(q[a:b].view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s[a:b], s2)


# -- the reference --------------------------------------------------------------------------------------
@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 9), n=st.integers(1, 200), k=st.integers(1, 520), bias=st.booleans(),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), seed=st.integers(0, 2 ** 16))
def test_ref_matches_float64_of_the_quantized_operands(m, n, k, bias, dtype, seed):
    x, w, q, s = _operands(m, n, k, seed, dtype)
    b = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1)).to(dtype) if bias else None
    y = linear_fp8_ref(x, q, s, b)
    assert y.dtype == dtype and y.shape == (m, n)
    exact = _float64_of_quantized(x, q, s) + (0 if b is None else b.double())
    # fp32 rounding per block partial, per scale multiply and per add: a few fp32 ulps of the sum of
    # magnitudes of the block terms, plus the final rounding to `dtype`
    x_q, sx = quantize_activations(x)
    terms = (x_q.double().abs() * sx.double().repeat_interleave(BLOCK, -1)[:, :k]) @ \
        dequantize_weight(q, s).double().abs().t()
    out_eps = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -23
    bound = (4 * -(-k // BLOCK) + 4) * 2.0 ** -24 * terms + out_eps * exact.abs() + 1e-30
    assert bool(((y.double() - exact).abs() <= bound).all())


def test_ref_is_close_to_the_unquantized_product():
    x, w, q, s = _operands(16, 96, 512, seed=7, dtype=torch.float32)
    y = linear_fp8_ref(x, q, s)
    full = x.double() @ w.double().t()
    rel = (y.double() - full).norm() / full.norm()
    assert rel < 0.06  # fp8 of both operands: a few percent, averaged over K


@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 24), n=st.integers(1, 160), k=st.integers(1, 400), a=st.integers(0, 24),
       b=st.integers(0, 24), seed=st.integers(0, 2 ** 16))
def test_ref_slice_invariance_bitwise(m, n, k, a, b, seed):
    """f(x)[a:b] == f(x[a:b]): a row's result does not depend on the rows around it."""
    x, _, q, s = _operands(m, n, k, seed)
    a, b = sorted((min(a, m), min(b, m)))
    assert torch.equal(linear_fp8_ref(x, q, s)[a:b], linear_fp8_ref(x[a:b], q, s))


def test_ref_takes_leading_dims():
    x, _, q, s = _operands(6, 40, 130, seed=3)
    assert torch.equal(linear_fp8_ref(x.reshape(2, 3, 130), q, s), linear_fp8_ref(x, q, s).reshape(2, 3, 40))


def test_bad_operands_are_named():
    x, _, q, s = _operands(2, 8, 256, seed=0)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        check_fp8_linear("op", x, q.float(), s, None)
    with pytest.raises(ValueError, match=r"K=256"):
        check_fp8_linear("op", x[:, :100], q, s, None)
    with pytest.raises(ValueError, match="weight scales"):
        check_fp8_linear("op", x, q, s[:, :1], None)
    with pytest.raises(ValueError, match="bias"):
        check_fp8_linear("op", x, q, s, torch.zeros(3))


# -- the backend's choice ---------------------------------------------------------------------------------
def test_ops_picks_the_ref_on_cpu_and_the_stock_path_in_fast_mode():
    x, _, q, s = _operands(5, 64, 256, seed=2)
    det = Ops("deterministic", "cpu", torch.bfloat16)
    assert torch.equal(det.linear_fp8(x, q, s), linear_fp8_ref(x, q, s))
    fast = Ops("fast", "cpu", torch.bfloat16)
    stock = fast.linear_fp8(x, q, s)
    assert torch.equal(stock, linear_fp8_stock(x, q, s))
    # the stock path skips activation quantization, so it differs from the ref, but only by fp8 noise
    ref = linear_fp8_ref(x, q, s).float()
    assert not torch.equal(stock.float(), ref)
    assert float((stock.float() - ref).norm() / ref.norm()) < 0.06


# -- GPU (Hopper): the Triton kernel ------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (fp8 tensor cores)")


def _fp8_gpu():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("m,n,k", [(1, 256, 512), (37, 1000, 300), (200, 4096, 2048), (5, 128, 128)])
def test_kernel_matches_ref(m, n, k):
    if not _fp8_gpu():
        pytest.skip("fp8 tl.dot needs sm89+")
    from detinfer.kernels.fp8_linear import linear_fp8

    x, _, q, s = _operands(m, n, k, seed=m + n + k)
    bias = torch.randn(n).to(torch.bfloat16)
    ref = linear_fp8_ref(x, q, s, bias).float()
    y = linear_fp8(x.cuda(), q.cuda(), s.cuda(), bias.cuda()).float().cpu()
    # not bitwise: the tensor cores' internal fp8 accumulation order/precision is not the ref's exact dot
    exact = _float64_of_quantized(x, q, s).float() + bias.float()
    assert torch.allclose(y, ref, rtol=2e-2, atol=2e-2 * float(exact.abs().max()))


@pytest.mark.gpu
@cuda
@settings(max_examples=10, deadline=None)
@given(m=st.integers(1, 300), a=st.integers(0, 300), b=st.integers(0, 300), seed=st.integers(0, 100),
       nk=st.sampled_from([(1024, 768), (512, 2048)]))
def test_kernel_slice_invariance_bitwise(m, a, b, seed, nk):
    """M up to 300 crosses the small / large tile configs' boundary (kernel_config, 128 rows): a slice and the
    whole batch may run different tiles."""
    if not _fp8_gpu():
        pytest.skip("fp8 tl.dot needs sm89+")
    from detinfer.kernels.fp8_linear import linear_fp8

    x, _, q, s = _operands(m, *nk, seed)
    x, q, s = x.cuda(), q.cuda(), s.cuda()
    a, b = sorted((min(a, m), min(b, m)))
    assert torch.equal(linear_fp8(x, q, s)[a:b], linear_fp8(x[a:b], q, s))


@pytest.mark.gpu
@cuda
def test_ops_deterministic_uses_the_kernel_on_cuda_and_fast_mode_runs():
    if not _fp8_gpu():
        pytest.skip("fp8 tl.dot needs sm89+")
    from detinfer.kernels.fp8_linear import linear_fp8

    x, _, q, s = _operands(33, 512, 512, seed=1)
    x, q, s = x.cuda(), q.cuda(), s.cuda()
    assert torch.equal(Ops("deterministic", "cuda", torch.bfloat16).linear_fp8(x, q, s), linear_fp8(x, q, s))
    fast = Ops("fast", "cuda", torch.bfloat16).linear_fp8(x, q, s).float()
    ref = linear_fp8_ref(x.cpu(), q.cpu(), s.cpu()).float().cuda()
    assert float((fast - ref).norm() / ref.norm()) < 0.06


@pytest.mark.gpu
@cuda
def test_fast_mode_in_an_engine_runs_the_blockwise_gemm_not_the_dequantizing_fallback(monkeypatch):
    """An engine runs under inference mode with inference-tensor weights; the blockwise probe first runs
    there too. Fast mode must take torch's blockwise scaled_mm on Hopper (a first version of the scale
    cache read a version counter inference tensors lack, the probe failed, and every call dequantized)."""
    if not _fp8_gpu() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the blockwise scaled_mm path is checked on Hopper")
    from detinfer.kernels import fp8_stock

    fp8_stock.blockwise_layout.cache_clear()

    def no_dequant(*_):
        raise AssertionError("fast mode dequantized the weight")
    monkeypatch.setattr(fp8_stock, "dequantize_weight", no_dequant)
    with torch.inference_mode():
        x, _, q, s = (t.cuda() if t is not None else t for t in _operands(5, 256, 640, seed=2))
        y = Ops("fast", "cuda", torch.bfloat16).linear_fp8(x, q, s)
    assert fp8_stock.blockwise_layout(torch.device("cuda")) is not None
    ref = linear_fp8_ref(x.cpu(), q.cpu(), s.cpu()).float().cuda()
    assert float((y.float() - ref).norm() / ref.norm()) < 0.06


# -- the chunk tree (row-parallel layers) -------------------------------------------------------------------
def test_chunk_tree_one_chunk_is_the_fp32_accumulator_and_chunks_add_in_the_tree():
    x, _, q, s = _operands(9, 48, 512, seed=4)
    ops = Ops("deterministic", "cpu", torch.bfloat16)
    one = ops.linear_fp8_tree(x, q, s, 1)
    assert one.dtype == torch.float32 and torch.equal(one, linear_fp8_ref(x, q, s, out_dtype=torch.float32))
    parts = [linear_fp8_ref(x[:, c * 128:(c + 1) * 128], q[:, c * 128:(c + 1) * 128], s[:, c:c + 1],
                            out_dtype=torch.float32) for c in range(4)]
    assert torch.equal(ops.linear_fp8_tree(x, q, s, 4), (parts[0] + parts[1]) + (parts[2] + parts[3]))
    assert torch.equal(ops.linear_fp8_tree(x, q, s, 4)[2:5], ops.linear_fp8_tree(x[2:5], q, s, 4))
    with pytest.raises(ValueError, match="whole 128-column scale blocks"):
        ops.linear_fp8_tree(x, q, s, 8)  # chunks of 64 columns


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("m", [1, 100])
def test_gpu_chunk_tree_reads_k_slices_in_place_with_the_same_bits(m):
    """The row-parallel tree hands linear_fp8 K slices of the weight (views with the whole row stride, no copy;
    TMA descriptors over them at M > 64) and the whole tensor's uniform flag: each chunk's partial equals the
    kernel on a contiguous copy of that chunk."""
    if not _fp8_gpu():
        pytest.skip("fp8 tl.dot needs sm89+")
    from detinfer.kernels.chunked_linear import pairwise_tree_sum
    from detinfer.kernels.fp8_linear import linear_fp8

    x, _, q, s = _operands(m, 512, 2048, seed=m)
    x, q, s = x.cuda(), q.cuda(), s.cuda()
    ops = Ops("deterministic", "cuda", torch.bfloat16)
    parts = [linear_fp8(x[:, c * 512:(c + 1) * 512].contiguous(), q[:, c * 512:(c + 1) * 512].contiguous(),
                        s[:, c * 4:(c + 1) * 4].contiguous(), out_dtype=torch.float32) for c in range(4)]
    assert torch.equal(ops.linear_fp8_tree(x, q, s, 4), pairwise_tree_sum(torch.stack(parts)))


# -- activation quantization for cuBLASLt, per-tensor caches, tile configs --------------------------------------------
def test_padded_outer_major_quantization_off_the_gpu_is_the_zero_padded_one():
    from detinfer.kernels.fp8_linear import quantize_activations_gpu

    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(3)).bfloat16()
    q, s = quantize_activations_gpu(x, rows=16, scales_outer=True)
    q_ref, s_ref = quantize_activations(torch.cat((x, x.new_zeros(11, 300))))
    assert s.stride() == (1, 16) and torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    with pytest.raises(ValueError, match="rows=4 is below"):
        quantize_activations_gpu(x, rows=4)
    q8, s8 = torch.empty(5, 300, dtype=q.dtype), torch.empty(5, 3)  # written in place, returned
    got = quantize_activations_gpu(x, out=(q8, s8))
    q_ref, s_ref = quantize_activations(x)
    assert got[0] is q8 and got[1] is s8 and torch.equal(s8, s_ref)
    assert torch.equal(q8.view(torch.uint8), q_ref.view(torch.uint8))
    with pytest.raises(ValueError, match=r"out must be fp8 values \[5, 300\]"):
        quantize_activations_gpu(x, out=(q8, torch.empty(5, 2)))


def test_fast_mode_block_scales_are_built_once_per_tensor_and_version():
    """Fast mode lays a weight's block scales out at its first call and reuses them while the same tensor
    is unchanged; an in-place update (a weight push) or another tensor gets its own layout."""
    from detinfer.kernels.fp8_stock import _block_scales

    _, s = quantize_weight_rows(torch.randn(256, 640, generator=torch.Generator().manual_seed(1)))
    first = _block_scales(s, "cols")
    assert _block_scales(s, "cols") is first
    assert first.shape == (8, 2) and first.stride() == (1, 8)  # 5 K blocks padded to 8, transposed
    assert torch.equal(first[:5], s[::128].t()) and torch.equal(first[5:], torch.ones(3, 2))
    assert torch.equal(_block_scales(s, "rows"), s[::128])
    s.mul_(2)  # in place: a new version
    again = _block_scales(s, "cols")
    assert again is not first and torch.equal(again[:5], s[::128].t())
    other = s.clone()
    assert _block_scales(other, "cols") is not again
    with torch.inference_mode():  # an engine's weights: inference tensors, no version counter
        frozen = s.clone()
    with torch.inference_mode():
        assert _block_scales(frozen, "cols") is _block_scales(frozen, "cols")


def test_ref_is_one_fma_per_k_block_in_order():
    """acc = fma(exact block dot as fp32, sx * sw, acc) from 0.0, block by block (fp8_linear's module doc)."""
    x, _, q, s = _operands(6, 40, 700, seed=3)  # a partial last K block
    x_q, sx = quantize_activations(x)
    acc = torch.zeros(6, 40)
    for kb in range(-(-700 // BLOCK)):
        c = slice(kb * BLOCK, (kb + 1) * BLOCK)
        part = (x_q[:, c].double() @ q[:, c].double().t()).float()
        acc = (part.double() * (sx[:, kb:kb + 1] * s[:, kb][None, :]).double() + acc.double()).float()
    assert torch.equal(linear_fp8_ref(x, q, s, out_dtype=torch.float32), acc)


def test_ref_long_k_is_two_runs_each_a_chain_then_added(monkeypatch):
    """From SPLIT_MIN_BLOCKS K blocks on, blocks [0, H) and [H, KB) (H = ceil(KB / 2)) are two fma chains from
    0.0, added in fp32; a function of K alone (fp8_linear's module doc). The threshold is lowered to 16 here
    to keep the operands small; the GPU tests run the real one."""
    from detinfer.kernels import fp8_linear
    from detinfer.kernels.fp8_linear import second_run_start

    assert fp8_linear.SPLIT_MIN_BLOCKS == 64
    assert [second_run_start(kb) for kb in (1, 63, 64, 65, 96)] == [1, 63, 32, 33, 48]
    monkeypatch.setattr(fp8_linear, "SPLIT_MIN_BLOCKS", 16)
    k = 17 * BLOCK - 50  # 17 blocks, the last one partial: runs of 9 and 8
    x, _, q, s = _operands(5, 24, k, seed=4)
    x_q, sx = quantize_activations(x)

    def chain(blocks):
        acc = torch.zeros(5, 24)
        for kb in blocks:
            c = slice(kb * BLOCK, (kb + 1) * BLOCK)
            part = (x_q[:, c].double() @ q[:, c].double().t()).float()
            acc = (part.double() * (sx[:, kb:kb + 1] * s[:, kb][None, :]).double() + acc.double()).float()
        return acc

    runs = chain(range(9)) + chain(range(9, 17))
    assert torch.equal(linear_fp8_ref(x, q, s, out_dtype=torch.float32), runs)
    assert not torch.equal(runs, chain(range(17)))  # the runs are part of the numerics


def test_uniform_block_rows_is_true_for_whole_blocks_and_cached_per_tensor():
    from detinfer.kernels.fp8_linear import uniform_block_rows

    _, _, q, s = _operands(1, 300, 256, seed=1)  # two whole 128-row blocks and a partial one
    assert uniform_block_rows(s) is True and uniform_block_rows(s) is True
    _, _, _, s64 = _operands(1, 64, 256, seed=2)  # fused parts of 64 rows: a 128-row group holds two scales
    fused = torch.cat((s64, s64 * 2))
    assert uniform_block_rows(fused) is False
    fused.copy_(torch.cat((s64, s64)))  # in place: a new version, checked again
    assert uniform_block_rows(fused) is True
    assert uniform_block_rows(s[:0]) is True


@pytest.mark.parametrize("m", [1, 7, 70])
def test_interpreter_every_tile_config_and_scale_path_gives_the_same_bits(m, monkeypatch):
    """The tile config may follow M because it changes no element's operations (kernels/fp8_tiles.py); here
    on Triton's CPU interpreter (its fp8 dot is not the GPU's, so this checks the kernel's indexing; the GPU
    test below checks the bits)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from detinfer.kernels.fp8_linear import _LARGE, _SMALL, linear_fp8

    x, _, q, s = _operands(m, 256, 640, seed=m, dtype=torch.float32)  # 5 K blocks: a pair loop's odd tail
    bias = torch.randn(256)
    outs = [linear_fp8(x, q, s, bias, config=dict(cfg, BLOCK_K=BLOCK, PAIRED=paired), uniform=u)
            for cfg in (_SMALL, _LARGE) for paired in (True, False) for u in (True, False)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert torch.allclose(outs[0], linear_fp8_ref(x, q, s, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m", [1, 9])
def test_interpreter_the_two_k_runs_in_one_program_or_two_give_the_same_bits(m, monkeypatch):
    """17 K blocks (the threshold lowered to 16): runs of 9 and 8 (a pair loop's odd tail in the first), in one
    program (SPLIT 1) or a program each plus the summing launch (SPLIT 2), under each tile config (Triton's
    interpreter: the indexing; the GPU test checks the bits at the real threshold)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from detinfer.kernels import fp8_linear
    from detinfer.kernels.fp8_linear import _LARGE, _SMALL, linear_fp8

    monkeypatch.setattr(fp8_linear, "SPLIT_MIN_BLOCKS", 16)
    x, _, q, s = _operands(m, 192, 17 * BLOCK, seed=m, dtype=torch.float32)
    bias = torch.randn(192)
    outs = [linear_fp8(x, q, s, bias, config=dict(cfg, BLOCK_K=BLOCK, PAIRED=paired, SPLIT=split))
            for cfg in (_SMALL, _LARGE) for paired in (True, False) for split in (1, 2)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    ref = linear_fp8_ref(x, q, s, bias)
    assert torch.allclose(outs[0], ref, rtol=1e-5, atol=1e-4)


def test_a_run_placement_that_does_not_exist_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from detinfer.kernels import fp8_linear
    from detinfer.kernels.fp8_linear import _SMALL, linear_fp8

    monkeypatch.setattr(fp8_linear, "SPLIT_MIN_BLOCKS", 2)
    x, _, q, s = _operands(2, 64, 2 * BLOCK, seed=1, dtype=torch.float32)
    with pytest.raises(ValueError, match="SPLIT=3"):
        linear_fp8(x, q, s, config=dict(_SMALL, BLOCK_K=BLOCK, SPLIT=3))


def test_interpreter_a_tile_wider_than_a_scale_group_takes_the_per_element_path(monkeypatch):
    """uniform=True says each 128-row group shares its scales; a 256-wide tile spans two groups, so the
    launcher must not read one scale for it (caught by the GPU sweep's bit check)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from detinfer.kernels.fp8_linear import _LARGE, _SMALL, linear_fp8

    x, _, q, s = _operands(3, 256, 256, seed=5, dtype=torch.float32)
    s = s * torch.tensor([1.0, 3.0]).repeat_interleave(128)[:, None]  # two groups, two scales
    wide = linear_fp8(x, q, s, config=dict(_LARGE, BLOCK_N=256, BLOCK_K=BLOCK, TMA=False), uniform=True)
    assert torch.equal(wide, linear_fp8(x, q, s, config=dict(_SMALL, BLOCK_K=BLOCK), uniform=False))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("m", [1, 7, 33, 64, 65, 128, 129, 300, 2049])
@pytest.mark.parametrize("n,k", [(512, 2048), (4096, 4096), (1000, 700), (320, 384), (384, 8320)])
def test_every_tile_config_load_path_and_scale_path_gives_the_same_bits_on_gpu(m, n, k):
    """Small / large tiles, one or two K blocks per iteration, TMA or pointer loads, the per-tile or per-element
    scale product, the two K runs (K >= 16 blocks) in one program or two: where the work goes, never what an
    element computes (kernel_config and the run placement may therefore follow M). (320, 384): fused parts of
    64 rows, so the scales are not uniform per 128 rows and only the per-element path is right, and 3 K
    blocks (a pair loop's leftover one); (1000, 700): a partial last block; (384, 8320): 65 blocks, two K runs
    (33 and 32 blocks)."""
    if not _fp8_gpu():
        pytest.skip("fp8 tl.dot needs sm89+")
    from detinfer.kernels.fp8_linear import _LARGE, _SMALL, linear_fp8, uniform_block_rows

    x, _, q, s = _operands(m, n, k, seed=m + n)
    if n == 320:  # five parts of 64 rows, each its own scales
        s = torch.cat([s[i * 64:(i + 1) * 64] * (i + 1) for i in range(5)])
    x, q, s, bias = x.cuda(), q.cuda(), s.cuda(), torch.randn(n, device="cuda").to(torch.bfloat16)
    paths = [True, False] if uniform_block_rows(s) else [False]
    splits = (1, 2) if k >= 64 * BLOCK else (None,)
    outs = [linear_fp8(x, q, s, bias, config=dict(cfg, BLOCK_K=BLOCK, TMA=tma, PAIRED=paired, SPLIT=sp),
                       uniform=u)
            for cfg in (_SMALL, _LARGE) for tma in (True, False) for paired in (True, False) for u in paths
            for sp in splits]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert torch.equal(outs[0], linear_fp8(x, q, s, bias))
    ref = linear_fp8_ref(x.cpu(), q.cpu(), s.cpu(), bias.cpu()).float()
    assert float((outs[0].float().cpu() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.gpu
@cuda
@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 300), k=st.integers(1, 1000), scale=st.sampled_from([1e-30, 1e-3, 1.0, 3e4]),
       seed=st.integers(0, 1000))
def test_gpu_activation_quantization_equals_torchs_bitwise(m, k, scale, seed):
    from detinfer.kernels.fp8_linear import quantize_activations_gpu

    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16).cuda()
    x[0, : k // 2] = 0  # an all-zero group where k >= 256
    q, s = quantize_activations_gpu(x)
    q_ref, s_ref = quantize_activations(x)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    pad = -m % 16  # fast mode's layout: rows padded as zero rows, scales outer-dim-major
    q, s = quantize_activations_gpu(x, rows=m + pad, scales_outer=True)
    q_ref, s_ref = quantize_activations(torch.cat((x, x.new_zeros(pad, k))))
    assert s.stride() == (1, m + pad)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    q8, s8 = torch.empty_like(q[:m]), torch.full((m, s.shape[1]), -1.0, device=x.device)  # into given buffers
    quantize_activations_gpu(x, out=(q8, s8))
    q_ref, s_ref = quantize_activations(x)
    assert torch.equal(q8.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s8, s_ref)
