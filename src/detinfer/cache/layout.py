"""One engine step's packed layout, as host lists (pure Python, no torch: the scheduler builds it).

A step packs the new tokens of S sequences into one [T] vector. Sequence s brings query_lens[s] tokens at
positions starts[s] .. starts[s] + query_lens[s] - 1 and attends to kv_lens[s] = starts[s] + query_lens[s]
keys; its key i lives in KV slot table[i // block_size] * block_size + i % block_size. Logits are computed
for the trailing num_logits[s] positions of each chunk, in batch order: `logit_rows` are those rows of
the packed tokens, and `logits_offsets[s]` is where sequence s's rows start in the step's logits. This
module is the only place that derives any of it; `paged_kv.step_tensors` turns it into the tensors that
attention and the KV write take, and the engine reads the logits rows from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def slot_mapping(block_table: Sequence[int], start: int, count: int, block_size: int) -> list[int]:
    """KV slots of positions start .. start + count - 1 of a sequence with `block_table`."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, start + count)]


def padded_tables(tables: Sequence[Sequence[int]], width: int) -> list[list[int]]:
    """Block tables as rows of `width` entries, zero-filled (entries past kv_len are never read)."""
    return [list(t) + [0] * (width - len(t)) for t in tables]


@dataclass(frozen=True)
class StepLayout:
    token_ids: list[int]  # [T] (zeros when the caller gave none: metadata-only layouts)
    positions: list[int]  # [T]
    slots: list[int]  # [T] KV slot each token's K/V is written to
    query_lens: list[int]  # [S]
    kv_lens: list[int]  # [S] keys attended to, this step's included
    block_tables: list[tuple[int, ...]]  # [S] physical blocks, covering at least kv_lens
    logit_rows: list[int]  # rows of the packed tokens whose logits are computed, in order
    logits_offsets: list[int]  # [S] first logits row of each sequence

    @property
    def num_tokens(self) -> int:
        return len(self.positions)

    @property
    def all_single_token(self) -> bool:
        return all(n == 1 for n in self.query_lens)

    @property
    def cu_q_lens(self) -> list[int]:
        cu = [0]
        for n in self.query_lens:
            cu.append(cu[-1] + n)
        return cu

    @property
    def max_q_len(self) -> int:
        return max(self.query_lens, default=1)

    @property
    def max_kv_len(self) -> int:
        return max(self.kv_lens, default=1)

    @classmethod
    def build(cls, block_tables: Sequence[Sequence[int]], starts: Sequence[int], query_lens: Sequence[int],
              block_size: int, *, token_ids: Sequence[Sequence[int]] | None = None,
              num_logits: Sequence[int] | None = None, names: Sequence | None = None) -> StepLayout:
        """Sequence s: `block_tables[s]`, `starts[s]` tokens already cached, `query_lens[s]` new ones
        (`token_ids[s]`), logits for its last `num_logits[s]` positions (default none). `names` label
        sequences in errors (default: their index)."""
        n_seq = len(block_tables)
        if not (len(starts) == len(query_lens) == n_seq):
            raise ValueError("a step layout needs block_tables, starts and query_lens with one entry per "
                             f"sequence, got {n_seq}, {len(starts)}, {len(query_lens)}")
        ids, pos, slots, kv, tables, rows, offsets = [], [], [], [], [], [], []
        offset = 0
        for s in range(n_seq):
            table, start, n = block_tables[s], starts[s], query_lens[s]
            end = start + n
            if start < 0 or n < 0 or blocks_needed(end, block_size) > len(table):
                name = s if names is None else names[s]
                raise ValueError(f"sequence {name}: positions {start}..{end - 1} need "
                                 f"{blocks_needed(end, block_size)} blocks of {block_size}, the sequence has "
                                 f"{len(table)}")
            ids.extend(token_ids[s] if token_ids is not None else [0] * n)
            pos.extend(range(start, end))
            slots.extend(slot_mapping(table, start, n, block_size))
            kv.append(end)
            tables.append(tuple(table))
            k = 0 if num_logits is None else num_logits[s]
            offsets.append(len(rows))
            rows.extend(range(offset + n - k, offset + n))
            offset += n
        return cls(ids, pos, slots, list(query_lens), kv, tables, rows, offsets)
