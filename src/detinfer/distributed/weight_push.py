"""New full weights into a running tensor-parallel engine, in place, without restarting its workers.

Rank 0 holds the new weights whole (`{Transformer parameter name: full tensor}`, e.g. a trainer's weights or a
checkpoint read on rank 0). Each rank needs only its shard of each tensor, the slice `models.sharding.shard_spec`
names (the one rule the start-up loaders follow, so a pushed shard has the bits a freshly loaded engine's rank
holds). The tensors travel in buckets: consecutive parameters of one dtype, up to `bucket_bytes` together. For a
bucket, rank 0 cuts every rank's slices out of the full tensors and packs them, per rank, into one flat buffer
on its device; one scatter over the TP group (a data move: exact) hands rank r its buffer, and every rank
copies its pieces into its own parameters in place (`Tensor.copy_`: the storage stays, so captured CUDA graphs
replay with the new weights). On GPUs the scatter is a device-to-device NCCL transfer; on CPUs gloo carries
the same code path.

Every rank computes its shards' shapes from its own model, so the only thing rank 0 sends a worker over the
pipe is the bucket plan: lists of parameter names (`("load_weights", buckets)`, tp_worker.py).

Validation (names, full shapes, no quantized engine) happens on rank 0 before the first bucket moves, so a
bad state dict changes nothing. A failure during the transfer itself breaks the group like a failed step.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from detinfer.distributed.group import TPGroup
from detinfer.models.config import ModelConfig
from detinfer.models.sharding import shard_spec, take_shard

# 256 MiB: large enough that a bucket's scatter runs near the link's bandwidth, small enough that rank 0's P
# staging buffers (one per rank) stay a small fraction of a GPU's memory.
DEFAULT_BUCKET_BYTES = 1 << 28


def full_shapes(model_config: ModelConfig, ops) -> dict[str, tuple[int, ...]]:
    """Every parameter's full (TP=1) shape, from a model built on the meta device (no memory)."""
    from detinfer.models.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(model_config, ops)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def check_full_state(state: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """ValueError naming the first tensor the running model has no parameter for, or whose shape is wrong."""
    if not state:
        raise ValueError("no tensors to load")
    for name, tensor in state.items():
        if name not in shapes:
            raise ValueError(f"tensor {name}: the running model has no such parameter")
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise ValueError(f"tensor {name} must be a floating-point torch.Tensor, got "
                             f"{getattr(tensor, 'dtype', type(tensor).__name__)}")
        if tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"tensor {name} has shape {list(tensor.shape)}, the running model's is "
                             f"{list(shapes[name])}")


def plan_buckets(model: torch.nn.Module, names, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[list[str]]:
    """`names` (a subset of the model's parameters) in the model's order, cut into buckets of one dtype and at
    most `bucket_bytes` of this rank's shard bytes each (a larger tensor travels alone). Every rank's shards
    of a parameter have the same shape (shard_spec pads the last vocab shard), so the plan fits every rank."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    wanted, buckets, size, dtype = set(names), [], 0, None
    for name, p in model.named_parameters():
        if name not in wanted:
            continue
        nbytes = p.numel() * p.element_size()
        if not buckets or p.dtype != dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size, dtype = 0, p.dtype
        buckets[-1].append(name)
        size += nbytes
    return buckets


@torch.no_grad()
def send_bucket(group: TPGroup, model: torch.nn.Module, model_config: ModelConfig, names: list[str],
                state: Mapping[str, torch.Tensor]) -> None:
    """Rank 0's side of one bucket: every rank's slices of the full tensors, packed per rank and scattered."""
    params = dict(model.named_parameters())
    first, numel = params[names[0]], sum(params[n].numel() for n in names)
    parts = []
    for r in range(group.size):
        flat, at = torch.empty(numel, dtype=first.dtype, device=first.device), 0
        for name in names:
            full = state[name]
            piece = take_shard(full, shard_spec(name, tuple(full.shape), model_config, r, group.size))
            # one copy moves and casts (rounding as the engine's own copy_ would) straight into the buffer
            flat[at:at + piece.numel()].view(piece.shape).copy_(piece)
            at += piece.numel()
        parts.append(flat)
    _unpack(params, names, group.scatter(torch.empty_like(parts[0]), parts))


def receive_bucket(group: TPGroup, model: torch.nn.Module, names: list[str]) -> None:
    """A worker's side of one bucket: its flat buffer from rank 0, copied into its parameters."""
    params = dict(model.named_parameters())
    numel = sum(params[n].numel() for n in names)
    first = params[names[0]]
    _unpack(params, names, group.scatter(torch.empty(numel, dtype=first.dtype, device=first.device)))


@torch.no_grad()
def _unpack(params: Mapping[str, torch.Tensor], names: list[str], flat: torch.Tensor) -> None:
    at = 0
    for name in names:
        p = params[name]
        p.copy_(flat[at:at + p.numel()].view(p.shape))
        at += p.numel()


def receive_weights(group: TPGroup, model: torch.nn.Module, buckets: list[list[str]]) -> None:
    for names in buckets:
        receive_bucket(group, model, names)


def send_weights(group: TPGroup, model: torch.nn.Module, model_config: ModelConfig, buckets: list[list[str]],
                 state: Mapping[str, torch.Tensor]) -> None:
    for names in buckets:
        send_bucket(group, model, model_config, names, state)
