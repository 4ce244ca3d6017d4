"""kernels/rope.py and kernels/activations.py: the one pure-torch definition of the RoPE rotation and of the
position-independent CPU activations. Each is the same bits wherever it is used (Ops, the drop-in mode's
overrides, the models' RotaryEmbedding, the references), a row computed alone equals the same row computed
in a batch, and the RoPE rotation is accurate against float64."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.kernels import activations
from detinfer.kernels.matmul import linear_ref
from detinfer.kernels.moe import expert_outputs_ref
from detinfer.kernels.rope import apply_rope, rope_angles, rotate_pairs
from detinfer.kernels.rope_qk import qk_norm_rope_ref
from detinfer.kernels.silu_mul import silu_mul_ref
from detinfer.kernels.silu_mul_backward import silu_mul_backward_ref
from detinfer.models.config import ModelConfig
from detinfer.models.rope import RotaryEmbedding
from detinfer.models.testing import tiny_config_dict
from detinfer.ops import Ops
from detinfer.ops.aten_impls import CPU_OVERRIDES

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inv_freq(d: int) -> torch.Tensor:
    return 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.int64).to(torch.float32) / d))


def _rope_case(t, hq, hkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(t, hq, d, generator=g) * 3).to(dtype)
    k = (torch.randn(t, hkv, d, generator=g) * 3).to(dtype)
    return torch.randint(0, 1 << 17, (t,), generator=g), q, k, _inv_freq(d)


@settings(max_examples=25, deadline=None)
@given(t=st.integers(1, 24), hq=st.integers(1, 4), hkv=st.integers(1, 2), half=st.integers(1, 32),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_rope_row_slices_equal_the_batch(t, hq, hkv, half, dtype, seed, data):
    pos, q, k, inv = _rope_case(t, hq, hkv, 2 * half, dtype, seed)
    lo = data.draw(st.integers(0, t - 1))
    hi = data.draw(st.integers(lo + 1, t))
    q_all, k_all = apply_rope(pos, q, k, inv)
    q_part, k_part = apply_rope(pos[lo:hi], q[lo:hi], k[lo:hi], inv)
    assert torch.equal(q_all[lo:hi], q_part) and torch.equal(k_all[lo:hi], k_part)
    assert q_all.dtype == dtype and k_all.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_rope_user_gets_the_same_bits(dtype):
    pos, q, k, inv = _rope_case(9, 4, 2, 16, dtype, 5)
    want = apply_rope(pos, q, k, inv)
    cfg = ModelConfig.from_dict(tiny_config_dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2))
    rotary = RotaryEmbedding(cfg)
    assert rotary.inv_freq.shape == inv.shape
    users = {"Ops.rope": Ops("deterministic", torch.device("cpu"), dtype, head_dim=16).rope(pos, q, k, inv),
             "Ops.rope fast": Ops("fast", torch.device("cpu"), dtype, head_dim=16).rope(pos, q, k, inv),
             "qk_norm_rope_ref": qk_norm_rope_ref(pos, q, k, inv),
             "RotaryEmbedding": apply_rope(pos, q, k, rotary.inv_freq)}
    assert torch.equal(rotary(pos, q, k)[0], users["RotaryEmbedding"][0])
    for name, got in users.items():
        assert all(torch.equal(a, b) for a, b in zip(got, want)), name


def test_rope_is_accurate_against_float64():
    pos, q, k, inv = _rope_case(64, 2, 1, 64, torch.float32, 11)
    cos, sin = rope_angles(pos, inv, torch.float64)
    exact = rotate_pairs(q.double(), cos, sin)
    assert rope_angles(pos, inv)[0].dtype == torch.float32
    assert torch.allclose(apply_rope(pos, q, k, inv)[0].double(), exact, rtol=0, atol=1e-4 * q.abs().max())
    assert torch.equal(qk_norm_rope_ref(pos, q.double(), k.double(), inv)[0], exact)


ACTIVATIONS = {"silu": activations.silu_cpu, "sigmoid": activations.sigmoid_cpu, "gelu": activations.gelu_cpu,
               "softplus": activations.softplus_cpu}


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 300), name=st.sampled_from(sorted(ACTIVATIONS)), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**31 - 1), data=st.data())
def test_activations_are_position_independent(n, name, dtype, seed, data):
    """An element's bits do not depend on where it sits (torch's vectorized CPU kernels fail this)."""
    x = (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 8).to(dtype)
    lo = data.draw(st.integers(0, n - 1))
    hi = data.draw(st.integers(lo + 1, n))
    fn = ACTIVATIONS[name]
    assert torch.equal(fn(x)[lo:hi], fn(x[lo:hi]))
    assert torch.equal(fn(x)[lo:hi], fn(x.flip(0)).flip(0)[lo:hi])


def test_the_drop_in_overrides_and_references_use_the_one_silu():
    assert CPU_OVERRIDES == ACTIVATIONS
    g = torch.Generator().manual_seed(3)
    gate, up = torch.randn(5, 40, generator=g), torch.randn(5, 40, generator=g)
    silu = activations.silu_cpu
    assert torch.equal(Ops("deterministic", torch.device("cpu"), torch.float32).silu_mul(gate, up), silu(gate) * up)
    assert torch.equal(silu_mul_ref(gate, up), (silu(gate) * up))
    dgate, dup = silu_mul_backward_ref(torch.ones_like(gate), gate, up)
    assert torch.equal(dup, gate * activations.sigmoid_cpu(gate))
    # the MoE reference's experts: linear_ref(silu(gate) * up, w_down) for each routed (token, expert) pair
    x, w_gate_up, w_down = (torch.randn(shape, generator=g) for shape in ((3, 8), (2, 12, 8), (2, 8, 6)))
    y = expert_outputs_ref(x, torch.tensor([[1], [0], [1]]), w_gate_up, w_down)
    gate_up = linear_ref(x[:1], w_gate_up[1])
    assert torch.equal(y[0, 0], linear_ref(silu(gate_up[:, :6]) * gate_up[:, 6:], w_down[1])[0])
