"""Paged attention on the GPU (marker gpu): bf16, the default split size, model head counts, long sequences.

The CPU tests run the Triton interpreter with a fixed-order dot; here the real matrix instructions run,
so these tests are what proves the kernel's invariance assumptions on the hardware: a dot row's bits
do not depend on the tile height (decode programs use 16-row mma tiles, prefill 128-row wgmma tiles)
or on the other rows, and the sequential and split-parallel schedules give the same bits. Includes the
negative control (stock SDPA decode changes with the batch size) so the invariance checks can fail.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.kernels.attention import (
    DEFAULT_SPLIT_SIZE,
    attention_contiguous,
    paged_attention,
    paged_attention_fast,
)

# Sibling helper modules: the suite runs with --import-mode=importlib, which does not put test
# folders on sys.path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_attention import assert_same  # noqa: E402
from test_attention_scenarios import (  # noqa: E402
    TOL,
    PagedRunner,
    make_seqs,
    prefill_then_decode,
    random_plans,
    whole_plan,
)

pytestmark = pytest.mark.gpu
FEW = max(4, settings.default.max_examples // 2)


def ref_f64(seq, scale, window=None) -> torch.Tensor:
    """Plain float64 attention (matmul + softmax): fast enough for 8k tokens on the GPU."""
    q, k, v = seq.q.double(), seq.k.double(), seq.v.double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1).transpose(0, 1)
    v = v.repeat_interleave(group, 1).transpose(0, 1)
    keys = torch.arange(q.shape[0], device=q.device)
    outs = []
    for r0 in range(0, q.shape[0], 1024):  # [H, 1024, L] fp64 scores at a time
        rows = keys[r0:r0 + 1024]
        s = (q[r0:r0 + 1024].transpose(0, 1) @ k.transpose(1, 2)) * scale
        hide = keys[None, :] > rows[:, None]
        if window is not None:
            hide |= keys[None, :] <= rows[:, None] - window
        outs.append((s.masked_fill(hide, float("-inf")).softmax(-1) @ v).transpose(0, 1))
    return torch.cat(outs)


def check_accuracy(outs, seqs, scale, dtype, window=None):
    atol, rtol = TOL[dtype]
    for out, seq in zip(outs, seqs, strict=True):
        ref = ref_f64(seq, scale, window)
        err = (out.double() - ref).abs()
        assert bool((err <= atol + rtol * ref.abs()).all()), f"worst err {err.max().item():.3g}"


@settings(max_examples=FEW)
@given(data=st.data(), dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       heads=st.sampled_from([(32, 8, 128), (8, 1, 128), (28, 4, 128), (16, 16, 64)]))
def test_gpu_random_plans_match_whole_prefill(data, dtype, heads):
    hq, hkv, d = heads
    lengths = data.draw(st.lists(st.one_of(st.integers(1, 600), st.integers(600, 8192)), min_size=1,
                                 max_size=3), label="lengths")
    seqs = make_seqs(lengths, hq, hkv, d, dtype, seed=data.draw(st.integers(0, 999)))
    scale = 1 / math.sqrt(d)
    whole = PagedRunner(seqs, seed=1).run(whole_plan(lengths), scale)
    chunked = PagedRunner(seqs, seed=2).run(data.draw(random_plans(lengths, max_steps=8)), scale)
    assert_same(whole, chunked, "random chunking")
    prefix = [max(0, n - data.draw(st.integers(1, 16))) for n in lengths]
    sched = data.draw(st.sampled_from(["auto", "parallel", "sequential"]))
    decoded = PagedRunner(seqs, seed=3).run(prefill_then_decode(lengths, prefix, schedule=sched), scale)
    assert_same(whole, decoded, "prefill + decode")
    check_accuracy(whole, seqs, scale, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_decode_same_bits_in_batches_of_1_to_256(dtype):
    """One sequence decoded alone and among 7, 63, 255 others (auto picks split-parallel for small
    batches and sequential for large ones): identical bits; and they equal its whole-prompt prefill."""
    lengths = [4097] + [20 + (37 * i) % 300 for i in range(255)]
    seqs = make_seqs(lengths, 32, 8, 128, dtype, seed=11)
    scale = 1 / math.sqrt(128)
    runner = PagedRunner(seqs, seed=5)
    runner.run_more([(i, n - 1) for i, n in enumerate(lengths)], scale)  # prefill all but one token
    target = None
    for bs in (1, 8, 64, 256):
        out = runner.run_more([(i, 1) for i in range(bs)], scale, max_q_len=1, commit=False)
        target = out[0] if target is None else target
        assert torch.equal(out[0], target), f"batch {bs} changed the bits"
    whole = PagedRunner(seqs[:1], seed=6).run(whole_plan(lengths[:1]), scale)[0]
    assert torch.equal(whole[-1], target[0])


def test_gpu_negative_control_sdpa_decode_varies_with_batch():
    """Stock SDPA decode (1 query, 4096 keys, 32/8 heads, bf16) gives different bits for a row at
    batch 1 and in a larger batch; without this the invariance tests could not fail."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn((256, 32, 1, 128), device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn((256, 8, 4096, 128), device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    alone = F.scaled_dot_product_attention(q[:1], k[:1], v[:1], enable_gqa=True)
    differs = [bs for bs in (8, 64, 256) if not torch.equal(
        F.scaled_dot_product_attention(q[:bs], k[:bs], v[:bs], enable_gqa=True)[:1], alone)]
    assert differs, "stock SDPA decode was batch-invariant here: the negative control failed"


