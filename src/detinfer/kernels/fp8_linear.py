"""Block-scaled FP8 linear (W8A8): y = x @ W^T with W fp8 in 128 x 128 blocks (kernels/fp8_quant.py) and x
quantized per token per 128-wide group along K at call time ("dynamic" activations).

Numerics (both paths): a K run is an fp32 accumulator starting at 0.0 and, for each of its K blocks kb in
ascending order,

    acc = fma(dot(x_q[:, kb], W_q[:, kb]), sx[:, kb] * sw[n, kb], acc)

(the scale product rounded to fp32, then one fused multiply-add). A K of fewer than SPLIT_MIN_BLOCKS (64)
blocks is one run; a longer one is two, blocks [0, H) and [H, KB) with H = ceil(KB / 2) (`second_run_start`),
and their two fp32 accumulators are added (one IEEE addition). Then bias (fp32), then a cast to x's dtype.
Each row's activation scales depend on that row only, the runs depend on K only, and each output element
reduces the same K blocks in the same order with the same operations whatever M (or N) is, so a row's result
does not depend on the batch it is in.

- `linear_fp8_ref` (CPU, and anywhere the kernel does not run): a block's dot of 128 fp8 x fp8 products is
  computed EXACTLY, then rounded once to fp32. Why exact: an e4m3 value has 4 significant bits and
  exponents down to 2^-9, so each product is an integer multiple of 2^-18 below 2^18, and a 128-long sum of
  them stays below 2^43 such units, inside float64's 53 bits. A float64 matmul of the upcast values
  therefore has no rounding at all, in whatever order or blocking the BLAS adds (the same reason as
  kernels/_exact_dot.py, here without any pre-rounding): the block partial is a pure function of the two
  rows, i.e. a fixed-order fp32 result by construction. The fma is evaluated in float64, then rounded to fp32
  (the product of two fp32 values is exact there; the sum may round, and rounding twice differs from a fused
  multiply-add's one rounding only where the float64 sum lands exactly on a midpoint between two fp32
  values: rare, and a function of the element's own values either way).
- `linear_fp8` (Hopper, Triton): fp8 `tl.dot` per K block into a fresh fp32 tile, then the same fma in the same
  order, the two runs in one program or in two (added by a second launch: `_split_mode`); the activations
  quantized by one Triton launch before it (torch's bits, kernels/fp8_tiles.py), or handed over already
  quantized (`QuantizedRows`, by the norm or SiLU*mul before: kernels/fp8_act_quant.py). The tensor cores'
  internal fp8 accumulation is not documented to be exact, so the kernel matches the ref within
  a tolerance, not bitwise; it is batch-invariant on its own: BLOCK_K is the scale block whatever the config,
  and the tile config (picked from M for speed, `kernel_config`) changes no element's operations (asserted
  bitwise across every config on the GPU). From 512 rows a warp-specialized Gluon kernel computes the same
  operations where it applies (kernels/fp8_prefill_gemm.py: the same bits, faster at prefill sizes). A GPU
  kernel; Triton's CPU interpreter also runs it on CPU tensors (tests only).
Every path takes the weight [N, K] or in fp8_quant's tiled layout (the same values: the same bits; the
kernel reads tiles faster at decode, the reference and fast mode untile).
- `linear_fp8_stock` (fast mode, kernels/fp8_stock.py): what a serving stack runs: torch's block-scaled
  `scaled_mm` on a GPU that takes it, else dequantize + F.linear.
"""

from __future__ import annotations

import functools
import math

import torch

from detinfer.kernels import fp8_prefill_gemm
from detinfer.kernels._launch import interpreting
from detinfer.kernels.fp8_act_quant import quantize_activations_gpu  # noqa: F401 - part of this module's API
from detinfer.kernels.fp8_quant import (
    BLOCK,
    FP8_DTYPE,
    QuantizedRows,
    fp8_weight_shape,
    is_tiled,
    num_blocks,
    per_weight_cached,
    quantize_activations,
    untile_weight,
    weight_k_blocks,
)

