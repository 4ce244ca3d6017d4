"""The warp-specialized FP8 GEMM for prefill sizes (kernels/fp8_prefill_gemm.py): where it runs, and (GPU) the
Triton kernel's bits for every shape class, so the launcher may pick it by M."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.kernels import fp8_prefill_gemm as P
from detinfer.kernels.fp8_linear import (
    kernel_config,
    linear_fp8,
    linear_fp8_quantized,
    quantize_activations_gpu,
    second_run_start,
    uniform_block_rows,
)
from detinfer.kernels.fp8_quant import FP8_DTYPE, num_blocks, quantize_weight_rows, tile_weight


def _operands(m, n, k, seed, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
    q, s = quantize_weight_rows(torch.randn(n, k, generator=g) / math.sqrt(k))
    return x.to(device), q.to(device), s.to(device)


def test_it_takes_nothing_off_a_hopper_gpu():
    """CPU tensors (CI), and rows below MIN_ROWS anywhere: the Triton kernel or the reference runs."""
    a = torch.zeros(P.MIN_ROWS, 256, dtype=FP8_DTYPE)
    w = torch.zeros(256, 256, dtype=FP8_DTYPE)
    y = torch.empty(P.MIN_ROWS, 256, dtype=torch.bfloat16)
    assert not P.available(a.device)
    assert not P.takes(a, w, y, 2, True)
    assert not P.takes(a[:P.MIN_ROWS - 1], w, y[:P.MIN_ROWS - 1], 2, True)


def _hopper_with_gluon():
    if not torch.cuda.is_available() or not P.available(torch.device("cuda", torch.cuda.current_device())):
        pytest.skip("needs a Hopper GPU (compute capability 9.x) and Triton's Gluon")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [512, 700, 1025])
@pytest.mark.parametrize("n,k,layout,bias,out", [
    (1024, 1024, "tiled", False, torch.bfloat16),
    (768, 8320, "tiled", False, torch.bfloat16),  # 65 blocks: two K runs (33 + 32), their chains added
    (4096, 512, "tiled", True, torch.float32),
    (1000, 640, "nk", True, torch.bfloat16),  # [N, K]: a partial last 128-row group, masked columns
])
def test_it_gives_the_triton_kernels_bits(m, n, k, layout, bias, out):
    _hopper_with_gluon()
    x, q, s = _operands(m, n, k, seed=m + n + k)
    w = tile_weight(q) if layout == "tiled" else q
    b = torch.randn(n, device="cuda") if bias else None
    a, sa = quantize_activations_gpu(x)
    kb = num_blocks(k)
    y = torch.empty(m, n, dtype=out, device="cuda")
    assert uniform_block_rows(s) and P.takes(a, w, y, kb, True)
    got = P.gemm(a, sa, w, s, b, y, kb, second_run_start(kb))
    triton_bits = linear_fp8_quantized(a, sa, w, s, b, out, config=kernel_config(m, layout == "tiled"))
    assert torch.equal(got, triton_bits)
    assert torch.equal(linear_fp8_quantized(a, sa, w, s, b, out), got)  # the launcher's own pick
    assert torch.equal(P.gemm(a, sa, w, s, b, torch.empty_like(y), kb, second_run_start(kb)), got)  # again


@pytest.mark.gpu
@settings(max_examples=8, deadline=None)
@given(m=st.integers(1, 1300), a=st.integers(0, 1300), b=st.integers(0, 1300), seed=st.integers(0, 100))
def test_a_slice_equals_the_whole_batch_across_the_two_kernels(m, a, b, seed):
    """A batch of 512+ rows runs this kernel, its slices of fewer the Triton one: the same bits per row."""
    _hopper_with_gluon()
    x, q, s = _operands(m, 768, 1024, seed)
    w = tile_weight(q)
    a, b = sorted((min(a, m), min(b, m)))
    assert torch.equal(linear_fp8(x, w, s)[a:b], linear_fp8(x[a:b], w, s))


@pytest.mark.gpu
def test_a_captured_call_equals_the_eager_one():
    _hopper_with_gluon()
    x, q, s = _operands(600, 512, 1024, seed=5)
    w = tile_weight(q)
    eager = linear_fp8(x, w, s)
    uniform_block_rows(s)  # known before capture (no host sync inside it)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        linear_fp8(x, w, s)  # warm: compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        captured = linear_fp8(x, w, s)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
