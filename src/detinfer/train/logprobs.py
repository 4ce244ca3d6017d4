"""Logprobs of the scored tokens only, in row chunks, without keeping [N, V] for backward.

Scoring a token needs its row of logits (hidden @ W_out^T, [V] wide) and that row's log_softmax. Kept for
every packed position, the fp32 logits and log-distribution of an 8 x 1024-token batch at a 151936-token
vocabulary take 10 GB, and were held from the forward to the backward. `ChunkedLogprobFn` instead:
  * computes logits only for the rows being scored (`rows`, e.g. the completion tokens of an RL batch);
  * walks those rows in chunks of a constant `chunk_rows` (never derived from the batch), keeping only the
    gathered logprob of each row;
  * saves the hidden states, the output weight and the target ids, and in backward recomputes each
    chunk's logits and log-distribution, turns them into d logits, d hidden of the chunk's rows and its
    share of d W_out, and frees them before the next chunk.

Why the bits are those of the unchunked path (logits of all rows at once, `LinearFn` + `LogprobFn`):
every forward op is row-wise (the engine's linear and log_softmax are batch-invariant: a row's bits do
not depend on the other rows), the log_softmax-gather backward is elementwise, and d hidden is a row-wise
matmul. The one reduction over rows, d W_out = dY^T @ H, continues one fp32 accumulator across chunks
(`weight_grad(..., out=)`), which adds the same token blocks in the same order as one call when
`chunk_rows` is a multiple of TOKEN_CHUNK_MULTIPLE. tests/train/test_chunked_logprobs.py checks both.

A sampling temperature T (score under softmax(logits / T)) divides each chunk's fp32 logits by T before
the log_softmax, in the forward and the backward's recompute, and the backward divides d logits by T as
autograd does for the unchunked `logits / T`: the same elementwise ops, so the same bits. At T = 1 no
division runs at all.

Fast mode uses the same chunking with stock ops (F.linear, torch.log_softmax, torch matmuls): the memory
saving, with no bit promise beyond what stock PyTorch gives. Its price there (docs/performance.md): the
backward recomputes the output layer's forward, and d W_out is a read-modify-write of the fp32 [V, H]
accumulator per chunk instead of one GEMM over all rows. `chunk_rows=None` skips the chunking and keeps
the scored rows' [M, V] logits and log-distribution from the forward to the backward, as a plain PyTorch
training loop does: in fast mode the stock autograd output layer (bench_train.py's fast arm), in
deterministic mode the unchunked path above (`LinearFn` + `LogprobFn`, the bits chunking reproduces). It
trades that memory for the recompute.
"""

from __future__ import annotations

import torch

from detinfer.kernels.linear_backward import TOKEN_CHUNK_MULTIPLE
from detinfer.kernels.log_softmax_backward import log_softmax_gather_backward_ref

__all__ = ["LOGPROB_CHUNK_ROWS", "ChunkedLogprobFn", "LogprobHead", "check_chunk_rows", "chunked_logprobs"]

# Rows of logits alive at once: 512 x 151936 fp32 is 0.3 GB per [rows, V] buffer (logits, log-distribution,
# d logits). A constant, a multiple of TOKEN_CHUNK_MULTIPLE: the chunking never changes a bit.
LOGPROB_CHUNK_ROWS = 512


def check_chunk_rows(chunk_rows) -> int | None:
    if chunk_rows is None:  # the unchunked output layer (LogprobHead)
        return None
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1 \
            or chunk_rows % TOKEN_CHUNK_MULTIPLE:
        raise ValueError(f"logprob chunk rows must be a positive multiple of {TOKEN_CHUNK_MULTIPLE} (the token "
                         f"block of the output weight's gradient), got {chunk_rows!r}")
    return chunk_rows


