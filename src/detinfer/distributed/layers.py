"""Megatron-style tensor-parallel layers for the one `Transformer`, and how its weights are sharded.

Rank r of P holds:
- qkv_proj / gate_up_proj (column-parallel): its q heads' rows, its KV heads' k and v rows (gate and up rows
  of its slice of the intermediate dim). An output element's reduction is over the whole K, exactly as at
  TP=1, so these layers are unchanged (the matmul's bits do not depend on N).
- o_proj / down_proj (row-parallel, `RowParallelLinear`): the K columns matching those heads / that slice;
  its output is a sum over ranks, see below. Biases are added once, after the sum.
- KV heads: Hkv / P each when P divides Hkv; when Hkv < P (and P is a multiple of Hkv) each KV head is
  replicated on the P / Hkv ranks whose q heads use it.
- embed_tokens / lm_head (vocab-parallel): rows [r V', (r+1) V') with V' = ceil(V / P) (the last shard
  zero-padded). A token's embedding row comes from exactly one rank: deterministic mode gathers every rank's
  rows and picks the owner's (a copy, so bit-exact; summing "row + exact zeros" would turn -0.0 into +0.0).
  Logits: each rank's [S, V'] columns are gathered and concatenated (exact); a step that needs only each
  row's argmax (greedy rows, no processors, no logprobs) gathers each rank's best (value, id) and picks
  the first maximum instead (`pick_greedy`: the same token, exactly).
- norms, rotary: replicated.
- mixture-of-experts layers (`ExpertParallelMoE`): expert parallelism. The router is replicated (every rank
  routes every token identically: the hidden states entering the layer are the same on every rank); the
  experts are split in contiguous blocks, rank r owning [r E/P, (r+1) E/P). Each rank computes the slots
  (token, routing rank) routed to its experts; deterministic mode gathers every rank's slot outputs and picks
  each slot's owner's (a copy: exact), then sums a token's k slots in routing-rank order exactly as the
  one-device layer does, so the layer's output has the same bits at every P. Fast mode: each rank combines
  its own slots and the library all-reduce adds the ranks.
These rules live in one function, `models.sharding.shard_spec`, which the in-memory split (`shard_state`) and
the sharded loaders (a checkpoint's slices, a random preset's draws: models/loader.py, models/random_weights.py)
share.

Row-parallel sums, deterministic mode: every rank computes fp32 partials with `Ops.linear_tree` and the
ranks' results are added by `TPGroup.exact_sum`: the bits of all-gathering them and adding them in rank order
in the fixed pairwise tree, whatever the message size or batch (at P = 2 one fp32 all-reduce gives exactly
those bits: one commutative addition). With `tp_invariant_reduction`, the K dim is cut into
C = `tp_invariant_chunks(config)` chunks fixed by the model shape; rank r sums its C/P chunks with the pairwise
tree and the P results finish the same tree, so every P dividing C gives what TP=1 gives with the same chunks
(kernels/chunked_linear.py).
Without it each rank's partial is one chunk (deterministic, but its bits depend on P). Fast mode: the plain
matmul and the library's all-reduce.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from detinfer.distributed.group import TPGroup
from detinfer.kernels.chunked_linear import TREE_MAX_PARTIAL_ELEMS
from detinfer.models.config import ModelConfig
from detinfer.models.sharding import expert_block, shard_spec, take_shard, vocab_shard_size
from detinfer.models.transformer import MLP, Transformer, fp8_scale_param
from detinfer.ops import Ops

# The most ranks the chunk tree is built for: one 8-GPU node, the usual limit of tensor parallelism (beyond
# it, interconnects make pipeline parallelism the better split). C is fixed per model so the tree's shape
# never follows the TP size; more chunks would only cost more fp32 partials at small TP sizes.
MAX_TP_CHUNKS = 8


def _has_dense_mlp(config: ModelConfig) -> bool:
    """Whether some layer has a dense MLP (split by intermediate size); MoE layers split by expert instead."""
    return len(config.moe_layers) < config.num_hidden_layers


def tp_invariant_chunks(config: ModelConfig) -> int:
    """C: the largest power of two <= MAX_TP_CHUNKS dividing both row-parallel K dims' units (the attention
    head count and, where a dense MLP exists, the intermediate size), so every rank of any TP size dividing C
    owns whole chunks."""
    c = MAX_TP_CHUNKS
    while c > 1 and (config.num_attention_heads % c or (_has_dense_mlp(config) and config.intermediate_size % c)):
        c //= 2
    return c


def _tp_problem(config: ModelConfig, size: int, invariant: bool) -> str | None:
    if config.num_attention_heads % size:
        return f"num_attention_heads={config.num_attention_heads} is not a multiple of it"
    hkv = config.num_key_value_heads
    if hkv % size and size % hkv:
        return f"num_key_value_heads={hkv} neither divides it nor is a multiple of it"
    if _has_dense_mlp(config) and config.intermediate_size % size:
        return f"intermediate_size={config.intermediate_size} is not a multiple of it"
    if config.num_experts % size:  # 0 for dense models
        return f"num_experts={config.num_experts} is not a multiple of it (experts are split in equal blocks)"
    if invariant and tp_invariant_chunks(config) % size:
        return (f"with tp_invariant_reduction it must divide this model's {tp_invariant_chunks(config)} "
                "reduction chunks")
    return _fp8_tp_problem(config, size, invariant)


def _fp8_tp_problem(config: ModelConfig, size: int, invariant: bool) -> str | None:
    """FP8 row-parallel layers quantize activations in 128-column groups and hold scales per 128 columns, so
    each rank's (or, with tp_invariant_reduction, each chunk's) K slice must be whole 128-column blocks."""
    pieces = tp_invariant_chunks(config) if invariant else size
    if config.quantization is None or pieces == 1:
        return None
    dims = [("the attention's q size", config.q_size)]
    if _has_dense_mlp(config):
        dims.append(("intermediate_size", config.intermediate_size))
    for what, k in dims:
        if (k // pieces) % 128:
            return (f"FP8 needs whole 128-column scale blocks per row-parallel slice, but {what}={k} splits into "
                    f"{pieces} slices of {k // pieces}")
    return None


def check_tp_config(config: ModelConfig, size: int, invariant: bool = False) -> None:
    """Raise a ValueError naming the problem and the TP sizes this model allows."""
    problem = _tp_problem(config, size, invariant) if size > 1 else _fp8_tp_problem(config, 1, invariant)
    if problem is not None:
        allowed = [p for p in range(1, config.num_attention_heads + 1) if _tp_problem(config, p, invariant) is None]
        raise ValueError(f"tensor_parallel_size={size} does not fit {config.architecture}: {problem}; "
                         f"allowed sizes for this model: {allowed}")


def local_config(config: ModelConfig, size: int) -> ModelConfig:
    """The per-rank shapes (vocab_size stays the full one: logits are gathered to the full width)."""
    return dataclasses.replace(config, num_attention_heads=config.num_attention_heads // size,
                               num_key_value_heads=max(1, config.num_key_value_heads // size),
                               intermediate_size=config.intermediate_size // size)


def shard_state(model: Transformer, config: ModelConfig, rank: int, size: int,
                device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Rank `rank`'s weights of the full `model`, as new contiguous tensors named like the local model's, on
    `device` (default: the model's; copied there slice by slice, never as a whole shard on the model's)."""
    out = {}
    for name, p in model.named_parameters():
        t = take_shard(p.detach(), shard_spec(name, tuple(p.shape), config, rank, size))
        out[name] = (t.clone() if device is None else t.to(device, copy=True)).contiguous()
    return out


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes a model's parameters occupy (what a rank holds resident of the weights)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


