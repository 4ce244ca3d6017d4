"""CUDA-graph step shapes and padding, on CPU: everything about the graphs except the capture itself.

Which captured shape a step replays (`pick_shape`), how it is padded (`pad_layout`), and that the padded
step run eagerly with the graph's attention bounds (`ModelRunner.run_padded_eager`: the shape's max_q_len and
max_kv_len -- the table capacity, or SHORT_KV_TOKENS for short-KV decode graphs --, full-width tables) gives
every real logits row the same bits as the unpadded eager step, over random mixed schedules (chunked prefills
of random lengths, decodes, prefix-cache hits) and decodes crossing the short-KV bound, with the pure-torch
attention and with the Triton kernel in the interpreter.
"""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.cache.layout import StepLayout
from detinfer.engine import EngineConfig, LLMEngine, SamplingParams
from detinfer.engine.cuda_graphs import (
    SHORT_KV_TOKENS,
    decode_batch_sizes,
    decode_kv_bounds,
    graph_shapes,
    mixed_token_sizes,
    pad_layout,
    pick_shape,
)
from detinfer.engine.testing import drive
from detinfer.models.testing import write_tiny_checkpoint

VOCAB = 320


def test_mixed_token_sizes_quarter_octaves():
    assert mixed_token_sizes(0) == []
    assert mixed_token_sizes(10) == [10]
    assert mixed_token_sizes(100) == [16, 32, 64, 100]
    sizes = mixed_token_sizes(2048)
    assert sizes == [16, 32, 64, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536,
                     1792, 2048]
    # Past 128 tokens a step is padded by less than 25% of its size.
    for n in range(129, 2049):
        b = next(s for s in sizes if s >= n)
        assert (b - n) / n < 0.25
    assert decode_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]


CAPACITY = 1024  # block table capacity (tokens) of the shapes below: the short-KV decode graphs exist


def _shapes(max_seqs=8, max_tokens=64, capacity=CAPACITY, short_kv=True):
    dec, mix = decode_batch_sizes(max_seqs), mixed_token_sizes(max_tokens)
    return {s.key: s for s in graph_shapes(dec, mix, max_seqs, capacity, short_kv)}, dec, mix


def _pick(layout, shapes, dec, mix, capacity=CAPACITY):
    return pick_shape(layout, shapes, dec, mix, capacity)


