"""The device side of one engine step: inputs in, sampled ids and logprobs out, without waiting for the device.

`launch_step` enqueues a step's work and returns at once (on CUDA): the host lists the step needs go up
through `paged_kv.upload` (pinned memory, non-blocking copies: a pageable copy may wait for the device,
which would undo the overlap), the forward pass and the sampler run on the device, and every result the host needs
(sampled ids; each logprob row's chosen logprob, rank and top-k) is packed into one int64 tensor that comes
back with ONE non-blocking device->host copy, completed by an event. `LaunchedStep.read()` waits for that
event and unpacks.

Pending inputs: a decode whose input token was sampled by the previous step (still unread on the host, a
`PENDING_TOKEN` in the layout) takes it on the device from that step's sampled-id tensor (`SampledIds`).
Logprob targets of sampled rows come from this step's sampled ids the same way. Both are a gather and a
select on the device, so the host never waits for a token id.

Floats travel through the int64 tensor as their fp32 bit patterns (sign-extended int32), so the host gets
exactly the bits the kernels produced. Everything row-wise here (sampling, log_softmax, gather, ranks, the
stable sort of top-k) is the same whether a row is computed in this packed batch or alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from detinfer.cache.paged_kv import upload
from detinfer.engine.outputs import TokenLogprob
from detinfer.engine.sampler import compute_logprobs, sample
from detinfer.engine.scheduler import ScheduledBatch
from detinfer.engine.sequence import PENDING_TOKEN, Sequence


def fill_pending(values: list[int], sources: list[int], known: torch.Tensor | None,
                 device: torch.device) -> torch.Tensor:
    """[n] int64 on `device`: values[i] where it is a token id, else known[sources[i]] (a select on the
    device); `known` may be None when no value is pending."""
    if known is None or PENDING_TOKEN not in values:
        return upload(values, torch.int64, device)
    both = upload([values, sources], torch.int64, device)
    return torch.where(both[0] >= 0, both[0], known[both[1]])


@dataclass(frozen=True)
class SampledIds:
    """Sampled ids of launched steps not read back yet: `ids[index[seq_id]]` is seq_id's token (device)."""

    ids: torch.Tensor
    index: dict[int, int]

    @staticmethod
    def join(parts: list[SampledIds]) -> SampledIds | None:
        parts = [p for p in parts if p.index]
        if len(parts) <= 1:
            return parts[0] if parts else None
        index, offset = {}, 0
        for p in parts:
            index.update({sid: offset + i for sid, i in p.index.items()})
            offset += p.ids.shape[0]
        return SampledIds(torch.cat([p.ids for p in parts]), index)


@dataclass
class LogprobDest:
    seq: Sequence
    k: int  # top-k entries to keep
    is_prompt: bool
    target: int  # the scored token id (PENDING_TOKEN: the token this step samples for `seq`)


@dataclass
class LaunchedStep:
    """One launched batch: its sampled ids on the device, and the packed results on their way to the host
    (`host`, complete once `event` has passed; no event on CPU)."""

    batch: ScheduledBatch
    sample_items: list[int]  # indices of the batch entries that were sampled
    sampled: SampledIds
    dests: list[LogprobDest]
    top_k: int
    host: torch.Tensor
    event: torch.cuda.Event | None

    def read(self) -> tuple[list[int | None], list[tuple[LogprobDest, TokenLogprob]]]:
        """Wait for the step's results: (token per batch entry, None where not sampled; logprob entries)."""
        if self.event is not None:
            self.event.synchronize()
        host, n = self.host, len(self.sample_items)
        drawn = host[:n].tolist()
        tokens: list[int | None] = [None] * len(self.batch)
        for i, t in zip(self.sample_items, drawn):
            tokens[i] = t
        entries = []
        if self.dests:
            k = self.top_k
            block = host[n:].view(len(self.dests), 2 + 2 * k)
            chosen = block[:, 0].to(torch.int32).view(torch.float32).tolist()
            ranks = block[:, 1].tolist()
            top_ids = block[:, 2:2 + k].tolist()
            top_vals = block[:, 2 + k:].to(torch.int32).view(torch.float32).tolist()
            by_seq = {self.batch.scheduled[i].seq.seq_id: t for i, t in zip(self.sample_items, drawn)}
            for j, d in enumerate(self.dests):
                target = by_seq[d.seq.seq_id] if d.target == PENDING_TOKEN else d.target
                entries.append((d, TokenLogprob(target, chosen[j], ranks[j],
                                                dict(zip(top_ids[j][:d.k], top_vals[j][:d.k])))))
        return tokens, entries


def _plan_logprobs(batch: ScheduledBatch, sample_items: list[int]) -> tuple[list[int], list[LogprobDest]]:
    """Logits rows to score and where each result goes: prompt logprobs not delivered yet (sample 0 of a
    request that asked), then the sampled token of each sequence that asked for logprobs."""
    rows, dests = [], []
    offsets = batch.layout.logits_offsets
    for item, row in zip(batch.scheduled, offsets, strict=True):
        seq = item.seq
        if seq.wants_prompt_logprobs:
            # Positions below num_prompt_logits_done were delivered by earlier steps (launched ones included:
            # the scheduler advances it at launch), so a resumed prefill does not deliver them twice.
            expected = seq.num_prompt_logits_done
            for j, p in enumerate(item.logits_positions):
                if p == expected and p + 1 < seq.num_prompt_tokens:
                    rows.append(row + j)
                    dests.append(LogprobDest(seq, seq.params.prompt_logprobs, True, seq.token_ids[p + 1]))
                    expected += 1
    for i in sample_items:
        item = batch.scheduled[i]
        if item.seq.params.logprobs is not None:
            rows.append(offsets[i] + item.num_logits - 1)
            dests.append(LogprobDest(item.seq, item.seq.params.logprobs, False, PENDING_TOKEN))
    return rows, dests