# -- the layers -------------------------------------------------------------------------------------------
class RowParallelLinear(nn.Module):
    """o_proj / down_proj: weight [N, K / P] (+ bias [N], added once after the cross-rank sum). `group` None:
    TP=1 running the chunk tree (tp_invariant_reduction). `chunks`: this rank's K chunks (None: one)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: TPGroup | None,
                 chunks: int | None, fp8: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.weight_scale = fp8_scale_param(out_features, in_features) if fp8 else None  # FP8 (models/fp8.py)
        self.group, self.chunks = group, chunks

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        g, scale = self.group, self.weight_scale
        if g is not None and not ops.deterministic:
            y = ops.linear(x, self.weight) if scale is None else ops.linear_fp8(x, self.weight, scale)
            y = g.fast_sum(y)  # fast mode: the peer kernel or the library's all-reduce
            return y if self.bias is None else y + self.bias
        chunks = self.chunks or 1
        push = self._push_target(x, ops)
        if scale is not None:
            parts = ops.linear_fp8_tree(x, self.weight, scale, chunks)[None]  # this rank's subtree, summed
        elif x.numel() // x.shape[-1] * self.weight.shape[0] * chunks <= TREE_MAX_PARTIAL_ELEMS:
            parts = ops.linear_parts(x, self.weight, chunks) if push is None else \
                ops.linear_parts(x, self.weight, chunks, push)  # fp32 [C / P, T, N]: the subtree's leaves
        else:  # a long prefill: the tree in row blocks, summed here
            parts = ops.linear_tree(x, self.weight, chunks)[None]
        if g is None:
            return ops.tree_sum_rounded(parts, self.bias, x.dtype)
        if g.peer is not None and g.peer.fits_norm(parts) and x.dim() == 2:
            # The next RMSNorm sums it in its kernel (which only receives when the matmul pushed it).
            return PendingSum(g, ops, parts, self.bias, x.dtype, pushed=push is not None)
        # The subtree, the tree's top levels in rank order on every rank, + bias, rounded.
        return g.exact_sum_rounded(parts, self.bias, x.dtype)

    def _push_target(self, x: torch.Tensor, ops: Ops):
        """Where this layer's matmul sends its fp32 partial as it stores it (`kernels.peer_push`): two GPUs with
        the peer kernel, deterministic 16-bit weights on the Triton path, one chunk (without
        tp_invariant_reduction), 2-D decode-sized input (`PeerSum.push_for`); else None (the sum kernel
        sends). Every rank decides alike: it depends on shapes and the engine's config only."""
        g = self.group
        if g is None or g.peer is None or self.weight_scale is not None or (self.chunks or 1) != 1 \
                or x.dim() != 2 or not ops.pushes_parts(x, self.weight):
            return None
        return g.peer.push_for(x.shape[0], self.weight.shape[0])