def _layout(query_lens, starts, num_logits, bs=4):
    tables, nxt = [], 0
    for q, s in zip(query_lens, starts):
        k = -(-(q + s) // bs)
        tables.append(list(range(nxt, nxt + k)))
        nxt += k
    ids = [[7 + i] * q for i, q in enumerate(query_lens)]
    return StepLayout.build(tables, starts, query_lens, bs, token_ids=ids, num_logits=num_logits)


def test_pick_shape_decode_mixed_and_eager_fallbacks():
    shapes, dec, mix = _shapes()
    decode = _layout([1, 1, 1], [5, 9, 2], [1, 1, 1])
    assert _pick(decode, shapes, dec, mix) == shapes[("decode", 4, SHORT_KV_TOKENS)]
    mixed = _layout([1, 1, 20], [5, 9, 0], [1, 1, 1])
    shape = _pick(mixed, shapes, dec, mix)
    assert (shape.kind, shape.tokens, shape.seqs, shape.logit_rows, shape.max_q_len, shape.max_kv_len) == \
        ("mixed", 32, 8, 8, 32, CAPACITY)
    assert _pick(_layout([1, 40, 30], [5, 0, 0], [1, 1, 1]), shapes, dec, mix) is None  # 71 > 64 tokens
    # Prompt logprobs: more logits rows than the shape gathers -> eager.
    assert _pick(_layout([1, 20], [3, 0], [1, 20]), shapes, dec, mix) is None
    assert _pick(_layout([1, 20], [3, 0], [1, 7]), shapes, dec, mix) == shapes[("mixed", 32, CAPACITY)]
    nine = _layout([1] * 9, list(range(9)), [1] * 9)
    assert _pick(nine, shapes, dec, mix) is None  # more sequences than the largest decode graph
    assert _pick(_layout([1] * 9, [300] * 9, [1] * 9), shapes, dec, mix) is None  # long ones too


def test_short_kv_bound_is_the_attention_kernels_short_walk():
    """SHORT_KV_TOKENS is where the kernel's cheap decode path ends (speed only, so nothing else would notice
    a retune): a max_kv_len of that many keys is one split (the sequential schedule, no merge) and a walk
    of at most `short_walk_tiles` tiles (a 1-stage pipeline) for head_dim <= 128."""
    from detinfer.kernels import attention as A

    assert SHORT_KV_TOKENS == A.DEFAULT_SPLIT_SIZE == A._TUNE["short_walk_tiles"] * A.block_n_for(128)
    assert not A._pick_parallel("auto", 1, -(-SHORT_KV_TOKENS // A.DEFAULT_SPLIT_SIZE), torch.device("cpu"))
    assert A._num_stages(128, False, 1, A.DEFAULT_SPLIT_SIZE, SHORT_KV_TOKENS, A.block_n_for(128)) == 1
    assert A._num_stages(128, False, 1, A.DEFAULT_SPLIT_SIZE, SHORT_KV_TOKENS + 1, A.block_n_for(128)) > 1


def test_decode_graphs_get_a_short_kv_bound_when_the_table_is_longer():
    assert decode_kv_bounds(1024) == [1024, SHORT_KV_TOKENS]
    assert decode_kv_bounds(SHORT_KV_TOKENS + 4) == [SHORT_KV_TOKENS + 4, SHORT_KV_TOKENS]
    assert decode_kv_bounds(SHORT_KV_TOKENS) == [SHORT_KV_TOKENS]  # the capacity is short already
    assert decode_kv_bounds(128) == [128]
    assert decode_kv_bounds(1024, short_kv=False) == [1024]
    shapes, dec, mix = _shapes(max_seqs=40, max_tokens=64)
    decode = [s for s in shapes.values() if s.kind == "decode"]
    assert len(decode) == 2 * len(dec) == 14
    assert sorted((s.tokens, s.max_kv_len) for s in decode) == sorted(
        (b, kv) for b in dec for kv in (CAPACITY, SHORT_KV_TOKENS))
    assert all(s.max_q_len == 1 and s.seqs == s.tokens for s in decode)
    assert {s.max_kv_len for s in shapes.values() if s.kind == "mixed"} == {CAPACITY}
    for capacity, short_kv in ((SHORT_KV_TOKENS, True), (1024, False)):
        one, dec, mix = _shapes(max_seqs=40, max_tokens=64, capacity=capacity, short_kv=short_kv)
        assert sorted(s.tokens for s in one.values() if s.kind == "decode") == dec
        assert {s.max_kv_len for s in one.values()} == {capacity}


def test_pick_shape_short_kv_exactly_when_every_sequence_is_short():
    shapes, dec, mix = _shapes()
    short = shapes[("decode", 4, SHORT_KV_TOKENS)]
    long = shapes[("decode", 4, CAPACITY)]
    # kv_lens = cached tokens + this step's one: 255 cached -> 256 keys (short), 256 cached -> 257 (long).
    assert _pick(_layout([1], [SHORT_KV_TOKENS - 1], [1]), shapes, dec, mix) == shapes[("decode", 1, 256)]
    assert _pick(_layout([1], [SHORT_KV_TOKENS], [1]), shapes, dec, mix) == shapes[("decode", 1, CAPACITY)]
    assert _pick(_layout([1, 1, 1], [5, SHORT_KV_TOKENS - 1, 0], [1] * 3), shapes, dec, mix) == short
    # One long sequence among short ones: the whole step takes the capacity graph.
    assert _pick(_layout([1, 1, 1], [5, SHORT_KV_TOKENS, 0], [1] * 3), shapes, dec, mix) == long
    assert _pick(_layout([1, 1, 1], [5, 900, 7], [1] * 3), shapes, dec, mix) == long
    # Mixed steps keep the capacity bound however short their sequences are.
    assert _pick(_layout([1, 3], [5, 0], [1, 1]), shapes, dec, mix).max_kv_len == CAPACITY
    # Without a short family (turned off, or a table no longer than the bound) decode steps take the capacity.
    off, dec, mix = _shapes(short_kv=False)
    assert _pick(_layout([1], [5], [1]), off, dec, mix) == off[("decode", 1, CAPACITY)]
    small, dec, mix = _shapes(capacity=SHORT_KV_TOKENS)
    assert _pick(_layout([1], [5], [1]), small, dec, mix, SHORT_KV_TOKENS).max_kv_len == SHORT_KV_TOKENS


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 20), st.integers(0, 30), st.integers(0, 2)), min_size=1, max_size=8))
def test_pad_layout_keeps_real_rows_and_pads_inertly(seqs):
    shapes, dec, mix = _shapes()
    q = [a for a, _, _ in seqs]
    layout = _layout(q, [b for _, b, _ in seqs], [min(c, a) for a, _, c in seqs])
    shape = _pick(layout, shapes, dec, mix)
    if shape is None:
        assert sum(q) > 64 or len(layout.logit_rows) > 8
        return
    p = pad_layout(layout, shape)
    t, s, r = layout.num_tokens, len(q), len(layout.logit_rows)
    assert (p.num_tokens, len(p.query_lens), len(p.logit_rows)) == (shape.tokens, shape.seqs, shape.logit_rows)
    assert p.token_ids[:t] == layout.token_ids and p.positions[:t] == layout.positions
    assert p.slots[:t] == layout.slots and p.slots[t:] == [-1] * (shape.tokens - t)
    assert p.query_lens[:s] == layout.query_lens and p.kv_lens[:s] == layout.kv_lens
    assert p.query_lens[s:] == [0] * (shape.seqs - s) and p.kv_lens[s:] == [0] * (shape.seqs - s)
    assert p.cu_q_lens[-1] == t  # padding tokens belong to no sequence
    assert p.logit_rows[:r] == layout.logit_rows and all(0 <= x < shape.tokens for x in p.logit_rows)
    assert max(p.query_lens) <= shape.max_q_len and p.block_tables[:s] == layout.block_tables


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # head_dim 64: a size the Triton attention kernel takes (run here in Triton's interpreter). 512 positions:
    # a table capacity above SHORT_KV_TOKENS, so decode steps have both kv bounds.
    return write_tiny_checkpoint(tmp_path_factory.mktemp("graph_pad") / "qwen3", "Qwen3ForCausalLM", seed=5,
                                 vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=64, num_hidden_layers=2,
                                 max_position_embeddings=512)


