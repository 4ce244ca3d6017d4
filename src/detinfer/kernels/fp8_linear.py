"""Block-scaled FP8 linear (W8A8): y = x @ W^T with W fp8 in 128 x 128 blocks (kernels/fp8_quant.py) and x
quantized per token per 128-wide group along K at call time ("dynamic" activations).

Numerics (both paths): for each K block kb = 0, 1, ... in ascending order, with an fp32 accumulator,

    acc += (dot(x_q[:, kb], W_q[:, kb]) * sx[:, kb]) * sw[n, kb]

then bias (fp32), then a cast to x's dtype. Each row's activation scales depend on that row only, and each
output element reduces the same K blocks in the same order whatever M is, so a row's result does not depend
on the batch it is in.

- `linear_fp8_ref` (CPU, and anywhere the kernel does not run): a block's dot of 128 fp8 x fp8 products is
  computed EXACTLY, then rounded once to fp32. Why exact: an e4m3 value has 4 significant bits and
  exponents down to 2^-9, so each product is an integer multiple of 2^-18 below 2^18, and a 128-long sum of
  them stays below 2^43 such units, inside float64's 53 bits. A float64 matmul of the upcast values
  therefore has no rounding at all, in whatever order or blocking the BLAS adds (the same reason as
  kernels/_exact_dot.py, here without any pre-rounding): the block partial is a pure function of the two
  rows, i.e. a fixed-order fp32 result by construction.
- `linear_fp8` (Hopper, Triton): fp8 `tl.dot` per K block into a fresh fp32 tile, scaled and added in the
  same order. The tensor cores' internal fp8 accumulation is not documented to be exact, so the kernel
  matches the ref within a tolerance, not bitwise; it is batch-invariant on its own (tile config from
  (N, K) only). A GPU kernel; Triton's CPU interpreter also runs it on CPU tensors (tests only).
- `linear_fp8_stock` (fast mode): what a serving stack runs: torch's block-scaled `scaled_mm` on a GPU that
  takes it, else dequantize + F.linear.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from detinfer.kernels.fp8_quant import BLOCK, FP8_DTYPE, dequantize_weight, num_blocks, quantize_activations

__all__ = ["linear_fp8", "linear_fp8_ref", "linear_fp8_stock", "linear_fp8_tree", "check_fp8_linear"]


def check_fp8_linear(op: str, x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                     bias: torch.Tensor | None) -> None:
    """Shapes and dtypes both paths need; errors name the operand and what is allowed."""
    if w_q.dim() != 2 or w_q.dtype != FP8_DTYPE:
        raise ValueError(f"{op}: weight must be a 2-D float8_e4m3fn [N, K] tensor, got {tuple(w_q.shape)} "
                         f"{w_q.dtype}")
    n, k = w_q.shape
    if x.dim() < 1 or x.shape[-1] != k or not x.dtype.is_floating_point:
        raise ValueError(f"{op}: x must be a float tensor [..., K={k}], got {tuple(x.shape)} {x.dtype}")
    if w_scale.shape != (n, num_blocks(k)) or w_scale.dtype != torch.float32:
        raise ValueError(f"{op}: weight scales must be float32 [N, ceil(K/{BLOCK})] = [{n}, {num_blocks(k)}], "
                         f"got {tuple(w_scale.shape)} {w_scale.dtype}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"{op}: bias must have shape [N] = [{n}], got {tuple(bias.shape)}")


def check_fp8_kernel_device(op: str, *tensors: torch.Tensor | None) -> None:
    """The Triton FP8 kernels run on CUDA tensors, or on CPU ones in Triton's interpreter (tests: it runs fp8
    dots, though not bitwise as the reference does)."""
    from detinfer.kernels._launch import interpreting

    on = [t.is_cuda for t in tensors if t is not None]
    if not (all(on) or (interpreting() and not any(on))):
        raise ValueError(f"{op}: the Triton kernel runs on CUDA tensors (or CPU ones under TRITON_INTERPRET=1); "
                         "use the pure-torch reference on CPU")


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def linear_fp8_ref(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The pure-torch definition (see the module doc): x [..., K] -> [..., N] in `out_dtype` (default x's;
    fp32: the accumulator itself, what tensor-parallel partial sums add)."""
    check_fp8_linear("linear_fp8_ref", x, w_q, w_scale, bias)
    n, k = w_q.shape
    x2 = _flat(x)
    x_q, sx = quantize_activations(x2)
    acc = torch.zeros((x2.shape[0], n), dtype=torch.float32, device=x.device)
    for kb in range(num_blocks(k)):
        k0, k1 = kb * BLOCK, min(k, (kb + 1) * BLOCK)
        exact = x_q[:, k0:k1].double() @ w_q[:, k0:k1].double().t()  # no rounding (module doc)
        acc += (exact.float() * sx[:, kb:kb + 1]) * w_scale[:, kb][None, :]
    if bias is not None:
        acc += bias.float()
    return acc.to(out_dtype or x.dtype).reshape(tuple(x.shape[:-1]) + (n,))


