"""Batch-invariant matmul / bmm / linear: a Triton kernel and a pure-torch reference.

Contracts (asserted bitwise in tests/kernels/test_matmul.py):
(A) For fixed K, N and dtype, an output row depends only on its own input row: not on M, on the row's
    position in the batch, on the bmm batch index or size.
(B) Appending zeros to the reduction dim of both operands changes no output bit (padded attention P @ V,
    where the key length grows with the longest prompt while the extra P entries are exact zeros).

How the kernel meets them: each program owns a BLOCK_M x BLOCK_N output tile and walks K upward from
k = 0 into one fp32 accumulator. There is no split-K and no atomics: the reduction order of an output
element is "K in ascending hardware MMA steps into one accumulator", whatever the tile shape
(matmul_configs.py says why the config may therefore depend on M, and which test proves it). The K tail is
loaded as exact zeros, and zero steps leave the accumulator unchanged, which gives (B).

The `*_ref` functions (kernels/matmul_ref.py, re-exported here) are the CPU path (and the fp64 path): only
elementwise products and fixed-order folds (`fold_sum`), walked over K in constant blocks of `REF_BLOCK_K`, so
they are batch-invariant and zero-extension-invariant by construction, for any float dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from detinfer.kernels._direct import LaunchCache
from detinfer.kernels._launch import KERNEL_DTYPES, check_kernel_inputs, dot_precision, interpreting, sm_count
from detinfer.kernels._pdl import launch_options, pdl_start, prefetch_rows_l2, use_pdl
from detinfer.kernels.matmul_configs import WIDE_OUTPUT_CONFIG, MatmulConfig, select_config
from detinfer.kernels.matmul_ref import (  # noqa: F401
    REF_BLOCK_K,
    REF_MAX_PRODUCTS,
    _check_linear_shapes,
    _check_matmul_shapes,
    _check_same_dtype,
    _name,
    bmm_ref,
    linear_ref,
    matmul_ref,
)
from detinfer.kernels.peer_push import PeerPush, push_tile

__all__ = ["matmul", "bmm", "linear", "matmul_ref", "bmm_ref", "linear_ref"]


@triton.jit
def _tile_coords(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped launch order: GROUP_M row tiles share each column tile of B while it is in L2. Decides only
    which program computes which tile, never how a tile is computed."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (tile // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((tile % num_pid_in_group) % group_size_m)
    pid_n = (tile % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _load_a_block(a_ptrs, m_ok, offs_k, k_left, EVEN_K: tl.constexpr):
    """One [BLOCK_M, BLOCK_K] block of A. Rows past the edge load zeros (a mask constant along K keeps the
    K loads vectorized); the K tail (k >= k_left) loads exact zeros: zero products leave the accumulator
    unchanged (contract B)."""
    if EVEN_K:
        a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
    else:
        a = tl.load(a_ptrs, mask=m_ok[:, None] & (offs_k < k_left)[None, :], other=0.0)
    return a


@triton.jit
def _load_b_block(b_ptrs, n_ok, offs_k, k_left, EVEN_K: tl.constexpr):
    """One [BLOCK_K, BLOCK_N] block of B, edges as `_load_a_block`."""
    if EVEN_K:
        b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
    else:
        b = tl.load(b_ptrs, mask=(offs_k < k_left)[:, None] & n_ok[None, :], other=0.0)
    return b


@triton.jit
def _add_bias(acc, bias_ptr, offs_n, n_ok, HAS_BIAS: tl.constexpr):
    """Bias is added once, in fp32, after the whole reduction (same bits for every config)."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _store_tile(acc, c_ptr, bias_ptr, pid_m, pid_n, M, N, stride_cm, stride_cn, push_epochs_ptr, push_mail0,
                push_mail1, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                PUSH: tl.constexpr, PUSH_RANK: tl.constexpr, PUSH_ROWS: tl.constexpr, PUSH_BLOCK_D: tl.constexpr,
                PUSH_BOXN: tl.constexpr, PUSH_SLOT: tl.constexpr):
    """Store the tile (+ bias); with PUSH also send it to the other GPU's sum kernel (kernels/peer_push.py:
    a row-parallel layer's fp32 partial, written as it is stored)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = _add_bias(acc, bias_ptr, offs_n, n_ok, HAS_BIAS)
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n.to(tl.int64)[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & n_ok[None, :])
    if PUSH:
        push_tile(acc, offs_m, offs_n, M, N, push_mail0, push_mail1, push_epochs_ptr, PUSH_RANK, PUSH_ROWS,
                  PUSH_BLOCK_D, PUSH_BOXN, PUSH_SLOT)


# M changes with every batch: not specializing on it (divisibility by 16, == 1) keeps one binary per
# config instead of one per M residue; it only bounds rows. The batch strides ARE specialized: the
# compiler must see that z * stride keeps each base pointer 16-byte aligned, or every load becomes scalar
# (measured: 5x slower). Single-matrix launches pass batch strides of 0 for that reason.
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, push_epochs_ptr,
    M, N, K,
    stride_az, stride_am, stride_ak,
    stride_bz, stride_bk, stride_bn,
    stride_cz, stride_cm, stride_cn,
    push_mail0, push_mail1,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_K: tl.constexpr, LINE_K: tl.constexpr,
    Z_PER_PROGRAM: tl.constexpr,
    PUSH: tl.constexpr, PUSH_RANK: tl.constexpr, PUSH_ROWS: tl.constexpr, PUSH_BLOCK_D: tl.constexpr,
    PUSH_BOXN: tl.constexpr, PUSH_SLOT: tl.constexpr,
):
    """C[z] = A[z] @ B[z] (+ bias) for one BLOCK_M x BLOCK_N tile of the batch entries z = program_id(1) *
    Z_PER_PROGRAM + 0 .. Z_PER_PROGRAM - 1, one after the other (each from a zero accumulator, so an entry's
    bits do not depend on Z_PER_PROGRAM). PUSH (one batch entry): `_store_tile`."""
    pid_m, pid_n = _tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    z0 = tl.program_id(1).to(tl.int64) * Z_PER_PROGRAM
    if PREFETCH_K > 0:
        prefetch_rows_l2(b_ptr + z0 * stride_bz, offs_n, offs_n < N, stride_bn, PREFETCH_K, LINE_K)
    pdl_start(USE_PDL)  # PDL (kernels/_pdl.py): wait for the previous kernel before reading anything
    offs_k = tl.arange(0, BLOCK_K)
    # Rows/columns past the edge load zeros (masks constant along K keep the K loads vectorized); a row's
    # products never mix with another row's, so padding rows cannot touch real ones.
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_rows = offs_m.to(tl.int64)[:, None] * stride_am
    b_cols = offs_n.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if Z_PER_PROGRAM == 1:
        a_ptrs = a_ptr + z0 * stride_az + a_rows + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + z0 * stride_bz + offs_k[:, None] * stride_bk + b_cols
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            a = _load_a_block(a_ptrs, m_ok, offs_k, K - kb * BLOCK_K, EVEN_K)
            b = _load_b_block(b_ptrs, n_ok, offs_k, K - kb * BLOCK_K, EVEN_K)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        _store_tile(acc, c_ptr + z0 * stride_cz, bias_ptr, pid_m, pid_n, M, N, stride_cm, stride_cn,
                    push_epochs_ptr, push_mail0, push_mail1, HAS_BIAS, BLOCK_M, BLOCK_N, PUSH, PUSH_RANK,
                    PUSH_ROWS, PUSH_BLOCK_D, PUSH_BOXN, PUSH_SLOT)
    else:
        # The entries' K blocks as one flat loop, so the software pipeline runs on across entries (short
        # chunks would otherwise restart it every few blocks); each entry still starts from a zero
        # accumulator and walks its K upward: the same dots as the loop above.
        k_blocks = tl.cdiv(K, BLOCK_K)
        for it in range(0, Z_PER_PROGRAM * k_blocks):
            dz = it // k_blocks
            kb = it - dz * k_blocks
            z = z0 + dz
            k0 = kb * BLOCK_K
            a = _load_a_block(a_ptr + z * stride_az + a_rows + (k0 + offs_k)[None, :] * stride_ak, m_ok, offs_k,
                              K - k0, EVEN_K)
            b = _load_b_block(b_ptr + z * stride_bz + (k0 + offs_k)[:, None] * stride_bk + b_cols, n_ok, offs_k,
                              K - k0, EVEN_K)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            if kb == k_blocks - 1:
                _store_tile(acc, c_ptr + z * stride_cz, bias_ptr, pid_m, pid_n, M, N, stride_cm, stride_cn,
                            push_epochs_ptr, push_mail0, push_mail1, HAS_BIAS, BLOCK_M, BLOCK_N, False, 0, 1, 1,
                            1, 1)
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


@triton.jit(do_not_specialize=["M", "num_programs"])
def _matmul_tma_kernel(
    a_desc, w_desc, c_ptr, bias_ptr,
    M, N, K, stride_cm, stride_cn, num_programs,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, USE_PDL: tl.constexpr,
    B_KN: tl.constexpr,
):
    """Same tiles and the same K order as `_matmul_kernel`, operands fetched by the TMA engine from
    descriptors of A [M, K] and W [N, K] (the weight layout), or with B_KN of B [K, N] row-major (dX = dY @ W
    in training reads the weight that way). Out-of-range boxes read as zeros, which covers the M/N edges
    and the K tail (contract B). With num_programs < tiles it is persistent: each program walks tiles
    num_programs apart (which program owns a tile cannot change its bits)."""
    pdl_start(USE_PDL)
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles, num_programs, flatten=FLATTEN,
                         warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, k_tiles):
            a = a_desc.load([pid_m * BLOCK_M, kb * BLOCK_K])
            if B_KN:
                acc = tl.dot(a, w_desc.load([kb * BLOCK_K, pid_n * BLOCK_N]), acc)
            else:
                acc = tl.dot(a, w_desc.load([pid_n * BLOCK_N, kb * BLOCK_K]).T, acc)
        _store_tile(acc, c_ptr, bias_ptr, pid_m, pid_n, M, N, stride_cm, stride_cn, c_ptr, 0, 0, HAS_BIAS,
                    BLOCK_M, BLOCK_N, False, 0, 1, 1, 1, 1)


try:  # host-side TMA descriptors (triton >= 3.4); without them every config runs the pointer kernel
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the installed triton
    TensorDescriptor = None

# ------------------------------------------------------------------------------------------ host path
# Everything below runs once per call on the host, in front of a kernel that can take only a few
# microseconds: no torch view ops beyond one reshape, no `triton.cdiv` (a constexpr function: ~10 us per
# call on a slow CPU in triton 3.9), device properties and configs looked up once and cached.
_TMA_ARCH: dict = {}
_CONFIGS: dict = {}
_CONFIG_CACHE_MAX = 1 << 14  # (M, N, K, dtype, device) keys; cleared when full (a batch-size sweep)
_KERNEL_DTYPES = frozenset(KERNEL_DTYPES)
_POINTER_LAUNCHES = LaunchCache(_matmul_kernel)  # _matmul_kernel launches by (shape, dtype, strides) key


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Off the GPU (interpreter) a small count, so the tests exercise the persistent tile walk.
INTERPRETER_SMS = 4


def _num_sms(device: torch.device) -> int:
    return sm_count(device, off_gpu=INTERPRETER_SMS)


def _tma_arch(device: torch.device) -> bool:
    """Host TMA descriptors exist and the device has a TMA engine (Hopper+; the interpreter emulates it)."""
    ok = _TMA_ARCH.get(device)
    if ok is None:
        ok = TensorDescriptor is not None and (
            device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9)
        _TMA_ARCH[device] = ok
    return ok


def _config(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> MatmulConfig:
    """`select_config` memoized per (M, N, K, dtype, device, interpreter). A pure function of its key, so
    the cache cannot change which config a shape gets; `clear_config_cache` after editing the tables."""
    interp = interpreting()
    key = (m, n, k, dtype, device, interp)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        cfg = select_config(m, n, k, dtype, interp, sm_count=_num_sms(device))
        if len(_CONFIGS) >= _CONFIG_CACHE_MAX:
            _CONFIGS.clear()
        _CONFIGS[key] = cfg
    return cfg


def fit_to_output(cfg: MatmulConfig, out_elem: int, in_elem: int) -> MatmulConfig:
    """`cfg`, or a smaller tile when the output's elements are wider than the inputs' and the tile exceeds
    128x128 (`matmul_configs.WIDE_OUTPUT_CONFIG` says why)."""
    if out_elem > in_elem and cfg.block_m * cfg.block_n > 128 * 128:
        return WIDE_OUTPUT_CONFIG
    return cfg


def clear_config_cache() -> None:
    """Forget memoized dispatcher choices (tests that swap the config tables call this)."""
    _CONFIGS.clear()
    _POINTER_LAUNCHES.clear()


def _tma_ok(a: torch.Tensor, sam: int, sak: int, w: torch.Tensor, swn: int, swk: int, k: int) -> bool:
    """TMA needs Hopper+, 16-bit operands here, a unit stride along K, 16-byte aligned rows and bases.
    `a` / `w` are base tensors (data_ptr = element [0, 0]) of A [M, K] and W [N, K] with these strides."""
    es = a.element_size()
    return (es == 2 and k > 0 and sak == 1 and swk == 1 and (sam * es) % 16 == 0 and (swn * es) % 16 == 0
            and a.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0 and _tma_arch(a.device))


def _tma_usable(a2: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether A [M, K] and W [N, K] (2-D tensors) qualify for the descriptor kernel."""
    return TensorDescriptor is not None and _tma_ok(a2, a2.stride(0), a2.stride(1), w2, w2.stride(0),
                                                    w2.stride(1), a2.shape[1])


