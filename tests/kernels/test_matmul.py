"""Batch-invariant matmul / bmm / linear (detinfer.kernels.matmul).

Invariance is asserted bitwise (torch.equal); accuracy against a float64 reference with a bound suited to
the dtype, on outputs poisoned with NaN before the launch so that an unwritten element fails.
CPU runs use Triton's interpreter (fp32/fp16 only: its bf16 arithmetic is wrong); bf16, the real model
shapes, every selectable config and the negative controls run on the GPU (marker gpu).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from detinfer.kernels import matmul as mm
from detinfer.kernels import matmul_configs as mc
from detinfer.kernels import matmul_ref
from detinfer.kernels.matmul_configs import MatmulConfig, gpu_configs, pick_from_family, select_config

HAS_CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if HAS_CUDA else "cpu")
# Kernel dtypes testable on this machine (the interpreter's bf16 math is wrong, so bf16 is GPU-only).
KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
UNIT = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
# Value ranges: [-1e3, 1e3] where the output dtype holds K * 1e6; fp16 (max 65504) gets [-4, 4].
SCALE = {torch.float64: 1e3, torch.float32: 1e3, torch.bfloat16: 1e3, torch.float16: 4.0}

# Sizes that are awkward for tiles: 1, 7 and 333 always among the candidates.
SIZES_M = st.one_of(st.sampled_from([1, 7]), st.integers(1, 24))
SIZES_N = st.one_of(st.sampled_from([1, 7, 33]), st.integers(1, 70))
SIZES_K = st.one_of(st.sampled_from([1, 7, 333, 600]), st.integers(1, 600))


def rand(shape, dtype, seed, device=DEV):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) * SCALE[dtype]
    return x.to(dtype).to(device)


def nan_out(shape, dtype, device=DEV):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def assert_accurate(y, a, b_kn, bias=None):
    """|y - exact| within output rounding plus a worst-case fp32 (fp64 for fp64) accumulation bound."""
    a64, b64 = a.double(), b_kn.double()  # fp64 products and sums: exact enough to judge fp32 error
    ref, mag = a64 @ b64, a64.abs() @ b64.abs()
    if bias is not None:
        ref, mag = ref + bias.double(), mag + bias.double().abs()
    u_acc = UNIT[torch.float64] if y.dtype == torch.float64 else UNIT[torch.float32]
    subnormal = torch.finfo(y.dtype).tiny * torch.finfo(y.dtype).eps  # absolute rounding step near 0
    tol = 1.01 * UNIT[y.dtype] * ref.abs() + 2 * (a.shape[-1] + 2) * u_acc * mag + subnormal
    err = (y.double() - ref).abs()
    bad = ~(err <= tol)  # NaN (unwritten, poisoned) fails too
    assert not bad.any(), f"{int(bad.sum())} elements off; worst err {err.max().item():.3g}"


def slice_of(data, m):
    lo = data.draw(st.integers(0, m - 1), label="m")
    hi = data.draw(st.integers(lo + 1, m), label="n")
    return lo, hi


# ------------------------------------------------------------------ Triton kernel: property tests
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@given(m=SIZES_M, k=SIZES_K, n=SIZES_N, with_bias=st.booleans(), seed=st.integers(0, 2**31), data=st.data())
def test_linear_rows_invariant_and_accurate(dtype, m, k, n, with_bias, seed, data):
    x, w = rand((m, k), dtype, seed), rand((n, k), dtype, seed + 1)
    bias = rand((n,), dtype, seed + 2) if with_bias else None
    y = mm.linear(x, w, bias, out=nan_out((m, n), dtype))
    assert_accurate(y, x, w.t(), bias)
    lo, hi = slice_of(data, m)
    assert torch.equal(mm.linear(x[lo:hi], w, bias), y[lo:hi])


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@given(m=SIZES_M, k=SIZES_K, n=SIZES_N, seed=st.integers(0, 2**31), data=st.data())
def test_matmul_rows_invariant_and_accurate(dtype, m, k, n, seed, data):
    a, b = rand((m, k), dtype, seed), rand((k, n), dtype, seed + 1)
    y = mm.matmul(a, b, out=nan_out((m, n), dtype))
    assert_accurate(y, a, b)
    lo, hi = slice_of(data, m)
    assert torch.equal(mm.matmul(a[lo:hi], b), y[lo:hi])


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@given(nb=st.integers(1, 3), m=st.integers(1, 9), k=SIZES_K, n=st.integers(1, 40), seed=st.integers(0, 2**31),
       data=st.data())
def test_bmm_entries_invariant_and_accurate(dtype, nb, m, k, n, seed, data):
    a, b = rand((nb, m, k), dtype, seed), rand((nb, k, n), dtype, seed + 1)
    y = mm.bmm(a, b, out=nan_out((nb, m, n), dtype))
    for z in range(nb):
        assert_accurate(y[z], a[z], b[z])
    z = data.draw(st.integers(0, nb - 1), label="z")
    lo, hi = slice_of(data, m)
    assert torch.equal(mm.matmul(a[z, lo:hi], b[z]), y[z, lo:hi])  # alone == inside the batch
    zlo, zhi = slice_of(data, nb)
    assert torch.equal(mm.bmm(a[zlo:zhi], b[zlo:zhi]), y[zlo:zhi])  # any batch size


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@given(m=st.integers(1, 12), k=SIZES_K, n=st.integers(1, 40), pad=st.integers(1, 100), seed=st.integers(0, 2**31))
def test_zero_extension_of_k_changes_no_bit(dtype, m, k, n, pad, seed):
    """Contract (B): a[:, K:K+p] = 0 and b[K:K+p, :] = 0 leave every output bit as it was."""
    a, b = rand((m, k), dtype, seed), rand((k, n), dtype, seed + 1)
    a_pad = torch.cat([a, torch.zeros(m, pad, dtype=dtype, device=DEV)], 1)
    b_pad = torch.cat([b, torch.zeros(pad, n, dtype=dtype, device=DEV)], 0)
    assert torch.equal(mm.matmul(a_pad, b_pad), mm.matmul(a, b))
    assert torch.equal(mm.linear(a_pad, b_pad.t()), mm.linear(a, b.t()))
    assert torch.equal(mm.matmul_ref(a_pad, b_pad), mm.matmul_ref(a, b))


@pytest.mark.parametrize("persistent", [False, True])
def test_tma_kernel_reads_a_row_major_k_by_n_operand(persistent):
    """B [K, N] with unit stride along N (dX = dY @ W in training) gets a descriptor of its own layout:
    the same tiles and K order, so the pointer kernel's bits."""
    a, b = rand((23, 104), torch.float16, 11), rand((104, 72), torch.float16, 12)  # rows of 208 / 144 B
    ref = nan_out((1, 23, 72), torch.float16)
    mm._launch(a.unsqueeze(0), b.unsqueeze(0), None, ref, MatmulConfig(1, 64, 32, 4, 1))
    assert_accurate(ref[0], a, b)
    tma = MatmulConfig(1, 64, 32, 4, 1, tma=True, persistent=persistent)
    for lo, hi in ((0, 23), (5, 6)):
        out = nan_out((1, hi - lo, 72), torch.float16)
        mm._launch(a[lo:hi].unsqueeze(0), b.unsqueeze(0), None, out, tma)
        assert torch.equal(out, ref[:, lo:hi])