__all__ = ["linear_fp8", "linear_fp8_quantized", "linear_fp8_ref", "linear_fp8_tree",
           "check_fp8_linear", "kernel_config", "quantize_activations_gpu", "second_run_start",
           "uniform_block_rows"]


# The K runs (numerics, module doc). A K of at least SPLIT_MIN_BLOCKS scale blocks is reduced as two runs of
# blocks, [0, H) and [H, KB) with H = ceil(KB / 2), each its own fma chain from 0.0, the two fp32 chains then
# added. Why: a decode GEMM's program is paced by its walk over the K blocks (docs/performance.md, "FP8, sixth
# pass": ~0.27 us per block on an H100 whatever the tile's width or warps), and an output of few tiles (down_proj,
# N = 4096: 64 tiles of 64 columns) leaves half the SMs idle: two runs let two programs share a tile's walk.
# Where one program holds both (more rows, or many tiles), it walks them one after the other, and the second
# start of the load pipeline is what the split costs: measured nothing on K = 12288 at M = 256-4096, but 4-11%
# on K = 4096 (and two interleaved runs, the even and the odd blocks, cost ~30% there: two accumulators beside
# the dot tile). Hence 64 blocks (K >= 8192). A function of K only: never of M (batch invariance), nor of N (a
# column-parallel shard under tensor parallelism keeps each column's bits), nor of the GPU.
SPLIT_MIN_BLOCKS = 64


def second_run_start(kb: int) -> int:
    """H, the first K block of the second run, for KB = `kb` blocks (`kb` itself: one run)."""
    return (kb + 1) // 2 if kb >= SPLIT_MIN_BLOCKS else kb


def check_fp8_linear(op: str, x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                     bias: torch.Tensor | None) -> None:
    """Shapes and dtypes both paths need; errors name the operand and what is allowed. The weight is [N, K] or
    in fp8_quant's tiled layout (the same values)."""
    try:
        n, k = fp8_weight_shape(w_q)
    except ValueError:
        n = None
    if n is None or w_q.dtype != FP8_DTYPE:
        raise ValueError(f"{op}: weight must be a float8_e4m3fn [N, K] tensor (or tiled [N/{BLOCK}, K/{BLOCK}, "
                         f"{BLOCK}, {BLOCK}]), got {tuple(w_q.shape)} {w_q.dtype}")
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
    on = [t.is_cuda for t in tensors if t is not None]
    if not (all(on) or (interpreting() and not any(on))):
        raise ValueError(f"{op}: the Triton kernel runs on CUDA tensors (or CPU ones under TRITON_INTERPRET=1); "
                         "use the pure-torch reference on CPU")


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def linear_fp8_ref(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None, uniform: bool | None = None) -> torch.Tensor:
    """The pure-torch definition (see the module doc): x [..., K] -> [..., N] in `out_dtype` (default x's;
    fp32: the accumulator itself, what tensor-parallel partial sums add). `uniform` is `linear_fp8`'s speed
    hint, taken for a common signature: the products are the same either way."""
    check_fp8_linear("linear_fp8_ref", x, w_q, w_scale, bias)
    n, k = fp8_weight_shape(w_q)
    w_q = untile_weight(w_q)
    x_q, sx = (x.q, x.scale) if isinstance(x, QuantizedRows) else quantize_activations(_flat(x))
    kb = num_blocks(k)
    h = second_run_start(kb)
    acc = _chain_ref(x_q, sx, w_q, w_scale, range(h))
    if h < kb:  # the second run's chain, added: one fp32 addition (module doc)
        acc = acc + _chain_ref(x_q, sx, w_q, w_scale, range(h, kb))
    if bias is not None:
        acc += bias.float()
    return acc.to(out_dtype or x.dtype).reshape(tuple(x.shape[:-1]) + (n,))


