"""Block-scaled FP8 (e4m3) quantization: the format of Hugging Face FP8 checkpoints (Qwen3-*-FP8,
DeepSeek-V3) and of `--quantization fp8`, shared by the loader, the random-model builder and `fp8_linear`.

- Weights [..., N, K]: one fp32 scale per 128 x 128 block (HF's `weight_scale_inv`): the dequantized weight
  is `fp8 value * scale of its block`. Inside the model the block scales are kept expanded along the rows,
  `[..., N, ceil(K / 128)]` (row n holds its block's scales): fusing q/k/v or gate/up along the rows and
  sharding rows for tensor parallelism then slice the scales exactly as they slice the weight, even where a
  part's row count is not a multiple of 128 (1/32 of the fp8 weight's bytes).
- Activations [M, K] ("dynamic" scheme): one scale per token per 128-wide group along K, computed from that
  row alone, so quantizing a row never looks at another row (batch-invariant).
- `per_weight_cached`: what the linears derive once per weight-scale tensor (the Triton kernel's UNIFORM flag,
  fast mode's cuBLASLt scale layouts), kept while that tensor is unchanged.

A group's scale is amax * INV_FP8_MAX (448: e4m3's largest finite value; INV_FP8_MAX = 1/448 rounded once
to fp32) and its values are `fp8(x / scale)`, clamped to +-448 before the cast (a quotient may round a hair
above 448). A product, not amax / 448: torch's CUDA division by a scalar multiplies by the reciprocal while
its CPU division divides, so a quotient by a constant would differ between the two in the last bit; one
fp32 multiply, a tensor-by-tensor division (correctly rounded on both) and a max (exact in any order) give
the same bits on CPU, on GPU and in the Triton kernels (kernels/fp8_tiles.py).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
INV_FP8_MAX = float(torch.tensor(1.0 / FP8_MAX, dtype=torch.float32))  # exact in fp32: 448 * it == 1.0
BLOCK = 128  # the scale block along both N and K (weights) and the activation group along K
# amax below this counts as this: an all-zero group gets a finite scale (its values quantize to 0).
AMAX_FLOOR = 1e-12


def num_blocks(n: int) -> int:
    return -(-n // BLOCK)


def _quantize_groups(x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x fp32 and its group amax (broadcastable) -> (fp8 values, fp32 scales of amax's shape)."""
    scale = amax.clamp(min=AMAX_FLOOR) * INV_FP8_MAX  # the module doc: a product, the same on every device
    return (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def _pad_last(x: torch.Tensor, multiple: int, dim: int) -> torch.Tensor:
    """Zero-pad `dim` up to a multiple (zeros change no amax and quantize to zero)."""
    n = x.shape[dim]
    extra = num_blocks(n) * multiple - n
    if not extra:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat((x, x.new_zeros(shape)), dim=dim)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float) -> (x_q [M, K] fp8, scales [M, ceil(K / 128)] fp32), per token per 128-group."""
    if x.dim() != 2:
        raise ValueError(f"quantize_activations: expected x [M, K], got shape {tuple(x.shape)}")
    m, k = x.shape
    kb = num_blocks(k)
    xp = _pad_last(x.float(), BLOCK, 1).reshape(m, kb, BLOCK)
    amax = xp.abs().amax(-1, keepdim=True)
    q, scale = _quantize_groups(xp, amax)
    return q.reshape(m, kb * BLOCK)[:, :k], scale[..., 0]


@dataclass(frozen=True)
class QuantizedRows:
    """Activations [M, K] already quantized as `quantize_activations` quantizes them (fp8 values `q` [M, K],
    fp32 scales `scale` [M, ceil(K / 128)]), by the kernel that produced them (an RMSNorm, SiLU * mul), for
    an FP8 linear to take in place of the 16-bit rows: one launch fewer, the same bits. `dtype` is the dtype
    of the rows they stand for (the linear's output dtype)."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    def __post_init__(self):
        q, s = self.q, self.scale
        if q.dim() != 2 or q.dtype != FP8_DTYPE or s.dtype != torch.float32 or \
                tuple(s.shape) != (q.shape[0], num_blocks(q.shape[1])):
            raise ValueError(f"QuantizedRows: expected fp8 values [M, K] and fp32 scales [M, ceil(K/{BLOCK})], "
                             f"got {q.dtype} {tuple(q.shape)} and {s.dtype} {tuple(s.shape)}")

    @classmethod
    def of(cls, x: torch.Tensor) -> QuantizedRows:
        """x [M, K] quantized by `quantize_activations` (the definition; kernels match it bitwise)."""
        return cls(*quantize_activations(x), x.dtype)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def is_cuda(self) -> bool:
        return self.q.is_cuda

    def dim(self) -> int:
        return 2

    def columns(self, k0: int, k1: int) -> QuantizedRows:
        """Columns [k0, k1) (k0 on a group boundary, k1 one or K): the rows a K slice of whole groups
        would quantize to, since every group's scale depends on that group alone."""
        if k0 % BLOCK or (k1 % BLOCK and k1 != self.q.shape[1]):
            raise ValueError(f"QuantizedRows.columns: [{k0}, {k1}) must be whole {BLOCK}-column groups")
        return QuantizedRows(self.q[:, k0:k1], self.scale[:, k0 // BLOCK:num_blocks(k1)], self.dtype)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] (any float) -> (w_q [..., N, K] fp8, block scales [..., ceil(N/128), ceil(K/128)] fp32):
    each 128 x 128 block scaled by its own amax / 448 (what FP8 checkpoints store as weight_scale_inv;
    computed as amax * INV_FP8_MAX, the module doc)."""
    if w.dim() < 2:
        raise ValueError(f"quantize_weight: expected a weight [..., N, K], got shape {tuple(w.shape)}")
    n, k = w.shape[-2:]
    lead = w.shape[:-2]
    wp = _pad_last(_pad_last(w.float(), BLOCK, -1), BLOCK, -2)
    nb, kb = wp.shape[-2] // BLOCK, wp.shape[-1] // BLOCK
    blocks = wp.reshape(*lead, nb, BLOCK, kb, BLOCK)
    amax = blocks.abs().amax(dim=(-3, -1), keepdim=True)  # [..., NB, 1, KB, 1]
    q, scale = _quantize_groups(blocks, amax)
    q = q.reshape(*lead, nb * BLOCK, kb * BLOCK)[..., :n, :k]
    return q.contiguous(), scale.reshape(*lead, nb, kb)


def expand_block_rows(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """Block scales [..., ceil(rows/128), KB] -> per-row scales [..., rows, KB] (the model's layout)."""
    if scale.shape[-2] != num_blocks(rows):
        raise ValueError(f"weight scales have {scale.shape[-2]} row blocks, a weight of {rows} rows needs "
                         f"{num_blocks(rows)} (blocks of {BLOCK})")
    return scale.repeat_interleave(BLOCK, dim=-2)[..., :rows, :].contiguous()


def quantize_weight_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_weight` with the scales expanded to the model's per-row layout [..., N, KB]."""
    q, scale = quantize_weight(w)
    return q, expand_block_rows(scale, w.shape[-2])


def dequantize_weight(w_q: torch.Tensor, row_scales: torch.Tensor) -> torch.Tensor:
    """fp8 w_q [..., N, K] with per-row block scales [..., N, KB] -> fp32 [..., N, K]."""
    k = w_q.shape[-1]
    return w_q.float() * row_scales.repeat_interleave(BLOCK, dim=-1)[..., :k]


# -- the tiled weight layout ------------------------------------------------------------------------------
# A 2-D fp8 weight [N, K] may be stored tiled, [N / 128, K / 128, 128, 128]: row group g's K block kb is one
# contiguous 16 KB tile (`tile_weight`). The values are the same; only their order in memory changes, so every
# op computes the same bits from either layout. Why: a decode GEMM streams each output tile's rows block by
# block, and 64 rows x 128 bytes at a row stride of K bytes is 64 short reads, where the tiled layout makes it
# one contiguous 8 KB run (measured: docs/performance.md, "FP8, seventh pass"). Only whole blocks tile (N and
# K multiples of 128); the engine tiles a deterministic CUDA model's linears at start-up (models/fp8.py).
def is_tiled(w: torch.Tensor) -> bool:
    """Whether an fp8 weight is in the tiled layout (4-D) rather than [N, K]."""
    return w.dim() == 4


def fp8_weight_shape(w: torch.Tensor) -> tuple[int, int]:
    """(N, K) of a 2-D fp8 weight [N, K] or a tiled one [N / 128, K / 128, 128, 128]."""
    if w.dim() == 2:
        return tuple(w.shape)
    if w.dim() == 4 and tuple(w.shape[2:]) == (BLOCK, BLOCK):
        return w.shape[0] * BLOCK, w.shape[1] * BLOCK
    raise ValueError(f"an fp8 weight is [N, K] or tiled [N/{BLOCK}, K/{BLOCK}, {BLOCK}, {BLOCK}], got shape "
                     f"{tuple(w.shape)}")


def can_tile(w: torch.Tensor) -> bool:
    return w.dim() == 2 and w.shape[0] % BLOCK == 0 and w.shape[1] % BLOCK == 0 and w.numel() > 0


def tile_weight(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> tiled [N / 128, K / 128, 128, 128] (contiguous; N and K multiples of 128)."""
    if not can_tile(w):
        raise ValueError(f"tile_weight: N and K must be non-zero multiples of {BLOCK}, got shape {tuple(w.shape)}")
    n, k = w.shape
    return w.reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK).permute(0, 2, 1, 3).contiguous()


def untile_weight(w: torch.Tensor) -> torch.Tensor:
    """The [N, K] weight of either layout (a copy for a tiled one)."""
    if not is_tiled(w):
        return w
    n, k = fp8_weight_shape(w)
    return w.permute(0, 2, 1, 3).reshape(n, k)


def weight_k_blocks(w: torch.Tensor, b0: int, b1: int) -> torch.Tensor:
    """K blocks [b0, b1) of either layout, as a view (columns b0*128 .. b1*128 of [N, K])."""
    return w[:, b0:b1] if is_tiled(w) else w[:, b0 * BLOCK:b1 * BLOCK]


# What is derived once per weight-scale tensor (fast mode's block-scale layouts, the kernel's UNIFORM flag), by
# (id of the scale tensor, what), each entry holding a weak reference to that tensor and its version: a
# serving stack derives these once at load; here they are built at the first call and reused while the same
# tensor is unchanged (an in-place update bumps the version; a new tensor at a recycled id fails the identity
# check). Inference tensors (an engine's weights) have no version counter: nothing updates an FP8 engine's
# weights in place (engine/admin.py refuses weight loads into a quantized engine), so for them the identity
# check alone decides.
_PER_TENSOR: dict = {}
_PER_TENSOR_MAX = 8192  # entries (about eight per layer); cleared when full


def per_weight_cached(w_scale: torch.Tensor, what: str, build):
    """The cached value for (w_scale, what), else build() cached (build None: None on a miss)."""
    key = (id(w_scale), what)
    version = -1 if w_scale.is_inference() else w_scale._version
    hit = _PER_TENSOR.get(key)
    if hit is not None and hit[0]() is w_scale and hit[1] == version:
        return hit[2]
    if build is None:
        return None
    value = build()
    if len(_PER_TENSOR) >= _PER_TENSOR_MAX:
        _PER_TENSOR.clear()
    _PER_TENSOR[key] = (weakref.ref(w_scale), version, value)
    return value