def test_other_tile_shapes_are_accurate_in_the_interpreter():
    """Multi-row tiles (the GPU configs' shapes) exercise the edge clamping and grouped launch order."""
    x, w = rand((45, 130), torch.float32, 5), rand((77, 130), torch.float32, 6)
    bias = rand((77,), torch.float32, 7)
    for cfg in [MatmulConfig(16, 16, 16, 4, 1, group_m=2), MatmulConfig(32, 64, 64, 4, 1)]:
        out = nan_out((1, 45, 77), torch.float32)
        mm._launch(x.unsqueeze(0), w.t().unsqueeze(0), bias, out, cfg)
        assert_accurate(out[0], x, w.t(), bias)


@pytest.mark.parametrize("persistent", [False, True])
def test_tma_kernel_matches_pointer_kernel_in_the_interpreter(persistent):
    """The descriptor (TMA) kernel computes the same tiles in the same K order as the pointer kernel."""
    x, w = rand((23, 104), torch.float16, 8), rand((70, 104), torch.float16, 9)  # rows of 208 B: aligned
    bias = rand((70,), torch.float16, 10)
    assert mm._tma_usable(x, w)
    cfg = MatmulConfig(1, 64, 32, 4, 1)
    ref = _run_cfg(x, w, cfg, bias)
    tma = MatmulConfig(1, 64, 32, 4, 1, tma=True, persistent=persistent)
    assert torch.equal(_run_cfg(x, w, tma, bias), ref)
    assert torch.equal(_run_cfg(x[5:6], w, tma, bias), ref[5:6])
    x_odd = torch.zeros(23, 105, dtype=torch.float16, device=DEV)[:, 1:].copy_(x)  # misaligned rows
    assert not mm._tma_usable(x_odd, w)
    assert torch.equal(_run_cfg(x_odd, w, tma, bias), ref)  # pointer fallback, same bits


