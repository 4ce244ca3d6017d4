"""Seeded random weights that any slice of can be drawn alone: a counter-based generator.

An element's value is a pure function of (seed, parameter name, row, column) of the full (TP=1)
Transformer parameter, computed with integer torch ops: rank r of a tensor-parallel group draws exactly
the values of the slice it owns (`models.sharding.shard_spec`) on its own device, without the full
tensor ever existing anywhere, and TP=1 draws the same function over the whole tensor, so TP=N's weights
are TP=1's, bit for bit. The integer hash and the conversion to floats are exact operations (integer
arithmetic, an int -> fp32 conversion of a value below 2^17, one correctly rounded fp32 multiply and add,
the cast to the model dtype), so a CPU and a GPU draw the same bits.

The hash: a 32-bit integer mixer (xor-shift, multiply by an odd constant below 2^31 so products stay
below 2^63 in int64, mask to 32 bits; twice) applied to row and column counters keyed by the seed and a
CRC of the parameter's name. Each value is the sum of the hash's two 16-bit halves, centred: a triangular
distribution with mean 0, scaled to the wanted standard deviation (light tails, which random-weight
experiments do not care about). Rows are drawn in chunks of at most CHUNK_ELEMENTS, so the temporaries stay
small whatever the tensor's size (the result is written straight into the slice in the model dtype).
"""

from __future__ import annotations

import math
import zlib

import torch

from detinfer.kernels.fp8_quant import quantize_weight_rows
from detinfer.models.config import ModelConfig
from detinfer.models.fp8 import SCALE_SUFFIX, fp8_parameters
from detinfer.models.sharding import shard_spec

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # odd, < 2^31: a uint32 times it fits an int64
CHUNK_ELEMENTS = 1 << 24  # int64 temporaries of a chunk: a few x 128 MiB at most
# std of (a + b - 65535) for a, b uniform on [0, 65535]: sqrt(2 (65536^2 - 1) / 12)
_TRIANGLE_STD = math.sqrt(2 * (65536 ** 2 - 1) / 12)


def mix32(x: int) -> int:
    """The mixer on a Python int (keys); `_mix32_` is the same on tensors."""
    for _ in range(2):
        x = (((x >> 16) ^ x) * _MUL) & _M32
    return (x >> 16) ^ x


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """In place on an int64 tensor of uint32 values."""
    for _ in range(2):
        x.bitwise_xor_(x >> 16).mul_(_MUL).bitwise_and_(_M32)
    return x.bitwise_xor_(x >> 16)


def parameter_key(seed: int, name: str) -> int:
    return mix32(zlib.crc32(name.encode()) ^ mix32((seed & _M32) ^ mix32(seed >> 32 & _M32)))


def init_scale(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) of a parameter: norms ~ 1 + N(0, 0.1), biases N(0, 0.1), matrices N(0, 1 / in_features)
    with in = the full tensor's last dim (the reduced one; embeddings: hidden) so activations stay O(1)."""
    if name.endswith("norm.weight"):
        return 1.0, 0.1
    if name.endswith(".bias"):
        return 0.0, 0.1
    return 0.0, 1.0 / math.sqrt(shape[-1])


def draw_block(key: int, rows: torch.Tensor, cols: torch.Tensor, mean: float, std: float,
               out: torch.Tensor) -> None:
    """out[i, j] = the value at (rows[i], cols[j]) of the parameter keyed `key` (out: [len(rows), len(cols)])."""
    row_hash = _mix32_(rows.to(torch.int64) ^ key)
    col_hash = _mix32_(cols.to(torch.int64) ^ mix32(key ^ 0x9E3779B9))
    h = _mix32_(row_hash[:, None] ^ col_hash[None, :])
    s = (h >> 16).add_(h.bitwise_and_(0xFFFF)).sub_(65535).to(torch.float32)  # exact: |s| < 2^17
    s.mul_(torch.tensor(std / _TRIANGLE_STD, dtype=torch.float32, device=s.device))
    if mean:
        s.add_(torch.tensor(mean, dtype=torch.float32, device=s.device))
    out.copy_(s)


