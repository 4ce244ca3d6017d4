"""The weights fingerprint, streamed in pieces: the value of the one-shot definition, any bit flip seen,
and no int64 temporary larger than one piece."""

import hashlib

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from detinfer.rl.metrics import weights_fingerprint


def _one_shot(named) -> str:
    """The definition, computed the memory-hungry way: every word of a tensor as int64 at once."""
    h = hashlib.sha256()
    for name, p in named:
        words = p.detach().contiguous().reshape(-1).view(torch.int16).to(torch.int64) & 0xFFFF
        w = torch.arange(words.numel(), dtype=torch.int64) % 65521 + 1
        sums = torch.stack([(words * w).sum(), (words * w.flip(0)).sum()]).tolist()
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{sums[0]}:{sums[1]};".encode())
    return h.hexdigest()[:12]


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 70000), min_size=1, max_size=3), dtype=st.sampled_from(_DTYPES),
       chunk=st.sampled_from([97, 1000, 65521, 1 << 22]), seed=st.integers(0, 2**31 - 1))
def test_streamed_fingerprint_equals_the_one_shot_definition(sizes, dtype, chunk, seed):
    gen = torch.Generator().manual_seed(seed)
    named = [(f"w{i}", (torch.randn(n, generator=gen) * 100).to(dtype)) for i, n in enumerate(sizes)]
    assert weights_fingerprint(named, chunk_words=chunk) == _one_shot(named)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 3000), chunk=st.sampled_from([13, 256, 1 << 22]), data=st.data())
def test_any_single_bit_flip_changes_the_fingerprint(n, chunk, data):
    w = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    before = weights_fingerprint([("w", w)], chunk_words=chunk)
    i, bit = data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, 15))
    flipped = w.clone()
    flipped.view(torch.int16)[i] ^= torch.tensor(1 << bit, dtype=torch.int32).to(torch.int16)
    assert weights_fingerprint([("w", flipped)], chunk_words=chunk) != before


class _LargestInt64(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.int64:
                self.largest = max(self.largest, t.numel())
        return out


def test_no_int64_temporary_larger_than_one_piece():
    w = torch.randn(100_000)  # 200k words
    with _LargestInt64() as mode:
        weights_fingerprint([("w", w)], chunk_words=4096)
    assert 0 < mode.largest <= 4096
