"""Which slice of each `Transformer` parameter a tensor-parallel rank holds: the one rule (`shard_spec`) that
the in-memory split (distributed/layers.py `shard_state`) and the sharded loaders (models/loader.py,
models/random_weights.py) follow, so every path gives a rank the same bits. The layouts themselves (column-,
row-, vocab- and expert-parallel) are described in distributed/layers.py and docs/tensor-parallel.md.

It depends on the model config only (no process group, no layers), so the model loaders can use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from detinfer.models.config import ModelConfig


def vocab_shard_size(vocab: int, size: int) -> int:
    return -(-vocab // size)


# -- weight sharding ------------------------------------------------------------------------------------
def _kv_heads_of(config: ModelConfig, rank: int, size: int) -> range:
    hkv = config.num_key_value_heads
    if hkv >= size:
        per = hkv // size
        return range(rank * per, (rank + 1) * per)
    head = rank // (size // hkv)  # replicated: the KV head this rank's q heads read
    return range(head, head + 1)


def expert_block(config: ModelConfig, rank: int, size: int) -> range:
    """The experts rank `rank` of `size` holds: the contiguous block [r E/P, (r+1) E/P)."""
    per = config.num_experts // size
    return range(rank * per, (rank + 1) * per)


@dataclass(frozen=True)
class ShardSpec:
    """The part of a full parameter one rank holds: the `ranges` [start, stop) along `dim` of the full tensor,
    concatenated in order, then `pad` zero slices along `dim` (the last vocab shard). dim None: all of it."""

    dim: int | None
    ranges: tuple[tuple[int, int], ...] = ()
    pad: int = 0

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.dim is None:
            return tuple(shape)
        n = sum(b - a for a, b in self.ranges) + self.pad
        return tuple(shape[:self.dim]) + (n,) + tuple(shape[self.dim + 1:])


REPLICATED = ShardSpec(None)


def shard_spec(name: str, shape: tuple[int, ...], config: ModelConfig, rank: int, size: int) -> ShardSpec:
    """Which slice of the full parameter `name` (a `Transformer` state-dict name, full `shape`) rank `rank` of
    `size` holds: the one rule both the in-memory split (`shard_state`) and the sharded loaders
    (models/loader.py `load_state`, models/random_weights.py) follow, so their shards are the same bits."""
    if size == 1:
        return REPLICATED
    d, hq = config.head_dim, config.num_attention_heads // size
    if name in ("embed_tokens", "lm_head"):
        per, vocab = vocab_shard_size(config.vocab_size, size), config.vocab_size
        start, stop = min(rank * per, vocab), min((rank + 1) * per, vocab)
        return ShardSpec(0, ((start, stop),), per - (stop - start))  # zero rows past the vocab: never looked up
    if len(shape) == 3:  # stacked experts [E, ...] (expert parallel): a contiguous block of E / P experts
        block = expert_block(config, rank, size)
        return ShardSpec(0, ((block.start, block.stop),))
    if ".qkv_proj." in name:
        kv = _kv_heads_of(config, rank, size)
        q0, k0 = config.q_size, config.q_size + config.kv_size
        return ShardSpec(0, ((rank * hq * d, (rank + 1) * hq * d), (q0 + kv.start * d, q0 + kv.stop * d),
                             (k0 + kv.start * d, k0 + kv.stop * d)))
    if ".gate_up_proj." in name:
        inter, per = config.intermediate_size, config.intermediate_size // size
        return ShardSpec(0, ((rank * per, (rank + 1) * per), (inter + rank * per, inter + (rank + 1) * per)))
    if name.endswith(("o_proj.weight_scale", "down_proj.weight_scale")):  # FP8: the K blocks of the K columns
        cols = shard_spec(name.removesuffix("_scale"), shape, config, rank, size)
        if any(a % 128 or b % 128 for a, b in cols.ranges):
            raise ValueError(f"{name}: an FP8 row-parallel shard must hold whole 128-column scale blocks, got "
                             f"columns {cols.ranges} at tensor_parallel_size {size}")
        return ShardSpec(1, tuple((a // 128, b // 128) for a, b in cols.ranges))
    if name.endswith("o_proj.weight"):
        return ShardSpec(1, ((rank * hq * d, (rank + 1) * hq * d),))
    if name.endswith("down_proj.weight"):
        per = config.intermediate_size // size
        return ShardSpec(1, ((rank * per, (rank + 1) * per),))
    return REPLICATED  # norms, routers, row-parallel biases


def take_shard(t: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """`spec`'s slice of the full tensor `t` (views where possible)."""
    if spec.dim is None:
        return t
    parts = [t.narrow(spec.dim, a, b - a) for a, b in spec.ranges]
    if spec.pad:
        shape = list(t.shape)
        shape[spec.dim] = spec.pad
        parts.append(t.new_zeros(shape))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=spec.dim)
