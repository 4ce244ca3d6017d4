"""qk_norm_rope_write_kv (the attention prologue with the paged KV write folded into its launch): the rotated
q it returns and every byte of both caches equal the two separate launches (`qk_norm_rope`, then `write_kv`
of its k and of v), bitwise, on NaN-poisoned pools (a slot not named, or named -1, stays NaN); the Ops
dispatch picks the one launch exactly where both kernels would run; bad input is refused as write_kv
refuses it; and on the GPU the same bits in bf16/fp16/fp32, in both modes' dispatch."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.kernels import rope_qk
from detinfer.kernels._launch import interpreting
from detinfer.kernels.kv_write import write_kv
from detinfer.kernels.rope_qk import qk_norm_rope, qk_norm_rope_write_kv
from detinfer.ops import Ops

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
interpreter_only = pytest.mark.skipif(not interpreting(), reason="CPU kernels need TRITON_INTERPRET=1")


def inv_freq_for(d: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(torch.float32) / d))


def make_case(t, hq, hkv, d, norm, seed, dtype=torch.float32, device=DEV, max_pos=4096):
    """q, k, v as views into one [T, (Hq + 2 Hkv) D] projection output (the model's layout)."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 3).to(dtype).to(device)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    pos = torch.randint(0, max_pos, (t,), generator=g).to(device)
    w = [(1 + 0.1 * torch.randn(d, generator=g)).to(dtype).to(device) for _ in range(2)] if norm else [None, None]
    return dict(positions=pos, q=q, k=k, v=v, inv_freq=inv_freq_for(d).to(device), q_weight=w[0], k_weight=w[1],
                eps=1e-6)


def pools(num_blocks, block_size, hkv, d, dtype, device=DEV):
    k = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype, device=device)
    return k, torch.full_like(k, float("nan"))


def random_slots(t, n_slots, holes, g, device=DEV):
    slots = torch.randperm(n_slots, generator=g)[:t]
    slots[torch.rand(t, generator=g) < holes] = -1  # padded rows of a captured batch
    return slots.to(device)


def separate(case, slots, kc, vc):
    """The unfused path: the prologue kernel, then the KV-write kernel of its k and of v."""
    c = case
    q, k = qk_norm_rope(c["positions"], c["q"], c["k"], c["inv_freq"], c["q_weight"], c["k_weight"], c["eps"])
    write_kv(k, c["v"], kc, vc, slots)
    return q, k


def assert_same_bits(got: torch.Tensor, want: torch.Tensor):
    # Through an integer view: NaN == NaN and -0.0 != 0.0, every bit compared.
    assert got.dtype == want.dtype and got.shape == want.shape
    iview = {2: torch.int16, 4: torch.int32}[got.element_size()]
    assert torch.equal(got.contiguous().view(iview), want.contiguous().view(iview))


# Kernel dtypes the interpreter computes correctly (its bf16 math is not); bf16 runs in the GPU test.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])
SHAPES = st.sampled_from([(4, 2), (2, 2), (3, 1), (8, 1), (6, 3)])  # (Hq, Hkv): GQA groups, MHA, MQA


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 40), SHAPES, st.sampled_from([8, 16, 64]), st.booleans(), st.sampled_from([1, 4, 16]),
       st.sampled_from([torch.int32, torch.int64]), st.booleans(), st.sampled_from(DTYPES), st.data())