def _input_ids(batch: ScheduledBatch, pending: SampledIds | None) -> torch.Tensor | None:
    """The step's input ids on the device when some are pending (None: the layout's ids are all known)."""
    layout = batch.layout
    if PENDING_TOKEN not in layout.token_ids:
        return None
    if pending is None:
        raise RuntimeError("a scheduled token is pending but no launched step holds its id")
    sources = [0] * layout.num_tokens
    cu = layout.cu_q_lens
    for i, item in enumerate(batch.scheduled):
        if item.token_ids[-1] == PENDING_TOKEN:  # only a chunk's last token can be pending
            sources[cu[i + 1] - 1] = pending.index[item.seq.seq_id]
    return fill_pending(layout.token_ids, sources, pending.ids, pending.ids.device)


def launch_step(runner, batch: ScheduledBatch, pending: SampledIds | None,
                eos_token_ids: frozenset[int] = frozenset(), logits_mask=None) -> LaunchedStep:
    """Enqueue one step (forward, sampling, logprobs, the copy back) and return without waiting for it.
    `runner`: the engine's `ModelRunner` or `TensorParallelRunner` (its `execute` and its `ops`' log_softmax).
    eos_token_ids: the model's EOS ids (min_tokens masks them).
    `logits_mask(logits, rows, seqs) -> logits`, when given, masks the sampled rows (structured output's
    grammars, `GrammarMasks.mask_logits`) before both sampling and logprobs, so a grammar request's logprobs
    are those of its masked distribution (as vLLM's); the sampler's own processors (logit_bias, bad words,
    min_tokens, `token_mask`, ...) work on a copy, and logprobs stay raw for them."""
    items = batch.scheduled
    sample_items = [i for i, item in enumerate(items) if item.sample]
    lp_rows, dests = _plan_logprobs(batch, sample_items)
    # Nothing but each sampled row's argmax needed: the runner returns those ids, not the logits (under
    # tensor parallelism it then gathers P x 16 bytes per row instead of the rows; the same tokens).
    argmax_only = not dests and logits_mask is None and all(items[i].seq.params.is_plain_greedy
                                                            for i in sample_items)
    logits = runner.execute(batch, input_ids=_input_ids(batch, pending), argmax_only=argmax_only)
    dev = logits.device
    offsets = batch.layout.logits_offsets
    drawn = torch.empty(0, dtype=torch.int64, device=dev)
    if sample_items and argmax_only:
        rows = [offsets[i] + items[i].num_logits - 1 for i in sample_items]
        # (a copy either way: the runner's ids may be a graph's buffer, which the next step overwrites)
        drawn = logits.clone() if rows == list(range(logits.shape[0])) else logits[upload(rows, torch.int64, dev)]
    elif sample_items:
        rows = [offsets[i] + items[i].num_logits - 1 for i in sample_items]
        seqs = [items[i].seq for i in sample_items]
        if logits_mask is not None:
            logits = logits_mask(logits, rows, seqs)
        picked = logits if rows == list(range(logits.shape[0])) else logits[upload(rows, torch.int64, dev)]
        history = any(s.params.needs_history for s in seqs)  # the engine resolved their histories first
        drawn = sample(picked, [s.params for s in seqs], [s.seed for s in seqs],
                       [items[i].output_position for i in sample_items], [s.sample_index for s in seqs],
                       [s.prompt_token_ids for s in seqs] if history else None,
                       [s.known_output_token_ids for s in seqs] if history else None, eos_token_ids)
    sampled = SampledIds(drawn, {items[i].seq.seq_id: j for j, i in enumerate(sample_items)})
    parts, top_k = [drawn], 0
    if dests:
        top_k = max(d.k for d in dests)
        sources = [sampled.index.get(d.seq.seq_id, 0) for d in dests]
        targets = fill_pending([d.target for d in dests], sources, drawn, dev)
        lp = compute_logprobs(logits[upload(lp_rows, torch.int64, dev)], targets, top_k, runner.ops.log_softmax,
                              validate=False)

        def bits(x: torch.Tensor) -> torch.Tensor:  # fp32 -> its bit pattern as int64
            return x.contiguous().view(torch.int32).to(torch.int64)

        parts.append(torch.cat([bits(lp.token_logprobs)[:, None], lp.token_ranks[:, None], lp.top_token_ids,
                                bits(lp.top_logprobs)], dim=1).reshape(-1))
    packed = torch.cat(parts) if len(parts) > 1 else drawn
    host, event = packed, None
    if dev.type == "cuda":
        host = torch.empty(packed.shape, dtype=torch.int64, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    return LaunchedStep(batch, sample_items, sampled, dests, top_k, host, event)
