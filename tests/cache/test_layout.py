"""The one step layout (cache.layout.StepLayout): what the scheduler's batch, the model runner's tensors
and the engine's logits rows are all read from."""

import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from detinfer.cache import StepLayout, build_slot_mapping, step_tensors
from detinfer.cache.layout import slot_mapping


@given(data=st.data(), block_size=st.sampled_from([1, 4, 16]))
def test_layout_packs_chunks_in_order(data, block_size):
    n_seq = data.draw(st.integers(1, 4))
    starts = [data.draw(st.integers(0, 30)) for _ in range(n_seq)]
    lens = [data.draw(st.integers(1, 20)) for _ in range(n_seq)]
    logits = [data.draw(st.integers(0, n)) for n in lens]
    tables, nxt = [], 0
    for s, n in zip(starts, lens, strict=True):
        k = -(-(s + n) // block_size) + data.draw(st.integers(0, 2))
        tables.append(list(range(nxt + k - 1, nxt - 1, -1)))  # reversed: order must come from the table
        nxt += k
    ids = [[100 * i + j for j in range(n)] for i, n in enumerate(lens)]
    lay = StepLayout.build(tables, starts, lens, block_size, token_ids=ids, num_logits=logits)
    assert lay.token_ids == [t for row in ids for t in row]
    assert lay.positions == [p for s, n in zip(starts, lens, strict=True) for p in range(s, s + n)]
    assert lay.kv_lens == [s + n for s, n in zip(starts, lens, strict=True)]
    assert lay.cu_q_lens[-1] == lay.num_tokens == sum(lens)
    assert lay.slots == build_slot_mapping(tables, starts, lens, block_size).tolist()
    row = 0
    for i, (n, k) in enumerate(zip(lens, logits, strict=True)):
        start = lay.logits_offsets[i]
        assert lay.logit_rows[start:start + k] == list(range(row + n - k, row + n))
        row += n
    assert len(lay.logit_rows) == sum(logits)
    meta = step_tensors(lay)
    assert meta.input_ids.tolist() == lay.token_ids and meta.positions.tolist() == lay.positions
    assert meta.block_tables.shape == (n_seq, max(map(len, tables)))
    assert (meta.max_q_len, meta.max_kv_len) == (max(lens), max(lay.kv_lens))


def test_layout_refuses_short_tables():
    with pytest.raises(ValueError, match="sequence 7: positions 0..16 need 2 blocks of 16"):
        StepLayout.build([[3]], [0], [17], 16, names=[7])
    with pytest.raises(ValueError, match="one entry per sequence"):
        StepLayout.build([[3]], [0, 1], [1], 16)
    assert slot_mapping([5, 2], 6, 4, 8) == [46, 47, 16, 17]


def test_scheduled_batch_layout_is_the_one_the_runner_uses():
    from detinfer.engine.config import EngineConfig
    from detinfer.engine.sampling_params import SamplingParams
    from detinfer.engine.scheduler import Scheduler

    sched = Scheduler(EngineConfig(max_num_batched_tokens=16, max_num_seqs=4, block_size=4, num_kv_blocks=32,
                                   max_model_len=64))
    sched.add_request("a", list(range(1, 12)), SamplingParams(prompt_logprobs=1))
    sched.add_request("b", [5, 6, 7], SamplingParams())
    batch = sched.schedule()
    lay = batch.layout
    assert lay is batch.layout  # computed once
    assert lay.slots == [s for item in batch.scheduled for s in item.slot_mapping()]
    assert lay.logits_offsets == [0, batch.scheduled[0].num_logits]
    assert torch.equal(step_tensors(lay).slot_mapping, torch.tensor(lay.slots))


def test_layout_and_scheduler_do_not_import_torch():
    code = "import sys, detinfer.cache.layout, detinfer.engine.scheduler; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_kernels_do_not_import_cache():
    from pathlib import Path

    import detinfer.kernels

    for path in Path(detinfer.kernels.__file__).parent.glob("*.py"):
        assert "detinfer.cache" not in path.read_text(), path.name