# ---------------------------------------------------------------- reference path: property tests
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@given(m=st.one_of(st.sampled_from([1, 7, 333]), st.integers(1, 64)), k=SIZES_K, n=SIZES_N,
       with_bias=st.booleans(), seed=st.integers(0, 2**31), data=st.data())
def test_linear_ref_rows_invariant_and_accurate(dtype, m, k, n, with_bias, seed, data):
    x, w = rand((m, k), dtype, seed, "cpu"), rand((n, k), dtype, seed + 1, "cpu")
    bias = rand((n,), dtype, seed + 2, "cpu") if with_bias else None
    y = mm.linear_ref(x, w, bias)
    assert y.dtype == dtype and y.shape == (m, n)
    assert_accurate(y, x, w.t(), bias)
    lo, hi = slice_of(data, m)
    assert torch.equal(mm.linear_ref(x[lo:hi], w, bias), y[lo:hi])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@given(nb=st.integers(1, 4), m=st.integers(1, 20), k=SIZES_K, n=SIZES_N, seed=st.integers(0, 2**31),
       data=st.data())
def test_bmm_and_matmul_ref_invariant_and_accurate(dtype, nb, m, k, n, seed, data):
    a, b = rand((nb, m, k), dtype, seed, "cpu"), rand((nb, k, n), dtype, seed + 1, "cpu")
    y = mm.bmm_ref(a, b)
    z = data.draw(st.integers(0, nb - 1), label="z")
    assert_accurate(y[z], a[z], b[z])
    lo, hi = slice_of(data, m)
    assert torch.equal(mm.matmul_ref(a[z, lo:hi], b[z]), y[z, lo:hi])
    zlo, zhi = slice_of(data, nb)
    assert torch.equal(mm.bmm_ref(a[zlo:zhi], b[zlo:zhi]), y[zlo:zhi])


def test_ref_row_chunking_changes_no_bit(monkeypatch):
    """Rows are processed in memory-bounded chunks; the chunk size must not matter."""
    x, w = rand((50, 70), torch.float32, 1, "cpu"), rand((90, 70), torch.float32, 2, "cpu")
    y = mm.linear_ref(x, w)
    monkeypatch.setattr(matmul_ref, "REF_MAX_PRODUCTS", 90 * mm.REF_BLOCK_K * 3)  # 3 rows per step
    assert torch.equal(mm.linear_ref(x, w), y)


# --------------------------------------------------------------------------- layouts and edges
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_strided_operands_give_the_same_bits(dtype):
    x, w = rand((9, 70), dtype, 3), rand((33, 70), dtype, 4)
    y = mm.linear(x, w)
    w_t = w.t().contiguous().t()  # [N, K] view of a [K, N] buffer (a transposed weight)
    x_s = torch.zeros(9, 140, dtype=dtype, device=DEV)[:, ::2].copy_(x)  # stride 2 along K
    assert not w_t.is_contiguous() and not x_s.is_contiguous()
    assert torch.equal(mm.linear(x_s, w_t), y)
    assert torch.equal(mm.matmul(x_s, w_t.t()), y)
    assert torch.equal(mm.linear(x.reshape(3, 3, 70), w), y.reshape(3, 3, 33))  # leading dims
    assert torch.equal(mm.linear_ref(x_s.cpu(), w_t.cpu()), mm.linear_ref(x.cpu(), w.cpu()))