class PendingSum:
    """A row-parallel layer's output whose cross-rank sum is not done yet: the RMSNorm that follows it in
    every decoder block (`models.transformer.RMSNorm`) calls `rms_norm_fused`, which sums and normalizes in
    one kernel (`kernels.peer_sum_norm`: the bits of the sum, then `rms_norm`). Nothing else reads it.
    `pushed`: the matmul already sent this rank's partial to the peer; the sum kernel must consume it (the
    peer's sum kernel waits for it), so every path below runs that kernel."""

    def __init__(self, group: TPGroup, ops: Ops, parts: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype, pushed: bool = False):
        self.group, self.ops, self.parts, self.bias, self.dtype = group, ops, parts, bias, dtype
        self.transport = "pushed" if pushed else "flags"

    def rms_norm_fused(self, weight: torch.Tensor, eps: float, residual: torch.Tensor | None):
        peer = self.group.peer
        if residual is not None and (residual.dtype != self.dtype or not residual.is_contiguous()):
            # Unusual input: the rounded sum, then the norm with that residual (the bits of the unfused path).
            x, _ = peer.sum_rms_norm(self.parts, self.bias, self.dtype, None, eps, None, self.transport,
                                     want_sum=True)
            return self.ops.rms_norm(x, weight, eps, residual=residual)
        return peer.sum_rms_norm(self.parts, self.bias, self.dtype, weight, eps, residual, self.transport)