# Weight columns each program of a decode-class launch (M <= PREFETCH_MAX_M) asks the L2 for before it
# waits for the previous kernel (PDL, kernels/_pdl.py): the programs of the next matmul start while a
# latency-bound kernel (RMSNorm, attention) runs, and the first lines of their weight rows are then on the
# way instead of every program paying the DRAM latency once the wait returns. Whole-step A/B (H100, Qwen3-8B
# shapes, batch-1 decode, PDL on; docs/performance.md): none 5.94 ms, 256 columns 5.85-5.86, 512 5.89-5.90,
# 1024 5.94, 4096 7.21 (whole weight matrices pulled into L2 and evicted before use). Speed only: a
# prefetch is a cache hint, and the L2 is coherent, so it cannot return stale data.
PREFETCH_COLS = 256
PREFETCH_MAX_M = 16


def _prefetch(pdl: bool, m: int, k: int, sbk: int, elem: int) -> dict:
    """The PREFETCH_K / LINE_K constexprs of a launch: PREFETCH_COLS columns of unit-stride weight rows
    (one 128-byte line every LINE_K columns) for decode-class launches under PDL, else none."""
    line = 128 // elem
    if not pdl or m > PREFETCH_MAX_M or sbk != 1 or k < PREFETCH_COLS:
        return dict(PREFETCH_K=0, LINE_K=1)
    return dict(PREFETCH_K=PREFETCH_COLS, LINE_K=line)