def _kv_bits(runner):
    return [t.clone().view(torch.int32) for pair in runner.kv_cache for t in pair]  # fp32 pools, NaN-safe


def check_every_step(engine):
    """Wrap the runner: every step whose shape has a graph runs padded (graph bounds) and then, from the
    same KV state, eagerly; the logits must be bitwise equal and so must every KV pool afterwards (padding
    writes nothing). Returns (shapes checked, mismatches): recorded, not raised, because the engine turns
    an exception inside a step into failed requests."""
    runner, checked, bad = engine.runner, [], []

    def execute(batch, input_ids=None, argmax_only=False):
        layout = batch.layout
        shape = runner.graph_shape(layout)
        if shape is None:
            return runner._run_eager(layout, input_ids=input_ids, argmax_only=argmax_only)
        before = _kv_bits(runner)
        padded = runner.run_padded_eager(layout, input_ids).clone()
        after_padded = _kv_bits(runner)
        for t, saved in zip((t for pair in runner.kv_cache for t in pair), before):
            t.view(torch.int32).copy_(saved)
        eager = runner._run_eager(layout, input_ids=input_ids)
        if not torch.equal(padded, eager):
            bad.append(f"padding to {shape} changed the logits bits")
        if not all(torch.equal(a, b) for a, b in zip(after_padded, _kv_bits(runner))):
            bad.append(f"padding to {shape} wrote the KV cache differently")
        checked.append(shape)
        return torch.argmax(eager, dim=-1) if argmax_only else eager

    runner.execute = execute
    return checked, bad