class ExpertParallelMoE(nn.Module):
    """A MoE layer holding experts [first_expert, first_expert + E / P) and the full router (module doc).
    Parameters are named as `SparseMoE`'s, so a rank's `shard_state` loads into it."""

    def __init__(self, config: ModelConfig, group: TPGroup, size: int):
        super().__init__()
        E, H, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        block = expert_block(config, group.rank, size)
        self.group, self.first_expert, self.experts_per_rank = group, block.start, len(block)
        self.num_experts, self.top_k, self.renormalize = E, config.num_experts_per_tok, config.norm_topk_prob
        self.router = nn.Parameter(torch.empty(E, H), requires_grad=False)
        self.gate_up_proj = nn.Parameter(torch.empty(len(block), 2 * inter, H), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(len(block), H, inter), requires_grad=False)
        fp8 = config.quantization == "fp8"  # FP8 experts: their per-row block scales beside them
        self.gate_up_proj_scale = fp8_scale_param(len(block), 2 * inter, H) if fp8 else None
        self.down_proj_scale = fp8_scale_param(len(block), H, inter) if fp8 else None

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        if x.shape[0] == 0:  # every rank has the same tokens, so all skip the collective together
            return x.new_zeros(x.shape)
        weights, ids = ops.moe_route(x, self.router, self.top_k, self.renormalize)
        if self.gate_up_proj_scale is not None:
            y = ops.moe_expert_outputs_fp8(x, ids, self.gate_up_proj, self.gate_up_proj_scale, self.down_proj,
                                           self.down_proj_scale, self.first_expert)
        else:
            y = ops.moe_expert_outputs(x, ids, self.gate_up_proj, self.down_proj, self.first_expert,
                                       self.num_experts)  # [T, k, H]: this rank's slots, zeros elsewhere
        if not ops.deterministic:
            return self.group.fast_sum(ops.moe_combine(weights, y, x.dtype))
        peer = self.group.peer
        if peer is not None and peer.fits_combine(y):  # two GPUs: each slot read from its owner, one kernel
            return peer.combine(weights, ids, y, self.experts_per_rank, x.dtype)
        y = pick_slot_owners(self.group.all_gather(y), ids, self.experts_per_rank)
        return ops.moe_combine(weights, y, x.dtype)