def _chain_ref(x_q: torch.Tensor, sx: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
               blocks: range) -> torch.Tensor:
    """One K run of `linear_fp8_ref`: the fma chain over `blocks` in order from 0.0 (fp32 [M, N])."""
    k = w_q.shape[1]
    acc = torch.zeros((x_q.shape[0], w_q.shape[0]), dtype=torch.float32, device=x_q.device)
    for kb in blocks:
        k0, k1 = kb * BLOCK, min(k, (kb + 1) * BLOCK)
        part = (x_q[:, k0:k1].double() @ w_q[:, k0:k1].double().t()).float()  # no rounding until here
        scale = sx[:, kb:kb + 1] * w_scale[:, kb][None, :]  # fp32
        acc = (part.double() * scale.double() + acc.double()).float()  # the fma (module doc)
    return acc


def linear_fp8_tree(linear, x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                    num_chunks: int) -> torch.Tensor:
    """x [..., K] -> fp32 [..., N]: `linear(x_c, w_c, s_c, out_dtype=float32)` over `num_chunks` equal K chunks,
    added in kernels/chunked_linear.py's fixed pairwise tree. Each chunk must be whole 128-column blocks, so
    every chunk quantizes the activations in exactly the groups the whole K would. A K slice has the whole
    tensor's rows, so `linear` gets the whole scale tensor's `uniform_block_rows` (cached; a slice, a new view
    per call, would be checked afresh each time)."""
    from detinfer.kernels.chunked_linear import pairwise_tree_sum

    k = fp8_weight_shape(w_q)[1]
    if num_chunks < 1 or k % num_chunks or (k // num_chunks) % BLOCK:
        raise ValueError(f"linear_fp8_tree: K={k} must split into {num_chunks} equal chunks of whole "
                         f"{BLOCK}-column scale blocks")
    kc, bc = k // num_chunks, k // num_chunks // BLOCK
    uniform = uniform_block_rows(w_scale) if w_scale.is_cuda else None
    cols = x.columns if isinstance(x, QuantizedRows) else lambda k0, k1: x[..., k0:k1]
    return pairwise_tree_sum(torch.stack([
        linear(cols(c * kc, (c + 1) * kc), weight_k_blocks(w_q, c * bc, (c + 1) * bc),
               w_scale[:, c * bc:(c + 1) * bc], out_dtype=torch.float32, uniform=uniform) for c in range(num_chunks)]))


# -- the Triton kernel (Hopper) ------------------------------------------------------------------------------
# Decode-class launches (M <= matmul.PREFETCH_MAX_M) under PDL ask the L2 for the first PREFETCH_COLS weight
# columns of each program's rows before waiting for the previous kernel (kernels/_pdl.py): the bf16 matmul's
# 512 bytes per row. Measured (docs/performance.md, "FP8, second pass"): 0.1-0.7 us at M = 1 (H200), a decode
# step within noise. Speed only, and free.
PREFETCH_COLS = 512

# Tile configs by M. Why M may choose: BLOCK_K is the 128-column scale block in every config, and each output
# element runs the same block dots, scale products and fmas in the same order whichever tile holds it (the
# kernel's doc; asserted bitwise across every config on the GPU), so the config is where the work goes, not
# what a row computes. Measured on an H100 (`bench/bench_fp8.py --sweep`, docs/performance.md "FP8, third
# pass"): up to SMALL_TILES_MAX_M rows, 64 x 64 tiles (N = 4096: 64 programs streaming the weight) walking
# two K blocks per iteration (a long K of dependent steps, e.g. down_proj's 96 blocks, otherwise bounds a
# program's pace);
# above, 64 x 128 tiles read through TMA descriptors (fewer registers than pointer loads, no spills), best
# at every M from 256 to 4096 of the sweeps (128 x 128 tiles with 8 warps were within 5% at 4096, slower below).
# The small tiles' bound was 64 rows until a sweep at 96-384 rows (docs/performance.md, "FP8, ninth pass"): at
# 96 and 128 rows the 64 x 128 TMA grid has 64 programs on o_proj / down_proj (half the SMs idle: 20 and 53 us)
# where 64 x 64 tiles take 12 and 33 us; at 192+ rows the small tiles' 1-program-per-SM grid runs two waves.
SMALL_TILES_MAX_M = 128
_SMALL = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, STAGES=4, TMA=False, PAIRED=True)
_LARGE = dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, STAGES=4, TMA=True, PAIRED=False)
# A tiled weight (fp8_quant's layout) up to FEW_TOKENS_MAX_M rows: the tile swapped (SWAP), 64 weight rows by
# 16 tokens, so no 64-row activation tile is staged for a handful of tokens. Measured on an H100 with the
# tiled layout (docs/performance.md, "FP8, seventh pass"), us at M = 1: o_proj 10.3 -> 8.3, qkv 11.2 -> 9.8,
# gate_up 37.1 -> 36.1, down 21.4 -> 20.0 against the [N, K] layout's _SMALL; at 17-128 rows _SMALL's tiles
# (the swapped ones then re-read the weight per 16 tokens), above them _LARGE's, on either layout.
FEW_TOKENS_MAX_M = 16
_FEW = dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, STAGES=4, TMA=False, PAIRED=True, SWAP=True)
# At 17-128 rows, an output of more 64-wide tiles than the GPU has SMs (gate_up: 384) is paced by the weight
# stream rather than by one program's walk: 128-wide tiles, one block per iteration, serve it better (H100,
# tiled, `bench_fp8.py --sweep`: gate_up at M = 64 42.1 -> 40.2 us, at 96 / 128 against the TMA tiles 48.9 ->
# 42.8 / 49.8 -> 44.1; at M <= 16 no gain, so _FEW stays).
_SMALL_WIDE = dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, STAGES=3, TMA=False, PAIRED=False)