def test_gpu_fast_path_is_not_invariant_but_accurate():
    """The fast path sizes splits from the batch: its bits may move (reported, not required); it must
    stay accurate."""
    lengths = [3000] + [500] * 63
    seqs = make_seqs(lengths, 32, 8, 128, torch.bfloat16, seed=12)
    scale = 1 / math.sqrt(128)
    runner = PagedRunner(seqs, seed=7)
    runner.run_more([(i, n - 1) for i, n in enumerate(lengths)], scale, attn=paged_attention_fast)
    a = runner.run_more([(0, 1)], scale, attn=paged_attention_fast, max_q_len=1, commit=False)
    b = runner.run_more([(i, 1) for i in range(64)], scale, attn=paged_attention_fast,
                             max_q_len=1)
    print("fast path bitwise equal across batch 1/64:", torch.equal(a[0], b[0]))
    ref = ref_f64(seqs[0], scale)[-1:]
    assert bool(((b[0].double() - ref).abs() <= 2e-2 + 2e-2 * ref.abs()).all())


def test_gpu_cuda_graph_decode_replays_eager_bits():
    lengths = [777, 4096, 33]
    seqs = make_seqs(lengths, 32, 8, 128, torch.bfloat16, seed=13)
    scale = 1 / math.sqrt(128)
    runner = PagedRunner(seqs, seed=8)
    runner.run_more([(i, n - 1) for i, n in enumerate(lengths)], scale)
    eager = runner.run_more([(i, 1) for i in range(3)], scale, max_q_len=1, commit=False)
    step = runner.last_step
    args = (step["q"], runner.k_cache, runner.v_cache, step["block_tables"], step["kv_lens"], step["cu_q_lens"])
    out = torch.full_like(step["q"], float("nan"))
    for sched in ("parallel", "sequential"):
        kw = dict(max_q_len=1, max_kv_len=4096, validate=False, schedule=sched, out=out)
        paged_attention(*args, scale, **kw)  # warm-up compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            paged_attention(*args, scale, **kw)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.cat(eager)), sched


@pytest.mark.parametrize("window", [None, 1000])
def test_gpu_contiguous_and_window_match_paged(window):
    lengths = [3000, 1500]
    seqs = make_seqs(lengths, 32, 8, 128, torch.bfloat16, seed=14)
    scale = 1 / math.sqrt(128)
    paged = PagedRunner(seqs).run(whole_plan(lengths), scale, sliding_window=window)
    decoded = PagedRunner(seqs, seed=9).run(prefill_then_decode(lengths, [n - 3 for n in lengths]), scale,
                                            sliding_window=window)
    assert_same(paged, decoded, "window decode")
    lk, pad = 3100, [100, 1600]
    q = torch.zeros((2, 32, lk, 128), device="cuda", dtype=torch.bfloat16)
    k = torch.full((2, 8, lk, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    v = k.clone()
    for b, (s, p) in enumerate(zip(seqs, pad, strict=True)):
        q[b, :, p:] = s.q.transpose(0, 1)
        k[b, :, p:] = s.k.transpose(0, 1)
        v[b, :, p:] = s.v.transpose(0, 1)
    out = attention_contiguous(q, k, v, torch.tensor(pad, dtype=torch.int32, device="cuda"), scale,
                               sliding_window=window)
    for b, p in enumerate(pad):
        assert torch.equal(out[b, :, p:].transpose(0, 1), paged[b])
    check_accuracy(paged, seqs, scale, torch.bfloat16, window)


def test_gpu_head_dim_256_and_default_split():
    assert DEFAULT_SPLIT_SIZE % 64 == 0
    lengths = [1200, 300]
    seqs = make_seqs(lengths, 8, 2, 256, torch.bfloat16, seed=15)
    scale = 1 / 16
    whole = PagedRunner(seqs).run(whole_plan(lengths), scale)
    decoded = PagedRunner(seqs, seed=1).run(prefill_then_decode(lengths, [n - 4 for n in lengths]), scale)
    assert_same(whole, decoded, "head_dim 256")
    check_accuracy(whole, seqs, scale, torch.bfloat16)


@pytest.mark.parametrize("kv", [1, 63, 110, 256, 257, 600])
def test_gpu_short_decode_bits_do_not_depend_on_schedule_grid_or_pipeline_depth(kv, monkeypatch):
    """Decode over short key ranges (one split up to 256 keys: the partial chain of a single split is the
    final result in both schedules): sequential vs split-parallel + merge, max_kv_len exact vs the table's
    capacity (the CUDA-graph grid), and 1 vs 3 pipeline stages all give the same bits."""
    from detinfer.kernels import attention as A

    g = torch.Generator(device="cuda").manual_seed(kv)
    bs, blocks = 4, 64
    kc = torch.randn((bs * blocks, 16, 8, 128), device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(kc.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    bt = torch.randperm(bs * blocks, device="cuda", generator=g).to(torch.int32).view(bs, blocks)
    q = torch.randn((bs, 32, 128), device="cuda", dtype=torch.bfloat16, generator=g)
    kv_lens = torch.tensor([kv, max(1, kv - 5), kv, 1], device="cuda", dtype=torch.int32)
    cu = torch.arange(bs + 1, device="cuda", dtype=torch.int32)
    outs = {}
    for stages, short in ((3, 4), (3, 0), (1, 1 << 20)):
        monkeypatch.setitem(A._TUNE, "stages", stages)
        monkeypatch.setitem(A._TUNE, "short_walk_tiles", short)
        for sched in ("sequential", "parallel", "auto"):
            for max_kv in (kv, blocks * 16):
                outs[(stages, short, sched, max_kv)] = paged_attention(
                    q, kc, vc, bt, kv_lens, cu, 0.088, max_q_len=1, max_kv_len=max_kv, schedule=sched)
    first = next(iter(outs.values()))
    for key, out in outs.items():
        assert torch.equal(out, first), f"{key} changed the bits"