def pick_slot_owners(gathered: torch.Tensor, ids: torch.Tensor, experts_per_rank: int) -> torch.Tensor:
    """gathered [P, T, k, H] (rank p's slot outputs at [p]) -> [T, k, H], slot (t, r) copied from the rank
    owning expert ids[t, r]: a data move, so every slot has its computing rank's exact bits."""
    owner = (ids // experts_per_rank)[None, :, :, None].expand(1, -1, -1, gathered.shape[-1])
    return gathered.gather(0, owner)[0]


class TPTransformer(Transformer):
    """A `Transformer` over rank-local shapes (`local_config`) with vocab-parallel embedding and logits."""

    tp_group: TPGroup
    full_vocab: int

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        g, per = self.tp_group, self.embed_tokens.shape[0]
        local = input_ids - g.rank * per
        mine = (local >= 0) & (local < per)
        rows = F.embedding(local.clamp(0, per - 1), self.embed_tokens)
        rows = torch.where(mine[:, None], rows, torch.zeros_like(rows))  # [T, hidden]
        if not self.ops.deterministic:
            return g.fast_sum(rows)
        gathered = g.all_gather(rows)  # [P, T, hidden]; token t's row is at [owner(t), t]
        owner = (input_ids // per)[None, :, None].expand(1, -1, rows.shape[-1])
        return gathered.gather(0, owner)[0]

    gathers_logits = True

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's [S, V'] columns -> the full rows [S, V] (a data move: exact)."""
        gathered = self.tp_group.all_gather(local)  # [P, S, V']
        full = gathered.permute(1, 0, 2).reshape(local.shape[0], -1)
        return full[:, :self.full_vocab]

    def greedy_ids(self, local: torch.Tensor) -> torch.Tensor:
        """Each row's argmax over the full vocabulary from the ranks' own argmaxes: bitwise the argmax of
        `gather_logits(local)`, with P x 16 bytes per row gathered instead of the row (`pick_greedy`)."""
        g, per = self.tp_group, local.shape[1]
        valid = max(0, min(per, self.full_vocab - g.rank * per))  # the last shard's zero padding is no token
        return pick_greedy(g.all_gather(local_argmax(local[:, :valid], g.rank * per)))


def local_argmax(local: torch.Tensor, first_id: int) -> torch.Tensor:
    """local [S, n] fp32 logits columns starting at token `first_id` -> [S, 2] int64: each row's maximum
    (its fp32 bits) and the token id of its first occurrence. A shard with no columns offers -inf at
    `first_id`, which never wins: an earlier rank's candidate comes first in any tie."""
    if local.shape[1] == 0:
        best = torch.full((local.shape[0],), float("-inf"), dtype=torch.float32, device=local.device)
        idx = torch.zeros(local.shape[0], dtype=torch.int64, device=local.device)
    else:
        idx = torch.argmax(local, dim=-1)  # the first maximum; a NaN counts as the maximum
        best = local.gather(1, idx[:, None])[:, 0]
    return torch.stack([best.view(torch.int32).to(torch.int64), idx + first_id], dim=1)


def pick_greedy(candidates: torch.Tensor) -> torch.Tensor:
    """candidates [P, S, 2] (`local_argmax` of each rank's shard, ranks in vocabulary order) -> [S] int64 token
    ids. argmax over the ranks' maxima returns the first rank holding the row's maximum (or its first NaN);
    that rank's candidate is its first occurrence, and every earlier rank's columns are lower ids: so this
    is the first maximum of the whole row, what argmax over the gathered row returns."""
    values = candidates[..., 0].to(torch.int32).view(torch.float32)  # [P, S]
    owner = torch.argmax(values, dim=0)
    return candidates[..., 1].gather(0, owner[None])[0]


def _moe_layers(model: Transformer):
    for layer in model.layers:
        if not isinstance(layer.mlp, MLP):
            yield layer


def _row_parallel_layers(model: Transformer):
    for layer in model.layers:
        yield layer.self_attn, "o_proj"
        if hasattr(layer.mlp, "down_proj") and isinstance(layer.mlp.down_proj, nn.Module):
            yield layer.mlp, "down_proj"


def build_local_model(config: ModelConfig, size: int, ops: Ops, group: TPGroup, state: dict[str, torch.Tensor],
                      device: torch.device, invariant: bool) -> TPTransformer:
    """Rank `group.rank`'s model from its `state` (`shard_state`), tensors moved to `device`."""
    lc = local_config(config, size)
    chunks = tp_invariant_chunks(config) // size if invariant else None
    with torch.device("meta"):
        model = TPTransformer(lc, ops)
        for owner, name in _row_parallel_layers(model):
            old = getattr(owner, name)
            setattr(owner, name, RowParallelLinear(old.weight.shape[1], old.weight.shape[0], old.bias is not None,
                                                   group, chunks, fp8=old.weight_scale is not None))
        for layer in _moe_layers(model):
            layer.mlp = ExpertParallelMoE(config, group, size)
        per = vocab_shard_size(config.vocab_size, size)
        model.embed_tokens = nn.Parameter(torch.empty(per, config.hidden_size), requires_grad=False)
        if model.lm_head is not None:
            model.lm_head = nn.Parameter(torch.empty(per, config.hidden_size), requires_grad=False)
    model.tp_group, model.full_vocab = group, config.vocab_size
    model.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=True, assign=True)
    model.rotary.reset_parameters(device)
    model.eval()
    return model


def use_chunk_tree(model: Transformer, config: ModelConfig) -> Transformer:
    """TP=1 with tp_invariant_reduction: o_proj / down_proj compute the C-chunk tree (same weights, in place)."""
    check_tp_config(config, 1, invariant=True)
    chunks = tp_invariant_chunks(config)
    for owner, name in _row_parallel_layers(model):
        old = getattr(owner, name)
        if isinstance(old, RowParallelLinear):
            continue
        new = RowParallelLinear.__new__(RowParallelLinear)
        nn.Module.__init__(new)
        new.weight, new.bias, new.group, new.chunks = old.weight, old.bias, None, chunks
        new.weight_scale = old.weight_scale
        setattr(owner, name, new)
    return model
