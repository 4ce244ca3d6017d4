"""`TrainableModel`: the engine's own model and weights, trainable, scoring token sequences.

    from detinfer.engine import LLM
    from detinfer.train import TrainableModel
    llm = LLM("path/to/model", mode="deterministic")
    trainer = TrainableModel(llm)                          # same module, same weight tensors
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-5)
    lp = trainer.score(token_ids, cu_seqlens)              # [N] fp32 logprob of each next token
    lp = trainer.score(token_ids, cu_seqlens, positions=completion_positions)   # only those entries
    loss = -(lp * advantages).sum(); loss.backward(); opt.step()
    trainer.push_weights()      # masters -> engine weights; drops the engine's now-stale prefix cache

In deterministic mode the logprobs are `torch.equal` to the ones the engine reported while sampling the
same tokens (output `logprobs` and `prompt_logprobs`), whatever the engine's batches and the training
packing: the forward runs the engine's ops and attention (see adapter.py), and both sides are
batch-invariant. Gradients come from fixed-order backward kernels: two identical steps give identical bits.
Fast mode runs stock PyTorch autograd (F.linear, and attention over the whole packed batch in one call:
torch's varlen flash attention where available, else SDPA over a padded batch; `fast_attention=`, see
fast_attention.py) on the same module, to measure cost and mismatch. It makes no determinism claim.

Parameters and gradients. fp32 models: `parameters()` are the engine's tensors, with fp32 grads. 16-bit
models (bf16 on GPU): by default (`master_weights=True`) `parameters()` are fp32 master copies whose
`.grad` receives the fp32 weight gradients (the engine's bf16 tensors carry `grad_dtype=float32`, so no
gradient is rounded to bf16; on torch versions without `Tensor.grad_dtype` they are rounded to bf16
before reaching the fp32 masters); any torch optimizer steps the masters, and `push_weights()` rounds them
into the engine's bf16 tensors (round-to-nearest-even, deterministic). With master_weights=False the
engine's 16-bit tensors are the parameters and their grads are 16-bit. One TrainableModel at a time
owns a model's gradients: creating another calls `close()` on the previous one.

Memory (docs/training.md, "Memory"): logits are computed only for the scored rows, in chunks of
`logprob_chunk_rows` (a multiple of 64; the bits do not depend on it) recomputed in backward
(logprobs.py); `logprob_chunk_rows=None` runs the output layer over all scored rows at once instead (no
recompute; the [M, V] logits are kept for backward, as a plain PyTorch loop does; fast mode: stock
autograd; deterministic mode: the same bits as the chunks); `activation_checkpointing=True`
keeps only each decoder layer's inputs and recomputes the rest in backward (same bits).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from detinfer import admission
from detinfer.constants import MODES
from detinfer.train.adapter import (
    DifferentiableOps,
    PackedPagedAttention,
    TrainingForward,
    attention_functions,
)
from detinfer.train.fast_attention import build_fast_attention, resolve_fast_attention
from detinfer.train.logprobs import LOGPROB_CHUNK_ROWS, LogprobHead, chunked_logprobs

__all__ = ["MODES", "TrainableModel", "pack_padded"]


def _resolve(source):
    """LLM | LLMEngine | Transformer -> (model, runner or None, engine or None)."""
    engine = getattr(source, "engine", source)
    if hasattr(engine, "core"):  # EngineCoreClient: the weights live in another process
        raise TypeError("TrainableModel shares the engine's weight tensors, but this LLM runs its engine in another "
                        "process (engine_process=True); create it with engine_process=False (the default)")
    runner = getattr(engine, "runner", None)
    config = getattr(engine, "config", None)
    if runner is not None and getattr(config, "tensor_parallel_size", 1) > 1:
        # A TP=N sampler's bits are a TP=1 engine's with tp_invariant_reduction: train on such an engine.
        raise ValueError("TrainableModel needs an engine with tensor_parallel_size=1 (it shares the engine's "
                         "whole weight tensors); to score a tensor-parallel sampler's tokens bit for bit, run both "
                         "with tp_invariant_reduction=True and give the trainer a TP=1 engine")
    model = runner.model if runner is not None else source
    if not (hasattr(model, "layers") and hasattr(model, "compute_logits") and hasattr(model, "embed_tokens")):
        raise TypeError("TrainableModel takes a detinfer LLM, LLMEngine or models.Transformer, got "
                        f"{type(source).__name__}")
    return model, runner, (engine if runner is not None else None)


def _cu_list(cu_seqlens, n: int) -> list[int]:
    cu = [int(c) for c in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != n or any(b < a for a, b in zip(cu[:-1], cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0, be non-decreasing and end at the token count {n}, "
                         f"got {cu[:8]}{'...' if len(cu) > 8 else ''}")
    return cu


def pack_padded(token_ids: torch.Tensor, lengths: Sequence[int] | torch.Tensor | None = None):
    """Right-padded [B, T] (+ lengths [B], default all T) -> (packed ids [N], cu_seqlens list)."""
    b, t = token_ids.shape
    lens = [t] * b if lengths is None else [int(x) for x in (lengths.tolist() if isinstance(lengths, torch.Tensor)
                                                             else lengths)]
    if len(lens) != b or any(not 0 <= n <= t for n in lens):
        raise ValueError(f"lengths must hold {b} values in [0, {t}], got {lens}")
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.cat([token_ids[i, :n] for i, n in enumerate(lens)]), cu


class TrainableModel:
    """See the module doc. `source`: a detinfer LLM, LLMEngine, or a models.Transformer.
    `fast_attention` (fast mode only): "auto" (the strongest available), "varlen", "flash-attn",
    "padded-sdpa" or "per-sequence" (fast_attention.py); `self.fast_attention` names the one resolved."""

    def __init__(self, source, mode: str = "deterministic", *, master_weights: bool | None = None,
                 block_size: int = 16, activation_checkpointing: bool = False,
                 logprob_chunk_rows: int | None = LOGPROB_CHUNK_ROWS, fast_attention: str = "auto"):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "deterministic" and fast_attention != "auto":
            raise ValueError(f"fast_attention={fast_attention!r} picks fast mode's attention; deterministic mode "
                             "always runs the engine's paged attention (leave fast_attention='auto')")
        if not isinstance(activation_checkpointing, bool):
            raise TypeError(f"activation_checkpointing must be a bool, got {activation_checkpointing!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.model, self.runner, self._engine = _resolve(source)
        self.mode, self.block_size = mode, block_size
        cfg = self.model.config
        if cfg.quantization is not None:  # fp8 weights have no gradient path (docs/fp8.md)
            raise ValueError(f"training runs on 16/32-bit weights only; this model is quantized "
                             f"({cfg.quantization}): train on the unquantized checkpoint")
        self.scale = cfg.softmax_scale
        if mode == "deterministic":
            base = self.model.ops.replace(mode="deterministic")  # the same device/dtype rule as the engine
            runner = self.runner if (self.runner is not None and self.runner.config.mode == "deterministic") \
                else None
            self.attend, self.write = attention_functions(self.model, runner)
            self.ops = DifferentiableOps(base)
            self.fast_attention = None
        else:
            self.ops = self.model.ops.replace(mode="fast")
            weight = self.model.embed_tokens
            # resolved once: the name says which kernel the fast arm's numbers come from (bench, rl report)
            self.fast_attention = resolve_fast_attention(fast_attention, weight.device, weight.dtype,
                                                         cfg.head_dim)
        self.head = LogprobHead(self.model.ops.replace(mode=mode), logprob_chunk_rows)
        self.activation_checkpointing = activation_checkpointing
        self.forward_runner = TrainingForward(self.model, self.ops, checkpoint_layers=activation_checkpointing)
        self.scorer = ScoringModule(self.model, self.forward_runner, self.head)
        # One TrainableModel at a time routes the model's gradients: a new one releases the previous one's
        # master-weight hooks (two sets would race for each .grad).
        previous = getattr(self.model, "_detinfer_trainer", None)
        if previous is not None:
            previous.close()
        self.model._detinfer_trainer = self
        engine_params = list(self.model.parameters())
        dtype = engine_params[0].dtype
        self.master_weights = dtype != torch.float32 if master_weights is None else bool(master_weights)
        self._pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        self._hooks = []
        for p in engine_params:
            p.requires_grad_(True)
        # The fp32 masters are made at first use (parameters(), score(), push_weights()), not here: a
        # data-parallel wrapper (FSDPTrainer) takes them over before that and makes them one layer at a time
        # as it shards, so the whole model's fp32 copy never exists on one device (6 B per parameter at
        # once would not fit a large model's GPU: docs/training.md, "Memory per rank").
        self._masters_pending = list(engine_params) if self.master_weights else []

    def _masters(self) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        """The (16-bit engine tensor, fp32 master) pairs, made on first call."""
        pending, self._masters_pending = self._masters_pending, []
        for p in pending:
            if hasattr(p, "grad_dtype"):  # torch versions with per-tensor gradient dtypes
                p.grad_dtype = torch.float32
            master = torch.nn.Parameter(p.detach().to(torch.float32).clone())
            self._hooks.append(p.register_post_accumulate_grad_hook(self._move_grad_hook(master)))
            self._pairs.append((p, master))
        return self._pairs

    def take_pending_masters(self) -> list[torch.nn.Parameter]:
        """For a sharding wrapper: the 16-bit parameters whose fp32 masters are not made yet (all of them
        before first use, else none); the wrapper makes them itself and this object no longer will."""
        pending, self._masters_pending = self._masters_pending, []
        return pending

    def close(self) -> None:
        """Stop routing gradients to this object's master weights (a new TrainableModel does this)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if getattr(self.model, "_detinfer_trainer", None) is self:
            del self.model._detinfer_trainer

    @staticmethod
    def _move_grad_hook(master: torch.nn.Parameter):
        def hook(p: torch.Tensor) -> None:
            if p.grad is None:
                return
            g = p.grad.to(torch.float32)
            if master.grad is None:
                master.grad = g
            else:
                master.grad.add_(g)  # one add per backward, in backward order: deterministic
            p.grad = None
        return hook

    # -- parameters ----------------------------------------------------------------------------------
    def parameters(self) -> Iterator[torch.nn.Parameter]:
        if self.master_weights:
            return iter([m for _, m in self._masters()])
        return self.model.parameters()

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        names = [n for n, _ in self.model.named_parameters()]
        return iter(zip(names, self.parameters()))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in list(self.parameters()) + list(self.model.parameters()):
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def push_weights(self) -> None:
        """Call after every optimizer.step(): copies the fp32 master weights (if any) into the engine's
        tensors, and, when built from an engine, drops the engine's prefix cache, whose KV blocks were
        computed with the old weights (a later request reusing them would get stale logprobs)."""
        if self.runner is not None:
            engine_unfinished = self._engine_unfinished()
            if engine_unfinished:
                raise RuntimeError(f"push_weights: the engine has {engine_unfinished} unfinished requests "
                                   "whose KV cache holds the old weights' keys and values; finish or abort "
                                   "them before updating the weights")
        for p, master in self._masters():
            p.copy_(master)
        if self.runner is not None:
            self._engine.reset_prefix_cache()

    def _engine_unfinished(self) -> int:
        return self._engine.get_num_unfinished_requests() if self._engine is not None else 0

    # -- scoring -------------------------------------------------------------------------------------
    def score(self, token_ids: torch.Tensor, cu_seqlens=None, targets: torch.Tensor | None = None, *,
              lengths=None, positions=None, mask: torch.Tensor | None = None,
              temperature: float = 1.0) -> torch.Tensor:
        """Logprobs of the next tokens, with autograd.

        Packed: token_ids [N] with cu_seqlens [S+1] (list or tensor; default one sequence) -> [N] fp32,
        entry i = log p(targets[i] | the tokens of its sequence up to i). targets default to each
        sequence's next token; a sequence's last position has no next token and gets 0.0 (no gradient).
        positions: strictly increasing indices into [N]; only those entries are computed (logits for those
        rows only) and returned, [len(positions)], equal bit for bit to `score(...)[positions]`.
        Padded: token_ids [B, T] (right padding) with lengths [B] -> [B, T], padding positions 0.0;
        mask [B, T] (bool): score only those positions, the others 0.0.
        temperature: score under softmax(logits / temperature) (the distribution a sampler at that
        temperature draws from, before any top-k/top-p truncation); 1.0 is bit for bit the untempered path.
        """
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0 \
                or temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
        if not isinstance(token_ids, torch.Tensor) or token_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError("token_ids must be an int32/int64 tensor")
        if token_ids.dim() == 2:
            if cu_seqlens is not None or positions is not None:
                raise ValueError("a padded [B, T] batch takes lengths= and mask=, not cu_seqlens or positions")
            self._masters()
            return self._score_padded(token_ids, lengths, targets, mask, float(temperature))
        if token_ids.dim() != 1:
            raise ValueError(f"token_ids must be [N] (packed) or [B, T] (padded), got {tuple(token_ids.shape)}")
        if lengths is not None or mask is not None:
            raise ValueError("lengths= and mask= are for a padded [B, T] batch; packed input takes cu_seqlens "
                             "and positions")
        n = token_ids.shape[0]
        cu = _cu_list([0, n] if cu_seqlens is None else cu_seqlens, n)
        self._masters()  # their gradient hooks must be in place before this forward's backward
        return self._score_packed(token_ids, cu, targets, _positions(positions, n), float(temperature))

    def _score_padded(self, token_ids, lengths, targets, mask, temperature: float):
        b, t = token_ids.shape
        ids, cu = pack_padded(token_ids, lengths)
        tg = None if targets is None else pack_padded(targets, lengths)[0]
        positions = None
        if mask is not None:
            if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != (b, t):
                raise ValueError(f"mask must be a bool tensor of the batch's shape {(b, t)}")
            positions = torch.nonzero(pack_padded(mask.cpu(), lengths)[0]).reshape(-1)
        lp = self._score_packed(ids, cu, tg, positions, temperature)
        if positions is not None:  # back onto the packed layout, zeros where not scored
            lp = lp.new_zeros(ids.shape[0]).index_put((positions.to(lp.device),), lp)
        out = lp.new_zeros((b, t))
        for i in range(b):
            out[i, : cu[i + 1] - cu[i]] = lp[cu[i]:cu[i + 1]]
        return out

    @torch.no_grad()
    def distributions(self, token_ids: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
        """[N, V] fp32 log-probabilities of the next token at every position of packed token_ids (no
        autograd): the full distributions behind `score`, e.g. to measure KL between two modes."""
        n = token_ids.shape[0]
        cu = _cu_list([0, n] if cu_seqlens is None else cu_seqlens, n)
        ids = token_ids.to(device=self.model.embed_tokens.device, dtype=torch.int64)
        _, logits = self.forward_runner.run(ids, self._positions_of(cu, ids.device), self._attention(cu, ids.device))
        return self.ops.log_softmax(logits, dim=-1)  # fp32 logits: the mode's log_softmax

    @staticmethod
    def _positions_of(cu: list[int], dev: torch.device) -> torch.Tensor:
        """Each packed token's position within its sequence."""
        if cu[-1] == 0:
            return torch.zeros(0, dtype=torch.int64, device=dev)
        return torch.cat([torch.arange(b - a, dtype=torch.int64) for a, b in zip(cu[:-1], cu[1:])]).to(dev)

    def _attention(self, cu: list[int], dev: torch.device):
        if self.mode == "deterministic":
            return PackedPagedAttention(self.attend, self.write, cu, self.scale, self.block_size, dev)
        return build_fast_attention(self.fast_attention, cu, self.scale, dev)

    def _score_packed(self, token_ids: torch.Tensor, cu: list[int], targets, positions,
                      temperature: float = 1.0) -> torch.Tensor:
        dev = self.model.embed_tokens.device
        vocab = self.model.config.vocab_size
        ids = token_ids.to(device=dev, dtype=torch.int64)
        n = ids.shape[0]
        admission.check_token_ids("token_ids", token_ids.tolist(), vocab)  # the server's and engine's check
        has_target = torch.ones(n, dtype=torch.bool, device=dev)
        if targets is None:
            tg = torch.zeros_like(ids)
            if n > 1:
                tg[:-1] = ids[1:]
            ends = [b - 1 for a, b in zip(cu[:-1], cu[1:]) if b > a]
            has_target[ends] = False
            tg[ends] = 0
        else:
            tg = targets.to(device=dev, dtype=torch.int64).reshape(-1)
            if tg.shape[0] != n:
                raise ValueError(f"targets must hold {n} token ids in [0, {vocab}), got {tg.shape[0]}")
            admission.check_token_ids("targets", tg.tolist(), vocab)
        rows = None if positions is None else positions.to(dev)
        if rows is not None:
            tg, has_target = tg[rows], has_target[rows]
        lp = self.scorer(ids, self._positions_of(cu, dev), self._attention(cu, dev), tg, rows, temperature)
        return torch.where(has_target, lp, torch.zeros_like(lp))


class ScoringModule(torch.nn.Module):
    """The whole scoring forward (decoder, then the output layer on the scored rows) as one module call.
    The output weight is read inside this call, so a wrapper that gathers parameters around a module's
    forward (FSDP's `fully_shard`, fsdp.py) gathers it too; unwrapped, the call is exactly the two steps."""

    def __init__(self, model: torch.nn.Module, forward_runner: TrainingForward, head: LogprobHead):
        super().__init__()
        self.model = model
        self.forward_runner, self.head = forward_runner, head

    def forward(self, ids, positions, attn, targets, rows, temperature: float):
        hidden = self.forward_runner.hidden(ids, positions, attn)
        return chunked_logprobs(hidden, self.model.output_weight, targets, rows, self.head, temperature)


def _positions(positions, n: int) -> torch.Tensor | None:
    """Validate score()'s positions: strictly increasing int indices into [0, n) -> int64 CPU tensor."""
    if positions is None:
        return None
    if isinstance(positions, torch.Tensor):
        p = positions
    else:
        values = list(positions)
        if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
            raise ValueError(f"positions must be int indices, got {values[:8]}")
        p = torch.tensor(values, dtype=torch.int64)
    if p.dtype not in (torch.int32, torch.int64) or p.dim() != 1:
        raise ValueError(f"positions must be a 1-D int tensor or list of indices, got "
                         f"{p.dtype} of shape {tuple(p.shape)}")
    p = p.to(device="cpu", dtype=torch.int64)
    if p.numel() and (int(p.min()) < 0 or int(p.max()) >= n or bool((p[1:] <= p[:-1]).any())):
        raise ValueError(f"positions must be strictly increasing indices in [0, {n})")
    return p
