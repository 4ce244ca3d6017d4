"""The numerics backend `Ops`: the selection rule (one place), each op's route, and switching a model's
backend without touching its weights."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from detinfer.kernels import matmul, rmsnorm, softmax
from detinfer.kernels._launch import KERNEL_DTYPES, SUPPORTED_HEAD_DIMS, interpreting
from detinfer.kernels.activations import silu_cpu
from detinfer.ops import Ops


def test_selection_rule():
    cpu = Ops("deterministic", "cpu", torch.float32, head_dim=64)
    assert cpu.dense_kernel_dtypes == frozenset()  # CPU dense ops: the fold-based refs
    assert cpu.attention_impl == ("kernel" if interpreting() else "ref")  # CI tests the attention kernels
    assert Ops("deterministic", "cpu", torch.float32, head_dim=8).attention_impl == "ref"  # no kernel for 8
    assert Ops("fast", "cpu", torch.bfloat16, head_dim=64).attention_impl == "ref"  # interpreter bf16 is wrong
    assert Ops("deterministic", "cpu", torch.float64, head_dim=128).attention_impl == "ref"
    gpu = Ops("deterministic", "cuda", torch.bfloat16, head_dim=128)  # choosing needs no GPU
    assert gpu.dense_kernel_dtypes == frozenset(KERNEL_DTYPES) and gpu.attention_impl == "kernel"
    assert Ops("fast", "cuda", torch.float64, head_dim=128).attention_impl == "ref"
    assert Ops(device="cuda", head_dim=128, attention="ref").attention_impl == "ref"
    if interpreting():
        assert Ops(cpu_triton=True).dense_kernel_dtypes == {torch.float32, torch.float16}


@pytest.mark.parametrize("kwargs, match", [
    (dict(mode="exact"), "mode must be one of"),
    (dict(attention="x"), "attention_backend must be one of"),
    (dict(head_dim=16, attention="kernel"), "head_dim 16"),
    (dict(dtype=torch.bfloat16, head_dim=64, attention="kernel"), "cannot run here"),
])
def test_bad_choices_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Ops(**kwargs)


def test_replace_reselects():
    ops = Ops("deterministic", "cpu", torch.float32, head_dim=64, attention="ref")
    fast = ops.replace(mode="fast")
    assert (fast.mode, fast.device, fast.dtype, fast.attention_impl) == ("fast", ops.device, torch.float32, "ref")
    assert ops.replace(attention="auto").attention_impl == Ops(head_dim=64).attention_impl


def test_cpu_deterministic_ops_are_the_refs_and_fast_ops_are_stock():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(7, 40, generator=g), torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
    det, fast = Ops("deterministic"), Ops("fast")
    assert torch.equal(det.linear(x, w, b), matmul.linear_ref(x, w, b))
    assert torch.equal(det.logits(x, w), matmul.linear_ref(x, w).float())
    assert torch.equal(det.mm(x, w.t()), matmul.matmul_ref(x, w.t()))
    assert torch.equal(det.rms_norm(x, w[0, :40], 1e-6), rmsnorm.rms_norm_ref(x, w[0, :40], 1e-6))
    assert torch.equal(det.log_softmax(x), softmax.log_softmax_ref(x, dtype=torch.float32))
    assert torch.equal(det.silu_mul(x, x), silu_cpu(x) * x)
    assert torch.equal(fast.linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(fast.silu_mul(x, x), F.silu(x) * x)
    assert torch.equal(fast.log_softmax(x), torch.log_softmax(x, -1, dtype=torch.float32))


def test_rope_rows_are_independent():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(9, 4, 16, generator=g), torch.randn(9, 2, 16, generator=g)
    pos = torch.tensor([0, 1, 2, 5, 6, 7, 100, 3, 4])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    rq, rk = Ops().rope(pos, q, k, inv_freq)
    for m, n in ((0, 1), (3, 7), (6, 9)):
        sq, sk = Ops().rope(pos[m:n], q[m:n], k[m:n], inv_freq)
        assert torch.equal(rq[m:n], sq) and torch.equal(rk[m:n], sk)


def test_scan_is_a_cumsum_and_slice_invariant():
    x = torch.randint(-9, 9, (4, 37))
    assert torch.equal(Ops.cumsum(x), torch.cumsum(x, -1))
    y = torch.randn(5, 300, generator=torch.Generator().manual_seed(2))
    assert torch.allclose(Ops.cumsum(y), torch.cumsum(y, -1), rtol=1e-5, atol=1e-5)
    assert torch.equal(Ops.cumsum(y)[1:4], Ops.cumsum(y[1:4]))
    assert torch.equal(Ops.cumsum(y.t(), dim=0), Ops.cumsum(y).t())


def test_set_ops_switches_mode_on_the_same_weights():
    from detinfer.models import ReferenceAttention
    from detinfer.repro.random_model import build_random_model

    det, cfg = build_random_model("tiny", mode="deterministic", dtype=torch.float32, seed=3)
    fast, _ = build_random_model("tiny", mode="fast", dtype=torch.float32, seed=3)
    ids, pos = torch.tensor([5, 9, 17, 3, 3, 200]), torch.arange(6)

    def hidden(model):
        attn = ReferenceAttention(cfg.num_hidden_layers, cfg.softmax_scale)
        attn.begin(["s"], [6])
        return model(ids, pos, attn)

    weights = {name: p.data_ptr() for name, p in det.named_parameters()}
    want_det, want_fast = hidden(det), hidden(fast)
    det.set_ops(det.ops.replace(mode="fast"))
    assert det.ops.mode == "fast" and torch.equal(hidden(det), want_fast)
    det.set_ops(det.ops.replace(mode="deterministic"))
    assert torch.equal(hidden(det), want_det)
    assert weights == {name: p.data_ptr() for name, p in det.named_parameters()}
    with pytest.raises(TypeError, match="ops must be"):
        det.set_ops("fast")
    with pytest.raises(ValueError, match="head_dim"):
        det.set_ops(Ops(head_dim=cfg.head_dim * 2))


def test_choosing_a_backend_does_not_import_triton():
    code = "import sys, detinfer.ops.backend as b; b.Ops('deterministic', 'cpu'); print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_head_dims_are_the_attention_kernels():
    from detinfer.kernels import attention

    assert attention.SUPPORTED_HEAD_DIMS is SUPPORTED_HEAD_DIMS


@pytest.mark.parametrize("mode", ["deterministic", "fast"])
def test_linear_backward_is_decided_by_the_mode(mode):
    """Ops.linear_backward: the fixed-order kernels in deterministic mode, stock matmuls in fast mode; dW in
    fp32, continued into dw_out."""
    from detinfer.kernels.linear_backward import linear_backward

    gen = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(*s, generator=gen) for s in ((37, 24), (40, 24), (37, 40)))
    dx, dw = Ops(mode, "cpu", torch.float32).linear_backward(dy, x, w)
    if mode == "deterministic":
        want_dx, want_dw, _ = linear_backward(dy, x, w, False)
    else:
        want_dx, want_dw = dy @ w, dy.t() @ x
    assert torch.equal(dx, want_dx) and torch.equal(dw, want_dw) and dw.dtype == torch.float32
    continued = dw + dw if mode == "fast" else linear_backward(dy, x, w, False, dw_out=dw.clone())[1]
    assert torch.equal(Ops(mode, "cpu", torch.float32).linear_backward(dy, x, w, dw_out=dw.clone())[1], continued)