@pytest.mark.parametrize("fn", ["kernel", "ref"])
def test_empty_inputs(fn):
    dt = torch.float32
    dev = DEV if fn == "kernel" else torch.device("cpu")
    mmf, bmf, lin = (mm.matmul, mm.bmm, mm.linear) if fn == "kernel" else (mm.matmul_ref, mm.bmm_ref,
                                                                            mm.linear_ref)
    z = lambda *s: torch.zeros(s, dtype=dt, device=dev)
    assert mmf(z(0, 5), z(5, 3)).shape == (0, 3)
    assert bmf(z(2, 0, 5), z(2, 5, 3)).shape == (2, 0, 3)
    assert bmf(z(0, 4, 5), z(0, 5, 3)).shape == (0, 4, 3)
    assert lin(z(0, 5), z(3, 5)).shape == (0, 3)
    assert lin(z(2, 0, 5), z(3, 5), z(3)).shape == (2, 0, 3)
    # K = 0: an empty sum is 0 (then + bias)
    bias = torch.arange(3, dtype=dt, device=dev)
    assert torch.equal(lin(z(4, 0), z(3, 0), bias), bias.expand(4, 3))


def test_bad_inputs_raise_clear_errors(monkeypatch):
    f32 = lambda *s: torch.zeros(s, dtype=torch.float32, device=DEV)
    with pytest.raises(ValueError, match="inner dimensions differ"):
        mm.matmul(f32(3, 4), f32(5, 2))
    with pytest.raises(ValueError, match="2-D operands"):
        mm.matmul(f32(2, 3, 4), f32(4, 2))
    with pytest.raises(ValueError, match="batch sizes differ"):
        mm.bmm(f32(2, 3, 4), f32(3, 4, 2))
    with pytest.raises(ValueError, match="K=4 features"):
        mm.linear(f32(3, 4), f32(2, 5))
    with pytest.raises(ValueError, match=r"bias must have shape \[N\]"):
        mm.linear(f32(3, 4), f32(2, 4), f32(3))
    with pytest.raises(TypeError, match="one dtype"):
        mm.matmul(f32(3, 4), f32(4, 2).half())
    with pytest.raises(TypeError, match="not supported"):
        mm.matmul(f32(3, 4).double(), f32(4, 2).double())
    with pytest.raises(ValueError, match="out must be"):
        mm.matmul(f32(3, 4), f32(4, 2), out=f32(2, 3))
    with pytest.raises(TypeError, match="floating-point"):
        mm.matmul_ref(torch.ones(2, 2, dtype=torch.int32), torch.ones(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="inner dimensions differ"):
        mm.bmm_ref(f32(1, 3, 4).cpu(), f32(1, 5, 2).cpu())
    if not HAS_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            mm.matmul(f32(3, 4), f32(4, 2))
    with pytest.raises(ValueError, match="power of two"):
        MatmulConfig(48, 64, 64, 4, 3)


def test_dispatcher_config_never_depends_on_m_in_the_interpreter():
    """In the interpreter BLOCK_K and the tile are part of the reduction order, so one config for all."""
    cfgs = {select_config(m, 64, 300, dt, interpreter=True) for m in (1, 7, 100, 5000)
            for dt in (torch.float32, torch.float16)}
    assert len(cfgs) == 1


def test_family_rule_and_gpu_tables():
    """The N-tile rule: the largest tile that still gives ~0.7 tiles per SM, else the most tiles."""
    fam = (MatmulConfig(64, 128, 128, 4, 4), MatmulConfig(64, 64, 256, 4, 3), MatmulConfig(64, 32, 256, 4, 4))
    assert pick_from_family(fam, 64, 4096, 132).block_n == 32  # 128 tiles
    assert pick_from_family(fam, 64, 6144, 132).block_n == 64  # 96 tiles
    assert pick_from_family(fam, 64, 128256, 132).block_n == 128
    assert pick_from_family(fam, 1, 100, 132).block_n == 32  # none qualifies: most tiles
    with pytest.raises(ValueError, match="unknown family rule"):
        pick_from_family(fam, 1, 100, 132, rule="fastest")
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        cfgs = gpu_configs(dt)
        assert all(min(c.block_m, c.block_n, c.block_k) >= 16 for c in cfgs)  # tl.dot minimum on a GPU
        for m in (1, 16, 17, 64, 65, 128, 129, 768, 769, 4096, 10**6):
            for n in (1, 64, 333, 4096, 6144, 128256):
                assert select_config(m, n, 4096, dt, interpreter=False) in cfgs


def test_wave_rule_picks_the_measured_winners():
    """M > 64 (16-bit): ceil(tiles / SMs) x area / efficiency. The picks of the run-4 table on an H100 (132
    SMs) for the Llama shapes, each the best or within a few % of the best measured config of its cell."""
    big, mid, row64 = (128, 256), (128, 128), (64, 128)
    want = {  # (M, N) -> (block_m, block_n)
        (1024, 6144): mid,  # 192 big tiles = 1.45 waves; 384 mid ones = 2.9
        (1024, 4096): big,  # 128 big tiles: one full wave
        (1024, 28672): big, (1024, 128256): big, (8192, 6144): big, (2048, 6144): big,
        (256, 4096): row64,  # 128 tiles of 64 rows: one per SM
        (256, 6144): mid, (256, 28672): big, (256, 128256): big, (512, 4096): mid, (512, 6144): big,
        (128, 4096): (64, 64),
    }
    for (m, n), shape in want.items():
        cfg = select_config(m, n, 4096, torch.bfloat16, interpreter=False, sm_count=132)
        assert (cfg.block_m, cfg.block_n) == shape, (m, n, cfg)
    # tiny outputs at large M still get many programs (the narrow tiles), not a handful of big ones
    assert select_config(8192, 64, 4096, torch.bfloat16, interpreter=False, sm_count=132).block_m == 64


def test_config_specs_and_table_override(monkeypatch, tmp_path):
    c = MatmulConfig(128, 256, 64, 8, 3, tma=True, persistent=True, warp_specialize=True)
    assert c.spec() == [128, 256, 64, 8, 3, "TPW"] and MatmulConfig.from_spec(c.spec()) == c
    with pytest.raises(ValueError, match="flags"):
        MatmulConfig.from_spec([64, 64, 64, 4, 3, "X"])
    with pytest.raises(ValueError, match="spec is"):
        MatmulConfig.from_spec([64, 64])
    with pytest.raises(ValueError, match="need tma=True"):
        MatmulConfig(64, 64, 64, 4, 3, persistent=True)
    base_small = mc.GPU_CONFIGS_16BIT["small"]
    path = tmp_path / "t.json"
    path.write_text('{"16bit": {"small": {"max_m": 500, "configs": [[64, 64, 64, 4, 4, "TP"]]}}}')
    tables = mc.load_tables(str(path))
    assert tables.configs_16bit["small"] == (500, (MatmulConfig(64, 64, 64, 4, 4, tma=True, persistent=True),))
    assert select_config(300, 4096, 4096, torch.bfloat16, interpreter=False, tables=tables).block_m == 64
    assert mc.GPU_CONFIGS_16BIT["small"] == base_small  # the built-in table is not modified
    monkeypatch.setenv(mc.ENV_OVERRIDE, str(path))
    assert mc.active_tables() == tables
    path.write_text('{"16bit": {"batch": {"configs": [[128, 128, 64, 8, 4], [64, 64, 64, 4, 4]], '
                    '"eff": [1.0, 0.1]}}}')
    tables = mc.load_tables(str(path))
    assert tables.efficiency[MatmulConfig(64, 64, 64, 4, 4)] == 0.1
    assert select_config(4096, 4096, 4096, torch.bfloat16, interpreter=False, tables=tables).block_m == 128
    path.write_text('{"16bit": {"batch": {"configs": [[128, 128, 64, 8, 4]], "eff": [0.5, 1]}}}')
    with pytest.raises(ValueError, match="one positive number per config"):
        mc.load_tables(str(path))
    path.write_text('{"16bit": {"huge": {"configs": [[64, 64, 64, 4, 4]]}}}')
    with pytest.raises(ValueError, match="unknown class"):
        mc.load_tables(str(path))


def test_dispatch_memo_matches_the_rule_and_can_be_cleared(monkeypatch):
    """linear() memoizes select_config per (M, N, K, dtype, device, interpreter); the memo is the rule's answer
    and clear_config_cache() forgets it."""
    mm.clear_config_cache()
    dev = torch.device("cpu")
    assert mm._config(300, 4096, 4096, torch.float16, dev) == select_config(300, 4096, 4096, torch.float16,
                                                                             mm.interpreting(), 4)
    assert len(mm._CONFIGS) == 1
    mm._config(300, 4096, 4096, torch.float16, dev)
    assert len(mm._CONFIGS) == 1
    monkeypatch.setattr(mm, "_CONFIG_CACHE_MAX", 2)
    mm._config(301, 4096, 4096, torch.float16, dev)
    mm._config(302, 4096, 4096, torch.float16, dev)  # full: cleared, then this key added
    assert len(mm._CONFIGS) == 1
    mm.clear_config_cache()
    assert not mm._CONFIGS


# ==================================================================================== GPU only
LLAMA3_8B = {  # (K, N) of the five linears of Llama-3-8B
    "qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
    "lm_head": (4096, 128256),
}
GPU_MS = list(range(1, 17)) + [31, 64, 65, 128, 256, 257, 512, 1024, 4096]


def _run_cfg(x, w, cfg, bias=None):
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    mm._launch(x.unsqueeze(0), w.t().unsqueeze(0), bias, out.unsqueeze(0), cfg)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(LLAMA3_8B))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_gpu_llama_shapes_rows_identical_for_every_m_and_config(dtype, shape):
    k, n = LLAMA3_8B[shape]
    g = torch.Generator(device="cuda").manual_seed(k + n)
    x = torch.randn(max(GPU_MS), k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dtype)
    full = mm.linear(x, w, out=nan_out((x.shape[0], n), dtype))
    assert_accurate(full[:64], x[:64], w.t())
    for m in GPU_MS:  # the dispatcher, whatever config it picks for this M
        assert torch.equal(mm.linear(x[:m], w), full[:m]), f"M={m}"
    assert torch.equal(mm.linear(x[1000:1003], w), full[1000:1003])
    for cfg in gpu_configs(dtype):  # every config it can pick, on every shape family
        for m in (1, 5, 16, 64, 257):
            assert torch.equal(_run_cfg(x[:m], w, cfg), full[:m]), f"{cfg} M={m}"
        assert torch.equal(_run_cfg(x[100:133], w, cfg), full[100:133]), f"{cfg} rows 100:133"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_row_major_b_rows_identical_for_every_m_and_config(dtype):
    """matmul(dY, W) with W [N, K] read as a row-major B [K=N, N=K] (training's dX): every config, TMA
    descriptors of that layout included, gives every row the bits of the dispatcher's full call."""
    k, n = 4096, 1536
    g = torch.Generator(device="cuda").manual_seed(n)
    a = torch.randn(4096, k, device="cuda", generator=g).to(dtype)
    b = (torch.randn(k, n, device="cuda", generator=g) / k**0.5).to(dtype)
    full = mm.matmul(a, b)
    assert_accurate(full[:64], a[:64], b)
    for m in (1, 16, 64, 257, 4096):
        assert torch.equal(mm.matmul(a[:m], b), full[:m]), f"M={m}"
    for cfg in gpu_configs(dtype):
        for lo, hi in ((0, 5), (0, 257), (100, 1124)):
            out = nan_out((1, hi - lo, n), dtype)
            mm._launch(a[lo:hi].unsqueeze(0), b.unsqueeze(0), None, out, cfg)
            assert torch.equal(out[0], full[lo:hi]), f"{cfg} rows {lo}:{hi}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_gpu_bias_and_zero_extension_for_every_config(dtype):
    k, n = 4096, 1024
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(300, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / 64).to(dtype)
    bias = torch.randn(n, device="cuda", generator=g).to(dtype)
    ref = mm.linear(x, w, bias)
    assert_accurate(ref[:32], x[:32], w.t(), bias)
    for pad in (0, 5, 64, 1000):
        xp = torch.cat([x, torch.zeros(300, pad, dtype=dtype, device="cuda")], 1)
        wp = torch.cat([w, torch.zeros(n, pad, dtype=dtype, device="cuda")], 1)
        for cfg in gpu_configs(dtype):
            for lo, hi in ((0, 1), (0, 300), (17, 40)):
                assert torch.equal(_run_cfg(xp[lo:hi], wp, cfg, bias), ref[lo:hi]), f"{cfg} pad={pad}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_attention_bmm_batch_and_padding_invariant(dtype):
    """Scores Q K^T and P @ V with the key length padded by zero probabilities, as in a padded batch."""
    g = torch.Generator(device="cuda").manual_seed(3)
    bh, lq, lk, d = 64, 37, 333, 128
    q = torch.randn(bh, lq, d, device="cuda", generator=g).to(dtype)
    kk = torch.randn(bh, lk, d, device="cuda", generator=g).to(dtype)
    s = mm.bmm(q, kk.transpose(1, 2))
    assert torch.equal(mm.bmm(q[5:6, 3:4], kk[5:6].transpose(1, 2)), s[5:6, 3:4])
    p = torch.softmax(s.float(), -1).to(dtype)
    v = torch.randn(bh, lk, d, device="cuda", generator=g).to(dtype)
    o = mm.bmm(p, v)
    assert_accurate(o[0], p[0], v[0])
    for extra in (1, 100, 700):
        pp = torch.cat([p, torch.zeros(bh, lq, extra, dtype=dtype, device="cuda")], 2)
        vp = torch.cat([v, torch.randn(bh, extra, d, device="cuda", generator=g).to(dtype)], 1)
        assert torch.equal(mm.bmm(pp, vp), o)  # V rows beyond the key length meet exact zero weights
        assert torch.equal(mm.bmm(pp[7:9, :1], vp[7:9]), o[7:9, :1])