def draw(key: int, row_ranges: list[tuple[int, int]], col_range: tuple[int, int],
         mean: float, std: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The rows `row_ranges` (concatenated) x columns `col_range` of the parameter keyed `key`, seen as
    [prod(shape[:-1]), shape[-1]] (1-D: [n, 1]); returned as [rows, cols] in `dtype` on `device`."""
    c0, c1 = col_range
    n_rows = sum(b - a for a, b in row_ranges)
    out = torch.empty(n_rows, c1 - c0, dtype=dtype, device=device)
    cols = torch.arange(c0, c1, device=device)
    step = max(1, CHUNK_ELEMENTS // max(1, c1 - c0))
    at = 0
    for a, b in row_ranges:
        for r in range(a, b, step):
            r_end = min(b, r + step)
            draw_block(key, torch.arange(r, r_end, device=device), cols, mean, std, out[at:at + r_end - r])
            at += r_end - r
    return out


def random_state(config: ModelConfig, *, seed: int, dtype: torch.dtype, device: torch.device | str,
                 rank: int = 0, size: int = 1) -> dict[str, torch.Tensor]:
    """Rank `rank` of `size`'s Transformer state dict of the seeded random model (size 1: all of it),
    drawn on `device` slice by slice (see the module doc)."""
    from detinfer.models.loader import full_parameter_shapes

    device = torch.device(device)
    shapes = full_parameter_shapes(config)
    fp8_params = set(fp8_parameters(shapes))
    state = {}
    for name, shape in shapes.items():
        if name.removesuffix(SCALE_SUFFIX) in fp8_params and name.endswith(SCALE_SUFFIX):
            continue  # made with its weight below
        spec = shard_spec(name, shape, config, rank, size)
        if name in fp8_params:
            state[name], state[name + SCALE_SUFFIX] = _draw_fp8_slice(parameter_key(seed, name), name, shape, spec,
                                                                      dtype, device)
        else:
            state[name] = _draw_slice(parameter_key(seed, name), name, shape, spec, dtype, device)
    return state


def _draw_fp8_slice(key: int, name: str, shape: tuple[int, ...], spec, dtype, device):
    """An FP8 parameter's slice: the `dtype` weight quantized in 128 x 128 blocks of the full (TP=1) parameter,
    and its per-row scales. A row-sharded 2-D slice is drawn out to whole 128-row blocks (then trimmed) so its
    scales are the full tensor's; column slices start on block edges (shard_spec checks) and stacked experts
    are quantized expert by expert, so those draw exactly their slice."""
    from detinfer.models.sharding import ShardSpec

    if spec.dim != 0 or len(shape) != 2:
        return quantize_weight_rows(_draw_slice(key, name, shape, spec, dtype, device))
    qs, ss = [], []
    for a, b in spec.ranges:
        a0, b0 = a // 128 * 128, min(shape[0], -(-b // 128) * 128)
        q, s = quantize_weight_rows(_draw_slice(key, name, shape, ShardSpec(0, ((a0, b0),)), dtype, device))
        qs.append(q[a - a0:b - a0])
        ss.append(s[a - a0:b - a0])
    return torch.cat(qs), torch.cat(ss)


def _draw_slice(key: int, name: str, shape: tuple[int, ...], spec, dtype, device) -> torch.Tensor:
    mean, std = init_scale(name, shape)
    cols = shape[-1] if len(shape) > 1 else 1
    rows_per = math.prod(shape[1:-1]) if len(shape) > 2 else 1  # rows of the [-1, cols] view per dim-0 index
    total_rows = math.prod(shape) // cols
    local = spec.local_shape(shape)
    if spec.dim is None:
        row_ranges, col_range = [(0, total_rows)], (0, cols)
    elif spec.dim == 0:
        row_ranges, col_range = [(a * rows_per, b * rows_per) for a, b in spec.ranges], (0, cols)
    elif spec.dim == 1 and len(shape) == 2:
        ((c0, c1),) = spec.ranges
        row_ranges, col_range = [(0, total_rows)], (c0, c1)
    else:
        raise ValueError(f"{name}: no random draw for a shard along dim {spec.dim} of shape {list(shape)}")
    body = draw(key, row_ranges, col_range, mean, std, dtype, device)
    if spec.pad:  # padded rows past the full tensor (the last vocab shard): zeros, as the loaders write
        body = torch.cat((body, body.new_zeros(spec.pad * rows_per, body.shape[1])))
    return body.reshape(local)