def test_fused_write_equals_the_two_launches(t, heads, d, norm, block_size, slot_dtype, return_k, dtype, data):
    hq, hkv = heads
    seed = data.draw(st.integers(0, 2**16), label="seed")
    g = torch.Generator().manual_seed(seed)
    case = make_case(t, hq, hkv, d, norm, seed, dtype)
    num_blocks = -(-t // block_size) + data.draw(st.integers(0, 3), label="spare blocks")
    slots = random_slots(t, num_blocks * block_size, data.draw(st.sampled_from([0.0, 0.3])), g).to(slot_dtype)
    kc, vc = pools(num_blocks, block_size, hkv, d, dtype)
    want_q, want_k = separate(case, slots, kc, vc)
    fc, fv = pools(num_blocks, block_size, hkv, d, dtype)
    got_q, got_k = qk_norm_rope_write_kv(**case, k_cache=fc, v_cache=fv, slot_mapping=slots, return_k=return_k)
    assert got_q.is_contiguous()
    assert_same_bits(got_q, want_q)
    assert_same_bits(fc, kc)
    assert_same_bits(fv, vc)
    if return_k:
        assert_same_bits(got_k, want_k)
    else:
        assert got_k is None
    assert int((~fc[..., 0, 0].isnan()).sum()) == int((slots >= 0).sum())  # the holes wrote nothing
    # A slice of the tokens: its q rows are the full launch's, and it writes exactly its own slots.
    m = data.draw(st.integers(0, t - 1), label="m")
    n = data.draw(st.integers(m + 1, t), label="n")
    sc, sv = pools(num_blocks, block_size, hkv, d, dtype)
    part = {key: (x[m:n] if key in ("positions", "q", "k", "v") else x) for key, x in case.items()}
    part_q, _ = qk_norm_rope_write_kv(**part, k_cache=sc, v_cache=sv, slot_mapping=slots[m:n])
    assert_same_bits(part_q, got_q[m:n])
    kept = slots[m:n][slots[m:n] >= 0].long()
    assert_same_bits(sc.view(-1, hkv, d)[kept], fc.view(-1, hkv, d)[kept])
    assert int((~sc[..., 0, 0].isnan()).sum()) == kept.numel()


def test_contiguous_and_strided_inputs_write_the_same_bits():
    case = make_case(7, 4, 2, 16, True, 3)
    slots = torch.tensor([5, -1, 0, 9, 2, 11, -1], device=DEV)
    kc, vc = pools(3, 4, 2, 16, torch.float32)
    q1, _ = qk_norm_rope_write_kv(**case, k_cache=kc, v_cache=vc, slot_mapping=slots)
    packed = {key: (x.contiguous() if key in ("q", "k", "v") else x) for key, x in case.items()}
    kc2, vc2 = pools(3, 4, 2, 16, torch.float32)
    q2, _ = qk_norm_rope_write_kv(**packed, k_cache=kc2, v_cache=vc2, slot_mapping=slots)
    assert not case["v"].is_contiguous()
    for got, want in ((q1, q2), (kc, kc2), (vc, vc2)):
        assert_same_bits(got, want)


def _ops_case(ops, d=64, norm=True):
    case = make_case(9, 4, 2, d, norm, 5, device="cpu")
    slots = torch.tensor([3, 0, -1, 7, 12, 1, -1, 30, 8])
    fused_pools, plain_pools = pools(8, 4, 2, d, torch.float32, "cpu"), pools(8, 4, 2, d, torch.float32, "cpu")
    got = ops.qk_norm_rope_write_kv(**case, k_cache=fused_pools[0], v_cache=fused_pools[1], slot_mapping=slots)
    q, k = ops.qk_norm_rope(case["positions"], case["q"], case["k"], case["inv_freq"], case["q_weight"],
                            case["k_weight"], case["eps"])
    ops.write_kv(k, case["v"], *plain_pools, slots)
    assert_same_bits(got, q)
    for a, b in zip(fused_pools, plain_pools):
        assert_same_bits(a, b)


@interpreter_only
@pytest.mark.parametrize("mode", ["deterministic", "fast"])
@pytest.mark.parametrize("norm", [True, False])
def test_ops_fuses_exactly_where_both_kernels_run(monkeypatch, mode, norm):
    calls = []
    real = rope_qk.qk_norm_rope_write_kv
    monkeypatch.setattr(rope_qk, "qk_norm_rope_write_kv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    # Both kernels run (dense kernels under the interpreter switch, attention kernel at head_dim 64): fused.
    _ops_case(Ops(mode, head_dim=64, cpu_triton=True), norm=norm)
    assert len(calls) == 1
    # One side on its torch definition: the two calls, as before.
    _ops_case(Ops(mode, head_dim=64), norm=norm)  # the prologue's CPU composition + the write kernel
    _ops_case(Ops(mode, head_dim=64, cpu_triton=True, attention="ref"), norm=norm)  # kernel + write_kv_ref
    _ops_case(Ops(mode, head_dim=16, cpu_triton=True), d=16, norm=norm)  # no attention kernel at head_dim 16
    assert len(calls) == 1
    # A step longer than FUSED_KV_WRITE_MAX_TOKENS (9 tokens here): the two launches, same bits.
    monkeypatch.setattr(rope_qk, "FUSED_KV_WRITE_MAX_TOKENS", 8)
    _ops_case(Ops(mode, head_dim=64, cpu_triton=True), norm=norm)
    assert len(calls) == 1


def test_reference_backend_is_the_two_reference_calls():
    """On CPU without the interpreter switches: qk_norm_rope's torch composition, then write_kv_ref."""
    _ops_case(Ops(attention="ref", head_dim=64))


@pytest.mark.parametrize("change, error, match", [
    (dict(v=torch.zeros(3, 1, 8)), ValueError, "k and v"),
    (dict(k_cache=torch.zeros(2, 4, 2, 8, dtype=torch.float16)), TypeError, "one dtype"),
    (dict(k_cache=torch.zeros(2, 4, 1, 8), v_cache=torch.zeros(2, 4, 1, 8)), ValueError, "do not match"),
    (dict(slot_mapping=torch.tensor([0, 8, 1])), ValueError, "slots"),  # past the pool (8 slots)
    (dict(slot_mapping=torch.tensor([2, 2, -1])), ValueError, "twice"),
    (dict(slot_mapping=torch.tensor([0, 1])), ValueError, "slot_mapping"),
    (dict(positions=torch.zeros(2, dtype=torch.int64)), ValueError, "positions"),
    (dict(k_weight=None), ValueError, "both"),
])
def test_bad_input_is_a_clear_error(change, error, match):
    case = make_case(3, 2, 2, 8, True, 1, device="cpu")
    kc, vc = pools(2, 4, 2, 8, torch.float32, "cpu")
    args = case | dict(k_cache=kc, v_cache=vc, slot_mapping=torch.tensor([0, 5, -1])) | change
    args = {key: (x.to(DEV) if isinstance(x, torch.Tensor) else x) for key, x in args.items()}
    with pytest.raises(error, match=match):
        qk_norm_rope_write_kv(**args)


def test_out_of_pool_slot_without_validation_is_skipped():
    case = make_case(3, 2, 2, 8, False, 2)
    kc, vc = pools(2, 4, 2, 8, torch.float32)
    qk_norm_rope_write_kv(**case, k_cache=kc, v_cache=vc, slot_mapping=torch.tensor([0, 8, -5], device=DEV),
                          validate=False)
    assert int((~kc[..., 0].isnan()).sum()) == int((~vc[..., 0].isnan()).sum()) == 2  # slot 0, both heads


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("hq, hkv, d", [(32, 8, 128), (16, 8, 64), (8, 1, 256), (40, 8, 128)])
@pytest.mark.parametrize("t", [1, 3, 300])
def test_gpu_fused_equals_the_two_launches(dtype, norm, hq, hkv, d, t):
    """The real compiled kernels: the q/k tile, its sums and the stores are those of the plain launch."""
    case = make_case(t, hq, hkv, d, norm, 11, dtype, "cuda", max_pos=40000)
    g = torch.Generator().manual_seed(t)
    block_size, num_blocks = 16, -(-t // 16) + 2
    slots = random_slots(t, num_blocks * block_size, 0.2 if t > 1 else 0.0, g, "cuda")
    kc, vc = pools(num_blocks, block_size, hkv, d, dtype, "cuda")
    want_q, want_k = separate(case, slots, kc, vc)
    fc, fv = pools(num_blocks, block_size, hkv, d, dtype, "cuda")
    got_q, got_k = qk_norm_rope_write_kv(**case, k_cache=fc, v_cache=fv, slot_mapping=slots, return_k=True)
    for got, want in ((got_q, want_q), (got_k, want_k), (fc, kc), (fv, vc)):
        assert_same_bits(got, want)
    for mode in ("deterministic", "fast"):  # the Ops dispatch on CUDA takes the fused launch in both modes
        oc, ov = pools(num_blocks, block_size, hkv, d, dtype, "cuda")
        via_ops = Ops(mode, "cuda", dtype, head_dim=d).qk_norm_rope_write_kv(
            **case, k_cache=oc, v_cache=ov, slot_mapping=slots, validate=False)
        for got, want in ((via_ops, want_q), (oc, kc), (ov, vc)):
            assert_same_bits(got, want)