def random_requests(rng, n):
    system = [rng.randrange(3, VOCAB) for _ in range(12)]
    reqs = []
    for i in range(n):
        prefix = system if rng.random() < 0.4 else []  # prefix-cache hits on the shared system prompt
        p = prefix + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 40))]
        params = SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=rng.randint(1, 6),
                                logprobs=1, ignore_eos=True)
        reqs.append((rng.randint(0, 6), f"r{i}", p, params))
    return sorted(reqs, key=lambda r: r[0])


@pytest.mark.parametrize(("attention", "seed"), [("ref", 0), ("ref", 1), ("ref", 2), ("kernel", 0)])
def test_padded_step_equals_eager_step(model_dir, attention, seed):
    rng = random.Random(seed)
    cfg = EngineConfig(max_num_batched_tokens=48, max_num_seqs=6, block_size=4, num_kv_blocks=160, dtype="float32",
                       cuda_graph_max_tokens=48)
    engine = LLMEngine(model_dir, cfg, device="cpu", attention_backend=attention)
    assert engine.runner.backend == attention and not engine.runner.use_graphs
    assert engine.runner.mixed_graph_tokens == [16, 32, 48]
    checked, bad = check_every_step(engine)
    finished = drive(engine, random_requests(rng, 8 if attention == "ref" else 5), max_steps=300,
                     signature_of=lambda out: out.outputs[0].finish_reason)
    assert not bad, bad[:3]
    assert set(finished.values()) == {"length"}, finished  # no request failed inside a step
    kinds = [(s.kind, s.max_kv_len) for s in checked]
    assert ("mixed", 512) in kinds and ("decode", SHORT_KV_TOKENS) in kinds, kinds


@pytest.mark.parametrize("attention", ["ref", "kernel"])
def test_padded_decodes_across_the_short_kv_bound_equal_eager(model_dir, attention):
    """Decodes that cross SHORT_KV_TOKENS keys: steps before run padded with max_kv_len = SHORT_KV_TOKENS,
    steps after (and steps with one long sequence among short ones) with the table's capacity; every step's
    logits and KV writes equal the unpadded eager step's, bitwise."""
    rng = random.Random(9)
    cfg = EngineConfig(max_num_batched_tokens=128, max_num_seqs=4, block_size=16, num_kv_blocks=64,
                       dtype="float32", cuda_graph_max_tokens=0)
    engine = LLMEngine(model_dir, cfg, device="cpu", attention_backend=attention)
    assert engine.runner.kv_capacity == 512 and not engine.runner.use_graphs
    checked, bad = check_every_step(engine)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)
    requests = [(0, "long", [rng.randrange(3, VOCAB) for _ in range(SHORT_KV_TOKENS - 3)], params),
                (0, "short", [rng.randrange(3, VOCAB) for _ in range(20)], params)]
    finished = drive(engine, requests, max_steps=100, signature_of=lambda out: out.outputs[0].finish_reason)
    assert not bad, bad[:3]
    assert set(finished.values()) == {"length"}, finished
    decode_bounds = [s.max_kv_len for s in checked if s.kind == "decode"]
    assert SHORT_KV_TOKENS in decode_bounds and 512 in decode_bounds, decode_bounds
