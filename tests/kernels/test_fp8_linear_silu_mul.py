"""Ops.linear_fp8_silu_mul (the dense FP8 MLP's gate_up projection + SiLU*mul): exactly `linear_fp8` then
`silu_mul` in every mode and on every device (a fused one-launch Triton kernel was measured slower than the two
launches at every batch size on an H100, docs/performance.md, and removed), and the MLP's choice of it."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.kernels.fp8_quant import dequantize_weight, quantize_weight_rows
from detinfer.kernels.fp8_stock import linear_fp8_stock
from detinfer.ops import Ops


def _operands(m, i, k, seed, bias=False, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    w = torch.randn(2 * i, k, generator=g) / math.sqrt(k)  # gate/up of a few units: silu's whole range
    q, s = quantize_weight_rows(w)
    b = (torch.randn(2 * i, generator=g) * 0.5).to(dtype) if bias else None
    return x, q, s, b


@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 9), i=st.integers(1, 150), k=st.integers(1, 400), bias=st.booleans(),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), seed=st.integers(0, 2 ** 16))
def test_the_op_is_linear_fp8_then_silu_mul_bitwise(m, i, k, bias, dtype, seed):
    x, q, s, b = _operands(m, i, k, seed, bias, dtype)
    for ops in (Ops("deterministic", "cpu", dtype), Ops("fast", "cpu", dtype)):
        gate, up = ops.linear_fp8(x, q, s, b).split(i, dim=-1)
        out = ops.linear_fp8_silu_mul(x, q, s, b)
        assert out.shape == (m, i) and torch.equal(out, ops.silu_mul(gate, up)), ops.mode
    fast = Ops("fast", "cpu", dtype).linear_fp8_silu_mul(x, q, s, b)
    assert torch.equal(fast, Ops("fast", "cpu", dtype).silu_mul(*linear_fp8_stock(x, q, s, b).split(i, dim=-1)))


def test_an_odd_gate_up_row_count_is_named():
    x, q, s, _ = _operands(3, 8, 256, seed=0)
    with pytest.raises(ValueError, match="odd row count 15"):
        Ops("deterministic", "cpu", torch.bfloat16).linear_fp8_silu_mul(x, q[:15], s[:15])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU with fp8 tensor cores (sm89+)")
@pytest.mark.parametrize("m", [1, 7, 300])
def test_the_op_on_gpu_is_the_two_kernels_bitwise(m):
    from detinfer.kernels.fp8_linear import linear_fp8
    from detinfer.kernels.silu_mul import silu_mul

    x, q, s, b = (t.cuda() for t in _operands(m, 96, 512, seed=m, bias=True))
    gate, up = linear_fp8(x, q, s, b).split(96, dim=-1)
    assert torch.equal(Ops("deterministic", "cuda", torch.bfloat16).linear_fp8_silu_mul(x, q, s, b), silu_mul(gate, up))


def test_the_dense_fp8_mlp_runs_the_fp8_op_and_a_16bit_one_does_not():
    """models/transformer.py's MLP: an FP8 gate_up goes through `Ops.linear_fp8_silu_mul`, a 16-bit one (a
    linear left unquantized) through `linear_silu_mul`."""
    import dataclasses

    from detinfer.models.config import ModelConfig
    from detinfer.models.random_weights import random_state
    from detinfer.models.testing import tiny_config_dict
    from detinfer.models.transformer import MLP

    calls = []

    @dataclasses.dataclass(frozen=True)
    class Spy(Ops):
        def linear_fp8_silu_mul(self, *args):
            calls.append("fp8")
            return super().linear_fp8_silu_mul(*args)

        def linear_silu_mul(self, *args):
            calls.append("16-bit")
            return super().linear_silu_mul(*args)

    config = dataclasses.replace(ModelConfig.from_dict(tiny_config_dict("LlamaForCausalLM")), quantization="fp8")
    state = random_state(config, seed=1, dtype=torch.float32, device="cpu")
    mlp = MLP(config)
    mlp.load_state_dict({k.removeprefix("layers.0.mlp."): v for k, v in state.items()
                         if k.startswith("layers.0.mlp.")}, assign=True)
    x = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(0))
    ops = Spy("deterministic", "cpu", torch.float32)
    proj = mlp.gate_up_proj
    want = ops.linear_fp8(ops.silu_mul(*ops.linear_fp8(x, proj.weight, proj.weight_scale).split(
        config.intermediate_size, -1)), mlp.down_proj.weight, mlp.down_proj.weight_scale)
    assert torch.equal(mlp(x, ops), want) and calls == ["fp8"]
    proj.weight_scale, proj.weight = None, torch.nn.Parameter(dequantize_weight(proj.weight, state[
        "layers.0.mlp.gate_up_proj.weight_scale"]), requires_grad=False)
    calls.clear()
    mlp(x, ops)
    assert calls == ["16-bit"]
