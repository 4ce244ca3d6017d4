"""Activations quantized by the kernel that produces them (kernels/fp8_act_quant.py, `QuantizedRows`): the
RMSNorm and SiLU*mul kernels' quantized rows are `quantize_activations` of the 16-bit kernels' outputs
(bitwise on the GPU; the interpreter checks indexing and scales), the FP8 linears take them with the bits of
the 16-bit rows, the backend hands them out only where they feed FP8 linears in deterministic mode, and a
model's logits are the same bits with and without them."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.kernels.fp8_linear import linear_fp8_ref, linear_fp8_tree
from detinfer.kernels.fp8_quant import BLOCK, FP8_DTYPE, QuantizedRows, quantize_activations, quantize_weight_rows
from detinfer.kernels.fp8_stock import linear_fp8_stock
from detinfer.ops import Ops

# the kernels' e4m3 casts compile for sm89+ (Hopper in practice), as the FP8 linear's do
cuda = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
                          reason="needs a CUDA GPU with fp8 (sm89+)")


def _rows(m, d, seed, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, d, generator=g) * 2).to(dtype).to(device)


def _same(a: QuantizedRows, b: QuantizedRows) -> bool:
    return (a.dtype == b.dtype and torch.equal(a.q.view(torch.uint8), b.q.view(torch.uint8))
            and torch.equal(a.scale, b.scale))


# -- QuantizedRows and the linears ---------------------------------------------------------------------------
def test_quantized_rows_are_quantize_activations_and_slice_by_whole_groups():
    x = _rows(3, 300, 0)
    r = QuantizedRows.of(x)
    q, s = quantize_activations(x)
    assert r.shape == (3, 300) and r.dtype == torch.float32 and r.dim() == 2
    assert torch.equal(r.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(r.scale, s)
    assert _same(r.columns(128, 300), QuantizedRows.of(x[:, 128:]))  # a group's scale is its own
    with pytest.raises(ValueError, match="whole 128-column groups"):
        r.columns(64, 300)
    with pytest.raises(ValueError, match=r"fp32 scales \[M, ceil\(K/128\)\]"):
        QuantizedRows(q, s[:, :1], torch.bfloat16)


def test_linears_take_quantized_rows_with_the_bits_of_the_16_bit_rows():
    x = _rows(5, 512, 1, torch.bfloat16)
    w, s = quantize_weight_rows(torch.randn(96, 512, generator=torch.Generator().manual_seed(2)) / 20)
    bias = torch.randn(96).to(torch.bfloat16)
    assert torch.equal(linear_fp8_ref(QuantizedRows.of(x), w, s, bias), linear_fp8_ref(x, w, s, bias))
    assert torch.equal(linear_fp8_tree(linear_fp8_ref, QuantizedRows.of(x), w, s, 4),
                       linear_fp8_tree(linear_fp8_ref, x, w, s, 4))
    with pytest.raises(TypeError, match="linear_fp8_stock: takes the 16-bit rows"):
        linear_fp8_stock(QuantizedRows.of(x), w, s)


def test_backend_quantizes_ahead_only_in_deterministic_mode():
    x, res, weight = _rows(4, 256, 3), _rows(4, 256, 4), _rows(1, 256, 5)[0]
    det, fast = Ops("deterministic", "cpu", torch.float32), Ops("fast", "cpu", torch.float32)
    y, h = det.rms_norm_fp8(x, weight, 1e-6, residual=res)
    y16, h16 = det.rms_norm(x, weight, 1e-6, residual=res)
    assert _same(y, QuantizedRows.of(y16)) and torch.equal(h, h16)
    assert _same(det.rms_norm_fp8(x, weight, 1e-6), QuantizedRows.of(det.rms_norm(x, weight, 1e-6)))
    assert isinstance(fast.rms_norm_fp8(x, weight, 1e-6), torch.Tensor)  # fast mode quantizes in cuBLASLt's layout
    assert isinstance(det.rms_norm_fp8(x[None], weight, 1e-6), torch.Tensor)  # not [M, D]: the 16-bit rows
    w, s = quantize_weight_rows(torch.randn(2 * 384, 256, generator=torch.Generator().manual_seed(6)) / 16)
    plain = det.linear_fp8_silu_mul(x, w, s)
    assert isinstance(plain, torch.Tensor)
    assert _same(det.linear_fp8_silu_mul(x, w, s, quantized=True), QuantizedRows.of(plain))
    assert isinstance(fast.linear_fp8_silu_mul(x, w, s, quantized=True), torch.Tensor)


# -- the kernels on Triton's CPU interpreter (its fp8 cast is not the GPU's: scales bitwise, values close) ---
def _close_values(got: QuantizedRows, rows: torch.Tensor) -> bool:
    """got's values are torch's quantization of rows, but where torch's value is a power of two or subnormal
    (below 2^-6): the interpreter's e4m3 cast mis-rounds values that round up to a power of two
    (fp8_linear.quantize_activations_gpu) and subnormals. The GPU test asserts every bit."""
    want = QuantizedRows.of(rows).q.float()
    off = want[got.q.float() != want]
    return bool(((torch.frexp(off).mantissa.abs() == 0.5) | (off.abs() < 2.0 ** -6)).all())


@pytest.mark.parametrize("m,d", [(1, 128), (5, 160), (40, 576), (3, 1024), (2, 64)])
@pytest.mark.parametrize("residual,weight", [(True, True), (False, True), (True, False)])
def test_interpreter_norm_kernel_quantizes_the_norms_rows(m, d, residual, weight, monkeypatch):
    """160 and 576: a partial last group (the block's padding columns must not count); 40 rows: several
    programs of several rows; 64: narrower than a group, the norm then its quantization (the same rows)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from detinfer.kernels.fp8_act_quant import rms_norm_quantized
    from detinfer.kernels.rmsnorm import rms_norm

    x, r = _rows(m, d, m + d), _rows(m, d, 7) if residual else None
    w = _rows(1, d, 8)[0] if weight else None
    out, want = rms_norm_quantized(x, w, 1e-5, r), rms_norm(x, w, 1e-5, r)
    (got, h), (y, h16) = (out, want) if residual else ((out, None), (want, None))
    assert residual is False or torch.equal(h, h16)
    assert torch.equal(got.scale, QuantizedRows.of(y).scale) and got.dtype == x.dtype
    assert _close_values(got, y)


@pytest.mark.parametrize("m,n", [(1, 128), (3, 200), (17, 1000), (2, 2048 + 64)])
def test_interpreter_silu_mul_kernel_quantizes_its_rows(m, n, monkeypatch):
    """Gate and up as the strided halves of one projection output; 200 / 1000 / 2112: a partial group, more
    groups than one program's (8)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from detinfer.kernels.fp8_act_quant import silu_mul_quantized
    from detinfer.kernels.silu_mul import silu_mul

    gu = _rows(m, 2 * n, n)
    gate, up = gu.split(n, dim=1)
    got, want = silu_mul_quantized(gate, up), silu_mul(gate, up)
    assert torch.equal(got.scale, QuantizedRows.of(want).scale) and got.dtype == gate.dtype
    assert _close_values(got, want)


def test_kernel_errors_name_the_shapes():
    from detinfer.kernels.fp8_act_quant import rms_norm_quantized, silu_mul_quantized

    with pytest.raises(ValueError, match=r"rms_norm_quantized: x must be \[M, D\]"):
        rms_norm_quantized(torch.zeros(2, 3, 128), None, 1e-6)
    with pytest.raises(ValueError, match="gate and up must be"):
        silu_mul_quantized(torch.zeros(2, 128), torch.zeros(2, 256))


# -- a model: logits with and without the quantized hand-off -------------------------------------------------
def _fp8_model(tmp_path, device):
    from detinfer.models.loader import load_model
    from detinfer.models.testing import write_fp8_checkpoint, write_tiny_checkpoint

    src = write_tiny_checkpoint(tmp_path / "m", "Qwen3ForCausalLM", seed=3, hidden_size=256,
                                intermediate_size=384, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=64, dtype="bfloat16" if device == "cuda" else "float32")
    return load_model(write_fp8_checkpoint(src, tmp_path / "fp8"), device=device)


def _logits_both_ways(model, config, monkeypatch):
    """The logits with the norms and SiLU*mul handing quantized rows to the FP8 linears (counted), then with
    every hand-off in 16 bits (each linear quantizing its input itself)."""
    from detinfer.models import ReferenceAttention
    from detinfer.models.transformer import DecoderLayer

    ids = torch.randint(3, config.vocab_size, (19,), generator=torch.Generator().manual_seed(4))
    ids = ids.to(model.embed_tokens.device)
    calls, norm, silu = [], Ops.rms_norm_fp8, Ops.linear_fp8_silu_mul
    monkeypatch.setattr(Ops, "rms_norm_fp8", lambda self, *a, **k: calls.append(1) or norm(self, *a, **k))

    def logits():
        attn = ReferenceAttention(config.num_hidden_layers, config.softmax_scale)
        return model.compute_logits(model(ids, attn.begin(["s"], [19]), attn))

    fused = logits()
    assert len(calls) == 2 * config.num_hidden_layers  # both norms of every layer handed out quantized rows
    monkeypatch.setattr(DecoderLayer, "fp8_inputs", lambda self: (False, False))
    monkeypatch.setattr(Ops, "linear_fp8_silu_mul", lambda self, x, w, s, b=None, quantized=False:
                        silu(self, x, w, s, b))
    return fused, logits()


def test_model_logits_are_the_same_bits_with_quantized_hand_offs_on_cpu(tmp_path, monkeypatch):
    model, config = _fp8_model(tmp_path, "cpu")
    fused, plain = _logits_both_ways(model, config, monkeypatch)
    assert torch.equal(fused, plain)


# -- GPU: the kernels' bits (the engine with and without the hand-offs: tests/engine/test_engine_gpu_fp8.py)
@pytest.mark.gpu
@cuda
@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 300), d=st.sampled_from([128, 576, 896, 2048, 4096, 5120]), residual=st.booleans(),
       weight=st.booleans(), scale=st.sampled_from([1e-3, 1.0, 300.0]), seed=st.integers(0, 1000))
def test_gpu_norm_kernel_rows_are_quantize_activations_of_rms_norm_bitwise(m, d, residual, weight, scale, seed):
    from detinfer.kernels.fp8_act_quant import rms_norm_quantized
    from detinfer.kernels.rmsnorm import rms_norm

    x = _rows(m, d, seed, torch.bfloat16, "cuda") * scale
    x[0, : d // 2] = 0  # zero groups in the first row's norm output
    r = _rows(m, d, seed + 1, torch.bfloat16, "cuda") if residual else None
    w = _rows(1, d, seed + 2, torch.bfloat16, "cuda")[0] if weight else None
    out, want = rms_norm_quantized(x, w, 1e-6, r), rms_norm(x, w, 1e-6, r)
    (got, h), (y, h16) = (out, want) if residual else ((out, None), (want, None))
    assert _same(got, QuantizedRows.of(y))
    assert not residual or torch.equal(h, h16)
    # a row's quantized values alone == inside the batch (row-wise kernel: batch-invariant)
    a = m // 2
    alone = rms_norm_quantized(x[a:a + 1], w, 1e-6, r[a:a + 1] if residual else None)
    alone = alone[0] if residual else alone
    assert torch.equal(alone.q.view(torch.uint8), got.q[a:a + 1].view(torch.uint8))


@pytest.mark.gpu
@cuda
@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 300), n=st.sampled_from([128, 200, 1536, 3000, 12288]), seed=st.integers(0, 1000))
def test_gpu_silu_mul_kernel_rows_are_quantize_activations_of_silu_mul_bitwise(m, n, seed):
    from detinfer.kernels.fp8_act_quant import silu_mul_quantized
    from detinfer.kernels.silu_mul import silu_mul

    gate, up = _rows(m, 2 * n, seed, torch.bfloat16, "cuda").split(n, dim=1)
    got = silu_mul_quantized(gate, up)
    assert _same(got, QuantizedRows.of(silu_mul(gate, up)))
    assert got.q.dtype == FP8_DTYPE and got.scale.shape == (m, math.ceil(n / BLOCK))
