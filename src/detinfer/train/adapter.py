"""The one interface between training and the model: how a training forward runs the engine's module.

Contract with the model (all that training relies on; `TrainingForward` is the adapter class):
  * the model computes with its one numerics backend `model.ops` (see detinfer.ops.backend), passed down
    to every submodule in forward: `ops.linear`, `ops.rms_norm(x, w, eps, residual=)`, `ops.silu_mul`,
    `ops.linear_silu_mul(x, w, b)` (the MLP's gate_up + SiLU*mul),
    `ops.qk_norm_rope(positions, q, k, inv_freq, q_weight, k_weight, eps)`, `ops.rope(positions, q, k,
    inv_freq)`, `ops.logits(hidden, weight)`, `ops.log_softmax`;
  * `model(input_ids [T], positions [T], attn) -> hidden [T, H]` with `attn(layer_idx, q, k, v)`,
    `model.compute_logits(hidden) -> fp32 logits` (= `ops.logits(hidden, model.output_weight)`; scoring
    calls `ops.linear` + `ops.log_softmax` on `model.output_weight` itself, in row chunks: logprobs.py),
    and `model.layers`, each called as `layer(h, residual, positions, rotary, attn, ops)` (activation
    checkpointing wraps these calls);
  * `F.embedding(ids, model.embed_tokens)`;
  * the Ops' `paged_attention` / `write_kv` are the attention functions the engine calls
    (`paged_attention(..., lse_out=)` also stores the rows' log-sum-exps, for the attention backward).
For the duration of one forward (`TrainingForward.run`) the adapter
  * sets `model.ops` to `DifferentiableOps` (forward = the engine's op, backward = ours),
  * routes `F.embedding` on the model's embedding weight through `EmbeddingFn` (a TorchFunctionMode),
and passes `PackedPagedAttention` as `attn`: it writes the packed K/V into a temporary paged KV cache with
contiguous block tables and calls the very attention function the engine's runner calls. The engine's
attention is invariant to chunking and block layout, so the bits equal what the engine computed.
Everything is restored afterwards. Not thread-safe: do not step the engine during a training forward.

Fast mode swaps in the model's Ops in fast mode (F.linear, torch norms and softmax: plain autograd) and a
stock attention over the whole packed batch in one call (fast_attention.py: torch's varlen flash attention
where available, else SDPA over a padded batch), on the same module and weights.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.overrides import TorchFunctionMode

from detinfer.train.fast_attention import SDPAAttention
from detinfer.train.functions import (
    AttentionFn,
    EmbeddingFn,
    LinearFn,
    MoEFn,
    QKNormRopeFn,
    RMSNormFn,
    RotaryFn,
    SiLUMulFn,
)

__all__ = ["DifferentiableOps", "PackedPagedAttention", "SDPAAttention", "TrainingForward",
           "attention_functions"]


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class DifferentiableOps:
    """Ops-like object: each op's forward is `base.<op>` (the engine's bits), its backward a fixed-order
    kernel. Without autograd it is `base` itself."""

    def __init__(self, base):
        self.base = base
        self.mode = base.mode

    @property
    def deterministic(self) -> bool:
        return self.base.deterministic

    def linear(self, x, weight, bias=None):
        if not _needs_grad(x, weight, bias):
            return self.base.linear(x, weight, bias)
        return LinearFn.apply(x, weight, bias, self.base.linear)

    def linear_tree(self, x, weight, num_chunks):
        """Row-parallel layers under tp_invariant_reduction: the base's chunk tree forward (fp32 out; the
        bits of a TP=N engine with the flag), `linear`'s backward (the same product, so the same gradient)."""
        if not _needs_grad(x, weight):
            return self.base.linear_tree(x, weight, num_chunks)
        return LinearFn.apply(x, weight, None, lambda x_, w_, _b: self.base.linear_tree(x_, w_, num_chunks))

    def linear_parts(self, x, weight, num_chunks):
        """The chunk partials before the tree; under autograd one part, the differentiable summed tree above
        (`tree_sum_rounded` of one part is then the plain epilogue: the same bits)."""
        if not _needs_grad(x, weight):
            return self.base.linear_parts(x, weight, num_chunks)
        return self.linear_tree(x, weight, num_chunks)[None]

    @staticmethod
    def pushes_parts(x, weight) -> bool:
        """Never: a trainer's row-parallel partials are summed by the sum kernel's own exchange (the engine's
        matmul-side send is an inference path, `kernels.peer_push`)."""
        return False

    def tree_sum_rounded(self, parts, bias, dtype):
        if not _needs_grad(parts, bias):
            return self.base.tree_sum_rounded(parts, bias, dtype)
        y = parts[0] if parts.shape[0] == 1 else self.base.tree_sum(parts)  # elementwise torch adds
        return (y if bias is None else y + bias.float()).to(dtype)

    def rms_norm(self, x, weight, eps, residual=None):
        if not _needs_grad(x, weight, residual):
            return self.base.rms_norm(x, weight, eps, residual=residual)
        return RMSNormFn.apply(x, weight, residual, eps, self.base.rms_norm)

    def silu_mul(self, gate, up):
        if not _needs_grad(gate, up):
            return self.base.silu_mul(gate, up)
        return SiLUMulFn.apply(gate, up, self.base.silu_mul)

    def linear_silu_mul(self, x, weight, bias=None):
        """The MLP's gate_up + SiLU*mul: the base's fused op without autograd; with it, `linear` then
        `silu_mul` through their Functions (the same forward bits, kernels/linear_silu_mul.py)."""
        if not _needs_grad(x, weight, bias):
            return self.base.linear_silu_mul(x, weight, bias)
        gate, up = self.linear(x, weight, bias).split(weight.shape[0] // 2, dim=-1)
        return self.silu_mul(gate, up)

    def embedding(self, ids, weight):
        """For a backend that routes the embedding gather through ops (today the model calls F.embedding)."""
        fwd = getattr(self.base, "embedding", None)
        if not _needs_grad(weight):
            return fwd(ids, weight) if fwd is not None else F.embedding(ids, weight)
        return EmbeddingFn.apply(ids, weight)

    def log_softmax(self, x, dim=-1, dtype=torch.float32):
        return self.base.log_softmax(x, dim=dim, dtype=dtype)

    def logits(self, hidden, weight):
        return self.linear(hidden, weight).float()  # what base.logits computes, through LinearFn

    def rope(self, positions, q, k, inv_freq):
        if not _needs_grad(q, k):
            return self.base.rope(positions, q, k, inv_freq)
        return RotaryFn.apply(q, k, positions, _Rope(inv_freq, self.base))

    def qk_norm_rope(self, positions, q, k, inv_freq, q_weight=None, k_weight=None, eps=1e-6):
        """The engine's fused prologue in the forward (the same kernel and bits), unfused backwards."""
        if not _needs_grad(q, k, q_weight, k_weight):
            return self.base.qk_norm_rope(positions, q, k, inv_freq, q_weight, k_weight, eps)
        return QKNormRopeFn.apply(q, k, q_weight, k_weight, positions, inv_freq, eps, self.base.qk_norm_rope)

    def softmax(self, x, dim=-1, dtype=torch.float32):
        return self.base.softmax(x, dim=dim, dtype=dtype)

    def moe(self, x, router_weight, w_gate_up, w_down, top_k, renormalize):
        """The engine's MoE layer forward; with autograd, `MoEFn`'s fixed-order backward."""
        if not _needs_grad(x, router_weight, w_gate_up, w_down):
            return self.base.moe(x, router_weight, w_gate_up, w_down, top_k, renormalize)
        return MoEFn.apply(x, router_weight, w_gate_up, w_down, top_k, renormalize, self.base)


class _Rope:
    """The backend's rotation as RotaryFn takes it: `rope(positions, q, k)` with its `inv_freq`."""

    def __init__(self, inv_freq, base):
        self.inv_freq, self.base = inv_freq, base

    def __call__(self, positions, q, k):
        return self.base.rope(positions, q, k, self.inv_freq)


class _EmbeddingRoute(TorchFunctionMode):
    """Routes F.embedding(ids, weight) for the model's embedding weight through EmbeddingFn."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.embedding and len(args) >= 2 and args[1] is self.weight and not kwargs \
                and _needs_grad(args[1]):
            return EmbeddingFn.apply(args[0], args[1])
        return func(*args, **kwargs)


def attention_functions(model, runner=None):
    """(attend, write): the deterministic paged attention and KV write of the engine runner's Ops when a
    runner is given, else of the model's Ops (the backend's one rule picks kernel or reference)."""
    ops = (runner.ops if runner is not None else model.ops).replace(mode="deterministic")
    return ops.paged_attention, ops.write_kv


class PackedPagedAttention:
    """`attn(layer_idx, q, k, v)` for a packed training batch: full causal attention within each sequence
    (positions 0..L-1), computed by the engine's paged attention over a temporary cache, differentiable.
    `attend` takes `lse_out=` (`Ops.paged_attention`): the forward stores the rows' log-sum-exps for the
    backward (AttentionFn), unless `reuse_forward_lse` is False (the backward then recomputes them)."""

    reuse_forward_lse = True

    def __init__(self, attend, write, cu_seqlens: list[int], scale: float, block_size: int,
                 device: torch.device):
        self.attend, self.write, self.cu, self.scale, self.block_size = attend, write, cu_seqlens, scale, \
            block_size
        lens = [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]
        blocks = [-(-n // block_size) for n in lens]
        width = max([1] + blocks)
        tables, slots, first = [], [], 0
        for n, nb in zip(lens, blocks):
            tables.append(list(range(first, first + nb)) + [0] * (width - nb))
            slots.extend(first * block_size + p for p in range(n))
            first += nb
        self.num_blocks = max(1, first)
        self.block_tables = torch.tensor(tables, dtype=torch.int32, device=device).reshape(len(lens), width)
        self.kv_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        self.cu_q = torch.tensor(cu_seqlens, dtype=torch.int32, device=device)
        self.slots = torch.tensor(slots, dtype=torch.int64, device=device)
        self.max_len = max([1] + lens)

    def _forward(self, q, k, v, lse_out=None):
        shape = (self.num_blocks, self.block_size, k.shape[1], k.shape[2])
        k_cache = torch.zeros(shape, dtype=k.dtype, device=k.device)
        v_cache = torch.zeros(shape, dtype=v.dtype, device=v.device)
        self.write(k, v, k_cache, v_cache, self.slots, validate=False)
        return self.attend(q, k_cache, v_cache, self.block_tables, self.kv_lens, self.cu_q, self.scale,
                           max_q_len=self.max_len, max_kv_len=self.max_len, validate=False,
                           **({} if lse_out is None else {"lse_out": lse_out}))

    def __call__(self, layer_idx, q, k, v):
        if not _needs_grad(q, k, v):
            return self._forward(q, k, v)
        return AttentionFn.apply(q, k, v, self._forward, self.cu, self.scale, self.reuse_forward_lse)


def _checkpointed(forward):
    """A layer forward whose activations are recomputed in backward instead of kept (torch's
    non-reentrant checkpoint). The recompute calls the same ops with the same inputs, so it reproduces the
    saved tensors bit for bit (the ops are deterministic) and the backward is unchanged."""
    def run(*args):
        # no RNG state to stash and restore: the layers draw no random numbers
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False)
    return run


class TrainingForward:
    """Runs the model's own forward with training ops swapped in (see the module doc).
    `checkpoint_layers`: keep only each decoder layer's inputs for backward and recompute the rest."""

    def __init__(self, model, ops, checkpoint_layers: bool = False):
        self.model, self.ops, self.checkpoint_layers = model, ops, bool(checkpoint_layers)

    @contextlib.contextmanager
    def _swapped(self):
        model = self.model
        saved = model.ops
        wrapped = []
        try:
            # The model passes its one `ops` down to every submodule in forward: swapping it is enough.
            # (Set directly, not through set_ops: DifferentiableOps wraps an Ops rather than being one.)
            model.ops = self.ops
            if self.checkpoint_layers and torch.is_grad_enabled():
                for layer in model.layers:  # an instance attribute shadows the class's forward
                    layer.forward = _checkpointed(type(layer).forward.__get__(layer))
                    wrapped.append(layer)
            if isinstance(self.ops, DifferentiableOps):
                with _EmbeddingRoute(model.embed_tokens):
                    yield
            else:
                yield
        finally:
            for layer in wrapped:
                del layer.forward
            model.ops = saved

    def hidden(self, input_ids, positions, attn):
        """-> the final normed hidden states [T, H], with the swapped ops active."""
        with self._swapped():
            return self.model(input_ids, positions, attn)

    def run(self, input_ids, positions, attn):
        """-> (hidden [T, H], compute_logits) with the swapped ops active for both."""
        with self._swapped():
            hidden = self.model(input_ids, positions, attn)
            logits = self.model.compute_logits(hidden)
        return hidden, logits
