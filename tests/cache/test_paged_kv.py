"""Paged KV cache helpers (detinfer.cache.paged_kv): pools, block tables, slot mappings, metadata checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from detinfer.cache import (
    DEFAULT_BLOCK_SIZE,
    KVCacheSpec,
    allocate_kv_cache,
    build_block_tables,
    build_slot_mapping,
    build_step_metadata,
    check_step_metadata,
    gather_kv,
    num_blocks_for_bytes,
)
from detinfer.cache.paged_kv import upload


def test_spec_pools_and_budget():
    spec = KVCacheSpec(num_blocks=10, block_size=DEFAULT_BLOCK_SIZE, num_kv_heads=2, head_dim=64,
                       dtype=torch.float16)
    assert spec.pool_shape == (10, 16, 2, 64)
    assert spec.bytes_per_block == 2 * 16 * 2 * 64 * 2
    pools = allocate_kv_cache(spec, num_layers=3, device="cpu", fill=float("nan"))
    assert len(pools) == 3 and all(k.shape == spec.pool_shape and k.isnan().all() for k, _ in pools)
    assert pools[0][0].data_ptr() != pools[0][1].data_ptr() != pools[1][0].data_ptr()
    assert num_blocks_for_bytes(spec.bytes_per_block * 3 * 7 + 5, block_size=16, num_kv_heads=2, head_dim=64,
                                dtype=torch.float16, num_layers=3) == 7
    with pytest.raises(ValueError, match="block_size"):
        KVCacheSpec(10, 0, 2, 64)
    with pytest.raises(ValueError, match="dtype"):
        KVCacheSpec(10, 16, 2, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="num_layers"):
        allocate_kv_cache(spec, 0, "cpu")


@given(data=st.data(), block_size=st.sampled_from([1, 4, 16]))
def test_slot_mapping_and_gather_round_trip(data, block_size):
    """Keys written through build_slot_mapping come back in order through the block table."""
    lengths = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=4))
    need = [-(-n // block_size) for n in lengths]
    perm = torch.randperm(sum(need) + 3, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 9))))
    blocks, i = [], 0
    for n in need:
        blocks.append(perm[i:i + n].tolist())
        i += n
    cached = [data.draw(st.integers(0, n - 1)) for n in lengths]
    md = build_step_metadata(blocks, cached, [n - c for n, c in zip(lengths, cached, strict=True)], block_size)
    assert md.cu_q_lens.tolist()[-1] == sum(n - c for n, c in zip(lengths, cached, strict=True))
    assert md.kv_lens.tolist() == lengths and md.max_kv_len == max(lengths)
    assert md.block_tables.dtype == torch.int32 and md.block_tables.shape == (len(lengths), max(need))
    cache = torch.full((len(perm), block_size, 1, 2), -1.0)
    full = build_slot_mapping(blocks, [0] * len(lengths), lengths, block_size)
    values = torch.arange(sum(lengths), dtype=torch.float32)[:, None, None].expand(-1, 1, 2)
    cache.view(-1, 1, 2)[full] = values
    start = 0
    for s, n in enumerate(lengths):
        got = gather_kv(cache, md.block_tables[s], n)[:, 0, 0]
        assert got.tolist() == list(range(start, start + n))
        start += n
    assert len(set(full.tolist())) == len(full)  # no slot used twice
    padded = build_slot_mapping(blocks, cached, [1] * len(lengths), block_size, pad_to=len(lengths) + 2)
    assert padded.tolist()[-2:] == [-1, -1]


def test_builders_reject_bad_input():
    with pytest.raises(ValueError, match="blocks"):
        build_slot_mapping([[0]], [0], [17], 16)
    with pytest.raises(ValueError, match="max_blocks"):
        build_block_tables([[0, 1, 2]], max_blocks=2)
    with pytest.raises(ValueError, match="query_lens"):
        build_step_metadata([[0]], [0], [0], 16)
    with pytest.raises(ValueError, match="one entry per sequence"):
        build_step_metadata([[0]], [0, 1], [1], 16)


def _md(cu, kv, tables):
    return (torch.tensor(cu, dtype=torch.int32), torch.tensor(kv, dtype=torch.int32),
            torch.tensor(tables, dtype=torch.int32))


@pytest.mark.parametrize("cu,kv,tables,match", [
    ([0, 3, 2], [3, 4], [[0], [1]], "never decrease"),
    ([1, 3], [3], [[0]], "start at 0"),
    ([0, 5], [4], [[0]], "q_len 5 > kv_len 4"),
    ([0, 1, 2], [1, 17], [[0], [1]], "block table too short"),
    ([0, 1], [1], [[9]], "outside"),
    ([0, 1], [1], [[-1]], "outside"),
    ([0, 9], [9], [[0]], "exceeds"),
])
def test_check_step_metadata_errors(cu, kv, tables, match):
    with pytest.raises(ValueError, match=match):
        check_step_metadata(*_md(cu, kv, tables), block_size=16, num_blocks=4, num_tokens=8)


def test_check_step_metadata_accepts_valid_and_padding_rows():
    # rows of q past cu_q_lens[-1] are padding; unused table entries may hold anything
    check_step_metadata(*_md([0, 2, 3], [5, 16], [[1, 77], [2, -3]]), block_size=16, num_blocks=4,
                        num_tokens=8, max_kv_len=16)
    with pytest.raises(ValueError, match="max_kv_len"):
        check_step_metadata(*_md([0, 1], [16], [[0]]), block_size=16, num_blocks=4, num_tokens=1,
                            max_kv_len=15)


@given(rows=st.integers(1, 5), cols=st.integers(1, 6), extra_rows=st.integers(0, 3), extra_cols=st.integers(0, 3),
       seed=st.integers(0, 2**16))
def test_upload_into_a_buffer_view_writes_only_the_view(rows, cols, extra_rows, extra_cols, seed):
    """`upload(..., out=view)` (how CUDA-graph inputs are refreshed) fills exactly the view, strided or not,
    and returns it; without `out` it makes a new tensor of the values."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(-2**40, 2**40, (rows, cols), generator=gen)
    buffer = torch.full((rows + extra_rows, cols + extra_cols), 7, dtype=torch.int64)
    expected = buffer.clone()
    expected[:rows, :cols] = values
    view = buffer[:rows, :cols]
    assert upload(values.tolist(), torch.int64, "cpu", out=view) is view
    assert torch.equal(buffer, expected)
    assert torch.equal(upload(values.tolist(), torch.int64, "cpu"), values)
    flat = torch.zeros(rows * cols + extra_cols, dtype=torch.int32)
    upload(values.reshape(-1).remainder(1000).tolist(), torch.int32, "cpu", out=flat[:rows * cols])
    assert torch.equal(flat[:rows * cols], values.reshape(-1).remainder(1000).to(torch.int32))
    assert not flat[rows * cols:].any()


@pytest.mark.gpu
def test_gpu_upload_into_a_strided_device_view_is_exact():
    """On CUDA the values go through pinned memory with a non-blocking copy; a strided destination (a graph's
    block-table columns) gets exactly the values, the rest of the buffer is untouched."""
    buffer = torch.full((6, 9), -3, dtype=torch.int32, device="cuda")
    values = [[r * 10 + c for c in range(4)] for r in range(3)]
    upload(values, torch.int32, "cuda", out=buffer[:3, :4])
    torch.cuda.synchronize()
    expected = torch.full((6, 9), -3, dtype=torch.int32)
    expected[:3, :4] = torch.tensor(values, dtype=torch.int32)
    assert torch.equal(buffer.cpu(), expected)
    assert torch.equal(upload(values, torch.int64, "cuda").cpu(), torch.tensor(values))