def kernel_config(m: int, tiled: bool = False, many_tiles: bool = False) -> dict:
    """The tile config for M rows of a weight in the [N, K] or the tiled layout (the constants above say why M
    may pick it; `many_tiles`: N / 64 exceeds the SM count). BLOCK_K is the scale block."""
    if tiled and m <= FEW_TOKENS_MAX_M:
        return dict(_FEW, BLOCK_K=BLOCK)
    if tiled and many_tiles and m <= SMALL_TILES_MAX_M:
        return dict(_SMALL_WIDE, BLOCK_K=BLOCK)
    return dict(_SMALL if m <= SMALL_TILES_MAX_M else _LARGE, BLOCK_K=BLOCK)


def uniform_block_rows(w_scale: torch.Tensor) -> bool:
    """Whether every aligned group of 128 rows of the per-row block scales [N, KB] holds one row's scales (a
    checkpoint's weights and fused parts of whole 128-row blocks: the kernel's UNIFORM path). Computed once per
    tensor (cached like fast mode's scale layouts; inside a CUDA graph capture, where a host sync is not
    allowed, an unknown tensor takes the per-element path: the same bits)."""
    def build() -> bool:
        n, kb = w_scale.shape
        rows = torch.cat((w_scale, w_scale[-1:].expand(-n % BLOCK, kb))) if n % BLOCK else w_scale
        groups = rows.reshape(-1, BLOCK, kb)
        return bool((groups == groups[:, :1]).all())

    if w_scale.shape[0] == 0:
        return True
    capturing = w_scale.is_cuda and torch.cuda.is_current_stream_capturing()
    return bool(per_weight_cached(w_scale, "uniform", None if capturing else build))


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA descriptors need 16-byte aligned bases and row strides (and a unit inner stride); a tiled weight is
    read as [N / 128, KB * 128, 128], so its tiles must be whole and its K blocks adjacent (a K slice is)."""
    def ok(t: torch.Tensor) -> bool:
        if t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
            return False
        if is_tiled(t):
            return t.stride()[1:] == (BLOCK * BLOCK, BLOCK, 1)
        return t.dim() == 2 and t.stride(1) == 1

    return _tensor_descriptor() is not None and all(ok(t) for t in tensors)


def _weight_descriptor(w_q: torch.Tensor, block_n: int):
    """The TMA descriptor of the weight's [block_n, 128] reads (2-D [N, K], or 3-D over a tiled weight)."""
    desc = _tensor_descriptor()
    if not is_tiled(w_q):
        return desc.from_tensor(w_q, [block_n, BLOCK])
    return desc(w_q, [w_q.shape[0], w_q.shape[1] * BLOCK, BLOCK], [w_q.stride(0), BLOCK, 1], [1, block_n, BLOCK])