_NO_PUSH = ((0, 0), dict(PUSH=False, PUSH_RANK=0, PUSH_ROWS=1, PUSH_BLOCK_D=1, PUSH_BOXN=1, PUSH_SLOT=1))


def _push_args(push: PeerPush | None) -> tuple[tuple, dict]:
    """(scalars, constexprs) of a launch's push to the peer (kernels/peer_push.py; none: PUSH off). Only a
    launch that misses the launch cache asks (the cache replays both)."""
    if push is None:
        return _NO_PUSH
    return (push.mail0, push.mail1), dict(PUSH=True, PUSH_RANK=push.rank, PUSH_ROWS=push.rows,
                                          PUSH_BLOCK_D=push.block_d, PUSH_BOXN=push.boxn, PUSH_SLOT=push.slot)


def _run(a, sa, b, sb, c, sc, bias, nb: int, m: int, n: int, k: int, cfg: MatmulConfig | None,
         z_per_program: int = 1, push: PeerPush | None = None) -> None:
    """c[z] = a[z] @ b[z] (+ bias) for z < nb. a, b, c are base tensors (data_ptr = element [0, 0, 0]) of
    A [nb, M, K], B [nb, K, N], C [nb, M, N], described by element strides sa / sb / sc = (z, row, col):
    the caller passes strides instead of building views. `cfg` overrides the dispatcher (tests use it to
    prove every config gives the same bits). `z_per_program` (a divisor of nb): batch entries one program
    walks in turn (pointer kernel; same bits, see the kernel): nb short-K entries as one long weight stream
    per tile instead of nb times as many programs each paying a pipeline start. `push` (one fp32 matrix):
    also send C to the other GPU's sum kernel (kernels/peer_push.py), from the pointer kernel."""
    if nb == 0 or m == 0 or n == 0:
        return
    if nb > 65535:
        raise ValueError(f"batch size {nb} exceeds the kernel's limit of 65535 batch entries per launch")
    if nb % z_per_program:
        raise ValueError(f"z_per_program {z_per_program} must divide the batch size {nb}")
    if push is not None and (nb != 1 or c.dtype != torch.float32):
        raise ValueError(f"a pushed matmul writes one fp32 matrix, got {nb} batch entries of {c.dtype}")
    has_bias = bias is not None
    tensors = (a, b, c, bias if has_bias else c, push.epochs if push is not None else c)
    explicit = cfg is not None
    pdl = use_pdl(a.device)
    if not explicit:
        # Everything below is a function of this key (plus the device and the operands' alignment, which
        # the launch cache adds): a repeated shape skips the config lookup and Triton's argument binding.
        key = (nb, m, n, k, a.dtype, c.dtype, has_bias, sa, sb, sc, pdl, z_per_program,  # c.dtype: fp32 of bf16
               push.key if push is not None else None)
        if _POINTER_LAUNCHES.try_launch(key, tensors):
            return
        cfg = fit_to_output(_config(m, n, k, a.dtype, a.device), c.element_size(), a.element_size())
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    tiles = _cdiv(m, bm) * _cdiv(n, bn)
    push_scalars, push_constexprs = _push_args(push)
    # W [N, K] is B [K, N] read through its strides: its row stride is B's column stride. A B with unit
    # stride along N instead (a row-major [K, N] matrix) gets a descriptor of that layout (B_KN).
    # A push runs on the pointer kernel (the only one with the push epilogue; pushes are decode-sized).
    tma = cfg.tma and nb == 1 and TensorDescriptor is not None and push is None
    b_nk = tma and _tma_ok(a, sa[1], sa[2], b, sb[2], sb[1], k)
    b_kn = tma and not b_nk and _tma_ok(a, sa[1], sa[2], b, sb[1], sb[2], k)
    if b_nk or b_kn:
        a_desc = TensorDescriptor(a, [m, k], [sa[1], 1], [bm, bk])
        if b_nk:
            w_desc = TensorDescriptor(b, [n, k], [sb[2], 1], [bn, bk])
        else:
            w_desc = TensorDescriptor(b, [k, n], [sb[1], 1], [bk, bn])
        programs = min(tiles, _num_sms(a.device)) if cfg.persistent else tiles
        _matmul_tma_kernel[(programs,)](
            a_desc, w_desc, c, tensors[3], m, n, k, sc[1], sc[2], programs,
            HAS_BIAS=has_bias, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m,
            FLATTEN=cfg.persistent, WARP_SPECIALIZE=cfg.warp_specialize, USE_PDL=pdl, B_KN=b_kn,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(pdl),
        )
        return
    # A TMA config whose operands do not qualify runs the same tiles through pointer loads: same bits.
    # Single matrices pass batch strides of 0 (keeps the bases provably aligned, see the kernel).
    if nb == 1:
        sa, sb, sc = (0, sa[1], sa[2]), (0, sb[1], sb[2]), (0, sc[1], sc[2])
    constexprs = dict(
        HAS_BIAS=has_bias, EVEN_K=k % bk == 0,
        PRECISION=dot_precision(a.dtype),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m, USE_PDL=pdl, Z_PER_PROGRAM=z_per_program,
        **_prefetch(pdl and nb == z_per_program, m, k, sb[1], b.element_size()), **push_constexprs)
    scalars = (m, n, k, *sa, *sb, *sc, *push_scalars)
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(pdl))
    grid = (tiles, nb // z_per_program)
    if explicit:
        _matmul_kernel[grid](*tensors, *scalars, **constexprs, **options)
    else:
        _POINTER_LAUNCHES.launch(key, tensors, grid, scalars, constexprs, **options)


def _launch(a3: torch.Tensor, b3: torch.Tensor, bias: torch.Tensor | None, out3: torch.Tensor,
            config: MatmulConfig | None = None) -> torch.Tensor:
    """out3[z] = a3[z] @ b3[z] (+ bias) for 3-D views with any strides (tests and the offline sweep)."""
    nb, m, k = a3.shape
    _run(a3, a3.stride(), b3, b3.stride(), out3, out3.stride(), bias, nb, m, b3.shape[2], k, config)
    return out3


def _check_out(op: str, out: torch.Tensor | None, shape: tuple, like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(shape) or out.dtype != like.dtype \
            or out.device != like.device:
        got = (tuple(out.shape), out.dtype, out.device) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"{op}: out must be a {_name(like.dtype)} tensor of shape {tuple(shape)} on "
                         f"{like.device}, got {got}")
    return out


def _check_inputs(op: str, *tensors: torch.Tensor | None) -> None:
    """The boundary checks of every Triton entry point: tensors, one kernel dtype, one device that runs the
    kernel. The usual case (CUDA tensors of one dtype) is decided with a few attribute reads; anything else
    goes through the full checks, which raise the descriptive errors."""
    first = tensors[0]
    if isinstance(first, torch.Tensor):
        dt, dev = first.dtype, first.device
        if dev.type == "cuda" and dt in _KERNEL_DTYPES and all(
                t is None or (isinstance(t, torch.Tensor) and t.dtype == dt and t.device == dev)
                for t in tensors[1:]):
            return
    check_kernel_inputs(op, *tensors)
    _check_same_dtype(op, *tensors)


# ------------------------------------------------------------------------------------------ Triton path
def matmul(a: torch.Tensor, b: torch.Tensor, *, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """a [M, K] @ b [K, N] (+ bias [N]) -> [M, N] in a.dtype, fp32 accumulation, batch-invariant. Any
    strides. With a bias it is `linear(a, b.t(), bias)` (the same launch), without the transposed view."""
    _check_inputs("matmul", a, b, bias, out)
    _check_matmul_shapes("matmul", a, b, 2)
    m, k = a.shape
    n = b.shape[1]
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise ValueError(f"matmul: bias must have shape [N] = [{n}], got {tuple(bias.shape)}")
    if out is None:
        res = torch.empty((m, n), dtype=a.dtype, device=a.device)
        sc0, sc1 = n, 1
    else:
        res = _check_out("matmul", out, (m, n), a)
        sc0, sc1 = res.stride()
    sa0, sa1 = a.stride()
    sb0, sb1 = b.stride()
    _run(a, (0, sa0, sa1), b, (0, sb0, sb1), res, (0, sc0, sc1), bias, 1, m, n, k, None)
    return res


def bmm(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N] -> [B, M, N]; each batch entry as `matmul` (same bits as alone)."""
    _check_inputs("bmm", a, b, out)
    _check_matmul_shapes("bmm", a, b, 3)
    nb, m, k = a.shape
    n = b.shape[2]
    res = _check_out("bmm", out, (nb, m, n), a)
    _run(a, a.stride(), b, b.stride(), res, res.stride(), None, nb, m, n, k, None)
    return res


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias[N]) -> [..., N]. The weight is read through its strides (no
    transposed copy); bias is added in fp32 after the reduction."""
    _check_inputs("linear", x, weight, bias, out)
    _check_linear_shapes("linear", x, weight, bias)
    n, k = weight.shape
    if x.dim() == 2:
        rows, x2, lead = x.shape[0], x, (x.shape[0],)
    else:
        lead = tuple(x.shape[:-1])
        rows = math.prod(lead)
        x2 = x.reshape(rows, k)  # a view for the usual contiguous activations
    if out is None:
        res = torch.empty(lead + (n,), dtype=x.dtype, device=x.device)
        src, scm, scn = res, n, 1  # contiguous: row r of [rows, N] starts at r * N
    else:
        res = _check_out("linear", out, lead + (n,), x)
        try:
            src = res.view(rows, n)
        except RuntimeError as e:
            raise ValueError("linear: out must be viewable as [-1, N] (e.g. contiguous)") from e
        scm, scn = src.stride()
    sxm, sxk = x2.stride()
    swn, swk = weight.stride()
    # B [K, N] = weight^T: strides (k, n) are the weight's (column, row) strides.
    _run(x2, (0, sxm, sxk), weight, (0, swk, swn), src, (0, scm, scn), bias, 1, rows, n, k, None)
    return res