@pytest.mark.gpu
@given(m=st.one_of(st.sampled_from([1, 7, 333]), st.integers(1, 400)), k=st.integers(1, 5000),
       n=st.one_of(st.sampled_from([1, 7, 333]), st.integers(1, 700)), seed=st.integers(0, 2**31), data=st.data())
def test_gpu_bf16_property(m, k, n, seed, data):
    x, w = rand((m, k), torch.bfloat16, seed), rand((n, k), torch.bfloat16, seed + 1)
    y = mm.linear(x, w, out=nan_out((m, n), torch.bfloat16))
    assert_accurate(y, x, w.t())
    lo, hi = slice_of(data, m)
    assert torch.equal(mm.linear(x[lo:hi], w), y[lo:hi])
    for cfg in gpu_configs(torch.bfloat16):
        assert torch.equal(_run_cfg(x[lo:hi], w, cfg), y[lo:hi]), str(cfg)


@pytest.mark.gpu
def test_gpu_negative_control_stock_linear_varies_with_batch():
    """The invariance tests can fail: cuBLAS's F.linear gives row 0 different bits for some batch sizes
    (searched over the Llama shapes: cuBLAS switches to split-K kernels only for some of them)."""
    varies = []
    for shape in ("qkv", "down", "o", "gate_up"):
        k, n = LLAMA3_8B[shape]
        g = torch.Generator(device="cuda").manual_seed(11)
        x = torch.randn(max(GPU_MS), k, device="cuda", generator=g).bfloat16()
        w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16()
        row0, ours = F.linear(x[:1], w), mm.linear(x[:1], w)
        varies += [(shape, m) for m in GPU_MS if not torch.equal(F.linear(x[:m], w)[:1], row0)]
        assert all(torch.equal(mm.linear(x[:m], w)[:1], ours) for m in GPU_MS), shape
    assert varies, "stock F.linear was batch-invariant everywhere: the negative control proves nothing"


@pytest.mark.gpu
def test_gpu_fp32_1669_demo():
    a = torch.linspace(-1000, 1000, 2048 * 4096, device="cuda").reshape(2048, 4096)
    b = torch.linspace(-1000, 1000, 4096 * 4096, device="cuda").reshape(4096, 4096)
    stock = (torch.mm(a[:1], b) - torch.mm(a, b)[:1]).abs().max().item()
    ours = (mm.matmul(a[:1], b) - mm.matmul(a, b)[:1]).abs().max().item()
    assert stock > 0, "stock torch.mm gave row 0 the same bits alone and in the batch"
    assert ours == 0