@functools.cache
def _tensor_descriptor():
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # an older Triton: pointer loads (the same bits)
        return None
    return TensorDescriptor


def linear_fp8(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None, config: dict | None = None,
               uniform: bool | None = None) -> torch.Tensor:
    """The Triton path (CUDA, fp8 tensor cores: Hopper or newer; CPU tensors under TRITON_INTERPRET=1):
    x [..., K] (or `QuantizedRows`: its quantization done) -> [..., N] in `out_dtype` (default x's).
    `config` overrides `kernel_config` (tests and benchmark sweeps: every config gives the same bits);
    `uniform` overrides `uniform_block_rows(w_scale)` (the caller knows it, e.g. of the whole tensor a K
    slice comes from; False is always allowed)."""
    check_fp8_linear("linear_fp8", x, w_q, w_scale, bias)
    quantized = isinstance(x, QuantizedRows)
    check_fp8_kernel_device("linear_fp8", x.q if quantized else x, w_q, w_scale, bias)
    n = fp8_weight_shape(w_q)[0]
    x2 = x.q if quantized else _flat(x)
    if not (x2.shape[0] and n):
        return torch.empty(tuple(x.shape[:-1]) + (n,), dtype=out_dtype or x.dtype, device=x.device)
    a, sa = (x.q, x.scale) if quantized else quantize_activations_gpu(x2)
    y = linear_fp8_quantized(a, sa, w_q, w_scale, bias, out_dtype or x.dtype, config, uniform)
    return y.reshape(tuple(x.shape[:-1]) + (n,))


