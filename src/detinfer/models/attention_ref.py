"""A plain-torch reference for the model's `attn` callable: causal GQA attention with each sequence's K/V
kept contiguously. It lets the model run (and be checked against HF) without the paged cache and kernels.

Usage for one packed step over several sequences:

    attn = ReferenceAttention(config.num_hidden_layers, config.softmax_scale)
    positions = attn.begin(["a", "b"], [5, 1])   # seq "a" gets 5 new tokens, "b" one (decode)
    hidden = model(input_ids, positions, attn)     # input_ids: a's 5 tokens, then b's 1

Each sequence is attended separately (its queries only see its own keys), in fp32.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch


class ReferenceAttention:
    def __init__(self, num_layers: int, scale: float):
        if not (isinstance(num_layers, int) and num_layers > 0):
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        if not scale > 0:
            raise ValueError(f"scale must be positive, got {scale!r}")
        self.num_layers, self.scale = num_layers, float(scale)
        self._kv: dict[Hashable, list[tuple[torch.Tensor, torch.Tensor] | None]] = {}
        self._len: dict[Hashable, int] = {}  # tokens cached per sequence, after the current step
        self._step: list[tuple[Hashable, int, int]] = []  # (seq_id, tokens cached before, new tokens)

    def begin(self, seq_ids: Sequence[Hashable], query_lens: Sequence[int],
              device: torch.device | str = "cpu") -> torch.Tensor:
        """Declare the next forward's packing; returns the positions [T] int64 of its tokens."""
        if len(seq_ids) != len(query_lens) or len(set(seq_ids)) != len(seq_ids):
            raise ValueError("seq_ids must be distinct and match query_lens one to one, got "
                             f"{list(seq_ids)} and {list(query_lens)}")
        if any(not (isinstance(n, int) and n > 0) for n in query_lens):
            raise ValueError(f"query_lens must be positive ints, got {list(query_lens)}")
        self._step, positions = [], []
        for sid, n in zip(seq_ids, query_lens, strict=True):
            start = self._len.get(sid, 0)
            self._kv.setdefault(sid, [None] * self.num_layers)
            self._len[sid] = start + n
            self._step.append((sid, start, n))
            positions.append(torch.arange(start, start + n, dtype=torch.int64))
        return torch.cat(positions).to(device)

    def free(self, seq_id: Hashable) -> None:
        self._kv.pop(seq_id, None)
        self._len.pop(seq_id, None)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (new tokens of this step, packed) -> [T, Hq, D] in q's dtype."""
        total = sum(n for _, _, n in self._step)
        if q.shape[0] != total:
            raise ValueError(f"got {q.shape[0]} tokens but begin() declared {total}")
        group = q.shape[1] // k.shape[1]  # query heads per kv head (GQA)
        outs, offset = [], 0
        for sid, start, n in self._step:
            cache = self._kv[sid]
            new_k, new_v = k[offset:offset + n], v[offset:offset + n]
            if cache[layer_idx] is not None:
                new_k = torch.cat([cache[layer_idx][0], new_k])
                new_v = torch.cat([cache[layer_idx][1], new_v])
            cache[layer_idx] = (new_k, new_v)  # [start + n, Hkv, D]
            qs = q[offset:offset + n].float().transpose(0, 1)  # [Hq, n, D]
            ks = new_k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
            vs = new_v.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
            scores = (qs @ ks.transpose(1, 2)) * self.scale  # [Hq, n, L]
            # query i sits at position start + i and may see keys 0 .. start + i
            q_pos = torch.arange(start, start + n, device=q.device)[:, None]
            k_pos = torch.arange(start + n, device=q.device)[None, :]
            scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
            outs.append((scores.softmax(-1) @ vs).transpose(0, 1))  # [n, Hq, D]
            offset += n
        return torch.cat(outs).to(q.dtype)