def linear_fp8_tree(linear, x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                    num_chunks: int) -> torch.Tensor:
    """x [..., K] -> fp32 [..., N]: `linear(x_c, w_c, s_c, out_dtype=float32)` over `num_chunks` equal K chunks,
    added in kernels/chunked_linear.py's fixed pairwise tree. Each chunk must be whole 128-column blocks, so
    every chunk quantizes the activations in exactly the groups the whole K would."""
    from detinfer.kernels.chunked_linear import pairwise_tree_sum

    k = w_q.shape[1]
    if num_chunks < 1 or k % num_chunks or (k // num_chunks) % BLOCK:
        raise ValueError(f"linear_fp8_tree: K={k} must split into {num_chunks} equal chunks of whole "
                         f"{BLOCK}-column scale blocks")
    kc, bc = k // num_chunks, k // num_chunks // BLOCK
    return pairwise_tree_sum(torch.stack([
        linear(x[..., c * kc:(c + 1) * kc], w_q[:, c * kc:(c + 1) * kc], w_scale[:, c * bc:(c + 1) * bc],
               out_dtype=torch.float32) for c in range(num_chunks)]))


def linear_fp8_stock(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """Fast mode: torch's block-scaled fp8 GEMM where this torch and GPU take it (`_scaled_mm_runs`), else
    the weight dequantized to x's dtype and F.linear (activations unquantized)."""
    check_fp8_linear("linear_fp8_stock", x, w_q, w_scale, bias)
    n, k = w_q.shape
    if x.is_cuda and n % BLOCK == 0 and k % BLOCK == 0 and _scaled_mm_runs(x.device):
        y = _scaled_mm_blockwise(_flat(x), w_q, w_scale, x.dtype)
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.reshape(tuple(x.shape[:-1]) + (n,))
    return F.linear(x, dequantize_weight(w_q, w_scale).to(x.dtype), bias)


def _scaled_mm_blockwise(x2: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, out_dtype) -> torch.Tensor:
    """torch's scaled_mm with 1x128 activation and 128x128 weight scales (cuBLAS's blockwise recipe: scales
    outer-dim-major, hence the transposes)."""
    recipe = F.ScalingType
    x_q, sx = quantize_activations(x2)
    sw_blocks = w_scale[::BLOCK]  # [N/128, K/128]: every row of a block holds the block's scales
    return F.scaled_mm(x_q, w_q.t(), sx.t().contiguous().t(), recipe.BlockWise1x128,
                       sw_blocks.contiguous(), recipe.BlockWise128x128, output_dtype=out_dtype)


@functools.cache
def _scaled_mm_runs(device: torch.device) -> bool:
    """Whether the blockwise scaled_mm runs here and reads the scales as this module lays them out (torch
    build, cuBLAS and GPU generation all matter): probed once per device on a non-square problem (3 x 2 weight
    blocks, so transposed scales would show) against the reference; otherwise fast mode dequantizes."""
    if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        return False
    from detinfer.kernels.fp8_quant import quantize_weight_rows

    try:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(2 * BLOCK, 2 * BLOCK, device=device, generator=g).to(torch.bfloat16)
        w = torch.randn(3 * BLOCK, 2 * BLOCK, device=device, generator=g)
        w = w * torch.linspace(0.01, 10.0, 3 * BLOCK, device=device)[:, None]  # distinct block scales
        q, scales = quantize_weight_rows(w)
        y = _scaled_mm_blockwise(x, q, scales, torch.bfloat16).float()
        ref = linear_fp8_ref(x, q, scales, out_dtype=torch.float32)
        return bool((y - ref).norm() <= 1e-2 * ref.norm())
    except Exception:  # any refusal (unsupported recipe, arch, layout) means: use the dequantizing path
        return False


# -- the Triton kernel (Hopper) ------------------------------------------------------------------------------
def kernel_config(n: int, k: int) -> dict:
    """Tile sizes and pipeline depth from (N, K) only, never from M: every row of every batch then runs the
    same instruction sequence (same K blocks, same MMA shapes) for a given weight, so a row's bits cannot
    depend on how many rows came with it. BLOCK_K is the scale block: one scale pair per fp32 partial."""
    block_n = 128 if n >= 2048 else 64
    return dict(BLOCK_M=64, BLOCK_N=block_n, BLOCK_K=BLOCK, num_warps=4, num_stages=4 if k >= 1024 else 3)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _linear_fp8_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, y_ptr, M, N, K, KB,
                           stride_xm, stride_sxm, stride_wn, stride_swn, stride_ym,
                           HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok, n_ok = rm < M, rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, KB):
            kk = kb * BLOCK_K + rk
            k_ok = kk < K
            a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                        other=0.0)
            b = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None], mask=n_ok[None, :] & k_ok[:, None],
                        other=0.0)
            part = tl.dot(a, b, out_dtype=tl.float32)  # this K block alone, fp32
            sa = tl.load(sx_ptr + rm * stride_sxm + kb, mask=m_ok, other=0.0)
            sb = tl.load(sw_ptr + rn * stride_swn + kb, mask=n_ok, other=0.0)
            acc += (part * sa[:, None]) * sb[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    return triton, _linear_fp8_kernel


def linear_fp8(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The Triton path (CUDA, fp8 tensor cores: Hopper or newer; CPU tensors under TRITON_INTERPRET=1):
    x [..., K] -> [..., N] in `out_dtype` (default x's)."""
    check_fp8_linear("linear_fp8", x, w_q, w_scale, bias)
    check_fp8_kernel_device("linear_fp8", x, w_q, w_scale, bias)
    n, k = w_q.shape
    x2 = _flat(x)
    x_q, sx = quantize_activations(x2)  # row-wise torch ops: the ref's exact bits
    w_q, w_scale = w_q.contiguous(), w_scale.contiguous()
    y = torch.empty((x2.shape[0], n), dtype=out_dtype or x.dtype, device=x.device)
    if x2.shape[0] and n:
        triton, kernel = _kernel()
        cfg = kernel_config(n, k)
        grid = (triton.cdiv(x2.shape[0], cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
        kernel[grid](x_q, sx, w_q, w_scale, bias if bias is not None else w_scale, y, x2.shape[0], n, k,
                     num_blocks(k), x_q.stride(0), sx.stride(0), w_q.stride(0), w_scale.stride(0), y.stride(0),
                     HAS_BIAS=bias is not None, **cfg)
    return y.reshape(tuple(x.shape[:-1]) + (n,))