class LogprobHead:
    """The output layer's ops: `base` (an Ops) decides them for its mode. Deterministic: the engine's linear
    and log_softmax forward, the fixed-order backward kernels; fast: stock torch ops. `chunk_rows=None`: no
    chunking and no recompute, the output layer runs over all scored rows at once and holds their [M, V]
    logits and log-distribution from the forward to the backward (what a plain PyTorch training loop does;
    deterministic mode gives the chunked path's bits either way)."""

    def __init__(self, base, chunk_rows: int | None = LOGPROB_CHUNK_ROWS):
        self.base, self.chunk_rows = base, check_chunk_rows(chunk_rows)

    def log_distribution(self, hidden: torch.Tensor, weight: torch.Tensor,
                         temperature: float = 1.0) -> tuple[torch.Tensor, torch.dtype]:
        """-> ([rows, V] fp32 log_softmax of the logits / temperature, the dtype the output linear
        computed in)."""
        logits = self.base.linear(hidden, weight)  # = base.logits before its .float()
        return self.base.log_softmax(_tempered(logits.float(), temperature), dim=-1), logits.dtype

    def backward(self, grad: torch.Tensor, logprobs: torch.Tensor, targets: torch.Tensor, logits_dtype,
                 hidden: torch.Tensor, weight: torch.Tensor, dw: torch.Tensor | None, temperature: float = 1.0):
        """d hidden of these rows; d W_out of these rows added into `dw` (None: a fresh one). -> (dh, dw)"""
        # LogprobFn's backward, the backward of `/ temperature` (autograd's: the same division of the
        # gradient), then the backward of `.float()` (a cast back to the linear's dtype)
        dz = _tempered(log_softmax_gather_backward_ref(grad, logprobs, targets).to(torch.float32), temperature)
        return self.base.linear_backward(dz.to(logits_dtype), hidden, weight, dw_out=dw)


def _tempered(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """x / temperature, the op an unchunked `logits / temperature` runs (forward) and its autograd runs on
    the gradient (backward); skipped at 1.0 so the untempered path stays bit for bit what it was."""
    return x if temperature == 1.0 else x / temperature


def _chunk(hidden: torch.Tensor, rows: torch.Tensor | None, c0: int, c1: int) -> torch.Tensor:
    return hidden[c0:c1] if rows is None else hidden.index_select(0, rows[c0:c1])


def _forward_chunks(hidden, weight, targets, rows, head: LogprobHead, temperature: float) -> torch.Tensor:
    out = []
    for c0 in range(0, targets.shape[0], head.chunk_rows):
        c1 = min(targets.shape[0], c0 + head.chunk_rows)
        logprobs, _ = head.log_distribution(_chunk(hidden, rows, c0, c1), weight, temperature)
        out.append(logprobs.gather(1, targets[c0:c1, None])[:, 0])
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float32, device=hidden.device)


class ChunkedLogprobFn(torch.autograd.Function):
    """(hidden [N, H], W_out [V, H], targets [M], rows [M] strictly increasing or None = all N rows,
    head, temperature) -> [M] fp32 logprob of targets[i] under log_softmax(logits of hidden[rows[i]] /
    temperature). See the module doc."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, rows, head: LogprobHead, temperature: float = 1.0):
        ctx.save_for_backward(hidden, weight, targets, rows)
        ctx.head, ctx.temperature = head, temperature
        return _forward_chunks(hidden, weight, targets, rows, head, temperature)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, targets, rows = ctx.saved_tensors
        head = ctx.head
        dh = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        dw = None
        for c0 in range(0, targets.shape[0], head.chunk_rows):
            c1 = min(targets.shape[0], c0 + head.chunk_rows)
            h = _chunk(hidden, rows, c0, c1)
            logprobs, logits_dtype = head.log_distribution(h, weight, ctx.temperature)
            dh_chunk, dw = head.backward(grad[c0:c1], logprobs, targets[c0:c1], logits_dtype, h, weight, dw,
                                         ctx.temperature)
            del logprobs
            if dh is not None:
                if rows is None:
                    dh[c0:c1] = dh_chunk
                else:
                    dh[rows[c0:c1]] = dh_chunk  # distinct rows (strictly increasing): no accumulation order
        if dw is None:  # no rows: a zero gradient, in the dtype the kernels would have given
            dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        return dh, (dw if ctx.needs_input_grad[1] else None), None, None, None, None


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                     rows: torch.Tensor | None, head: LogprobHead, temperature: float = 1.0) -> torch.Tensor:
    """`ChunkedLogprobFn` when autograd needs it, the same chunked forward otherwise. temperature: score
    under softmax(logits / temperature), the division applied to the scored rows' fp32 logits before
    log_softmax, in the forward and the backward's recompute alike."""
    if head.chunk_rows is None:
        h = hidden if rows is None else hidden.index_select(0, rows)
        if head.base.deterministic:  # the unchunked path (module doc): LinearFn, `/ T`, LogprobFn
            from detinfer.train.adapter import DifferentiableOps
            from detinfer.train.functions import LogprobFn

            logits = _tempered(DifferentiableOps(head.base).logits(h, weight), temperature)
            return LogprobFn.apply(logits, targets, head.base.log_softmax)
        logprobs, _ = head.log_distribution(h, weight, temperature)  # fast: plain autograd through stock ops
        return logprobs.gather(1, targets[:, None])[:, 0]
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return ChunkedLogprobFn.apply(hidden, weight, targets, rows, head, temperature)
    return _forward_chunks(hidden, weight, targets, rows, head, temperature)