def linear_fp8_quantized(a: torch.Tensor, sa: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                         bias: torch.Tensor | None, out_dtype: torch.dtype, config: dict | None = None,
                         uniform: bool | None = None) -> torch.Tensor:
    """`linear_fp8`'s GEMM on activations already quantized (fp8 a [M, K] with fp32 scales sa [M, KB], as
    `quantize_activations` makes them: by a kernel that produced x, say) -> [M, N] in out_dtype."""
    import triton

    from detinfer.kernels._pdl import launch_options, use_pdl
    from detinfer.kernels.fp8_tiles import linear_fp8_kernel as kernel
    from detinfer.kernels.fp8_tiles import sum_runs_kernel
    from detinfer.kernels.matmul import PREFETCH_MAX_M, _num_sms

    n, k = fp8_weight_shape(w_q)
    m, tiled = a.shape[0], is_tiled(w_q)
    if a.dtype != FP8_DTYPE or a.shape != (m, k) or sa.shape != (m, num_blocks(k)) or sa.dtype != torch.float32:
        raise ValueError(f"linear_fp8_quantized: expected fp8 activations [M, {k}] and fp32 scales [M, "
                         f"{num_blocks(k)}], got {a.dtype} {tuple(a.shape)} and {sa.dtype} {tuple(sa.shape)}")
    y = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if not (m and n):
        return y
    uniform = uniform_block_rows(w_scale) if uniform is None else uniform
    a = a if a.stride(1) == 1 else a.contiguous()
    sa = sa if sa.stride(1) == 1 else sa.contiguous()
    if tiled:  # a K slice of a tiled weight keeps its group stride; its tiles must stay whole
        w_q = w_q if w_q.stride()[1:] == (BLOCK * BLOCK, BLOCK, 1) else w_q.contiguous()
    else:
        w_q = w_q if w_q.stride(1) == 1 else w_q.contiguous()  # a K slice keeps its row stride
    w_scale = w_scale if w_scale.stride(1) == 1 else w_scale.contiguous()
    kb = num_blocks(k)
    h = second_run_start(kb)
    if config is None and fp8_prefill_gemm.takes(a, w_q, y, kb, uniform):  # prefill sizes: the same bits
        return fp8_prefill_gemm.gemm(a, sa, w_q, w_scale, bias, y, kb, h)
    many = tiled and config is None and -(-n // _SMALL["BLOCK_N"]) > _num_sms(a.device)
    cfg, pdl = dict(config or kernel_config(m, tiled, many)), use_pdl(a.device)
    block = dict(BLOCK_M=cfg.pop("BLOCK_M"), BLOCK_N=cfg.pop("BLOCK_N"), BLOCK_K=cfg.pop("BLOCK_K", BLOCK))
    if tiled and BLOCK % block["BLOCK_N"]:
        raise ValueError(f"linear_fp8: a tiled weight is read in runs of BLOCK_N rows inside its {BLOCK}-row "
                         f"tiles; config BLOCK_N={block['BLOCK_N']} does not divide {BLOCK}")
    tma = cfg.pop("TMA") and _tma_ok(a, w_q)
    uniform = uniform and BLOCK % block["BLOCK_N"] == 0  # a tile inside one 128-row group of scales
    descs = (_tensor_descriptor().from_tensor(a, [block["BLOCK_M"], BLOCK]),
             _weight_descriptor(w_q, block["BLOCK_N"])) if tma else (a, w_q)
    grid = (triton.cdiv(m, block["BLOCK_M"]), triton.cdiv(n, block["BLOCK_N"]))
    split = (cfg.get("SPLIT") or _split_mode(m, n, grid, a.device)) if h < kb else 0
    if split not in (0, 1, 2) or (split == 2 and m * n >= 2 ** 31):
        raise ValueError(f"linear_fp8: config SPLIT={split} is not 1 or 2, or a program per K run at M x N = "
                         f"{m} x {n} would overflow the workspace's 32-bit offsets")
    ws = torch.empty((2, m, n), dtype=torch.float32, device=a.device) if split == 2 else y
    prefetch = PREFETCH_COLS if pdl and m <= PREFETCH_MAX_M and k >= PREFETCH_COLS and k % BLOCK == 0 else 0
    bias_arg = bias if bias is not None else w_scale
    kernel[grid + ((2,) if split == 2 else ())](
        *descs, a, sa, w_q, w_scale, bias_arg, y, ws, m, n, k, kb, h,
        a.stride(0), sa.stride(0), w_q.stride(0), w_q.stride(1) if tiled else BLOCK, w_scale.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, TMA=tma, TILED=tiled, SWAP=cfg.get("SWAP", False), UNIFORM=uniform,
        PAIRED=cfg.get("PAIRED", False), SPLIT=split,
        USE_PDL=pdl, PREFETCH_K=prefetch, STAGES=cfg["STAGES"], num_warps=cfg["num_warps"], **block,
        **launch_options(pdl))
    if split == 2:
        sum_runs_kernel[(triton.cdiv(m * n, _SUM_BLOCK),)](ws, bias_arg, y, m, n, HAS_BIAS=bias is not None,
                                                           USE_PDL=pdl, BLOCK=_SUM_BLOCK, num_warps=4,
                                                           **launch_options(pdl))
    return y


_SUM_BLOCK = 1024  # elements per program of sum_runs_kernel (elementwise: any size gives the same bits)


def _split_mode(m: int, n: int, grid: tuple, device: torch.device) -> int:
    """Where the two K runs go (the kernel's SPLIT; the same bits either way, asserted on the GPU): a program
    each (2) when the output's tiles leave SMs idle, else one program (1). Small tiles (up to SMALL_TILES_MAX_M
    rows): when the tiles fill at most half the SMs (a walk over the K blocks paces these launches:
    docs/performance.md, "FP8, sixth pass"; at 65-128 tiles one program per tile measured 4-6% faster).
    Large tiles: when there are at most as many tiles as SMs (down_proj at 192 / 256 rows, 96 / 128 tiles:
    54.8 -> 43.9 and 55.5 -> 45.6 us with the second launch included; at 384 rows, 192 tiles, 63.5 -> 70.6:
    "FP8, ninth pass"). The choice may follow M and the GPU because it changes no element's operations."""
    from detinfer.kernels.matmul import _num_sms

    tiles, sms = grid[0] * grid[1], _num_sms(device)
    few = 2 * tiles <= sms if m <= SMALL_TILES_MAX_M else tiles <= sms
    return 2 if few and m * n < 2 ** 31 else 1
