"""Engine on the GPU (bf16, Triton kernels, CUDA graphs): bitwise invariance with graphs on and off,
padded graph batches leave real rows alone, and fast mode as a negative control.

Skipped (shown as skipped) without CUDA. The model is a random bf16 Qwen3-shaped checkpoint (q/k norm,
GQA 8/2, head_dim 128) big enough that cuBLAS and the attention kernels pick different work splits for
different batch shapes.
"""

import gc
import random

import pytest
import torch

from detinfer.engine import EngineConfig, LLMEngine, SamplingParams
from detinfer.engine.cuda_graphs import SHORT_KV_TOKENS
from detinfer.engine.testing import drive
from detinfer.models.testing import write_tiny_checkpoint

pytestmark = pytest.mark.gpu
VOCAB = 2048


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("engine_gpu") / "qwen3", "Qwen3ForCausalLM", seed=11,
                                 vocab_size=VOCAB, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                                 num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                                 max_position_embeddings=1024, dtype="bfloat16")


def _hex(x):
    return None if x is None else float(x).hex()


def signature(out):
    comps = tuple((c.token_ids, c.finish_reason, _hex(c.cumulative_logprob),
                   tuple((e.token_id, _hex(e.logprob), e.rank, tuple((t, _hex(v)) for t, v in e.top_logprobs.items()))
                         for e in c.logprobs or ())) for c in out.outputs)
    return out.prompt_token_ids, comps


def run(engine, requests):
    results = drive(engine, requests, max_steps=5000, signature_of=signature)
    engine.scheduler.check_invariants()
    return results


def make(model_dir, **kw):
    gc.collect()  # engines hold reference cycles (scheduler -> stop checker -> engine): free old pools now
    torch.cuda.empty_cache()
    cfg = dict(max_num_batched_tokens=512, max_num_seqs=16, block_size=16, num_kv_blocks=512,
               dtype="bfloat16")
    cfg.update(kw)
    return LLMEngine(model_dir, EngineConfig(**cfg), device="cuda")


def workload(seed, n_other=12, plain=False):
    """plain: every request greedy without logprobs (their steps finish as argmax ids, not logits)."""
    rng = random.Random(seed)
    def params(i):
        if plain:
            return SamplingParams(temperature=0.0, max_tokens=rng.randint(4, 24), ignore_eos=True)
        if i % 2:
            return SamplingParams(temperature=0.0, max_tokens=rng.randint(4, 24), logprobs=2, ignore_eos=True)
        return SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=rng.randint(4, 24), logprobs=2,
                              ignore_eos=True)
    system = [rng.randrange(3, VOCAB) for _ in range(40)]
    target = (0, "target", system + [rng.randrange(3, VOCAB) for _ in range(70)], params(1))
    others = [(rng.randint(0, 12), f"o{i}",
               (system if i % 3 == 0 else []) + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 300))],
               params(i)) for i in range(n_other)]
    return target, others


def graph_calls(engine):
    """Record the real batch size of every graph replay."""
    sizes, orig = [], engine.runner._run_graph

    def counting(host, *args):
        sizes.append(len(host.query_lens))
        return orig(host, *args)

    engine.runner._run_graph = counting
    return sizes


@pytest.mark.parametrize("mode", ["deterministic", "fast"])
def test_invariance_graphs_on_and_off(model_dir, mode):
    """Deterministic: the target alone (graphs) == among others, budgets 64/512, graphs on/off, bitwise.
    Fast (negative control): the same comparisons find at least one difference."""
    assert_invariance_graphs_on_and_off(model_dir, mode, seed=0)


def assert_invariance_graphs_on_and_off(model_dir, mode, seed, moe_layers=None):
    """The target alone (graphs) vs among others at budgets 64/512, graphs on and off: deterministic mode
    equal bitwise; fast mode (negative control) differs at least once."""
    target, others = workload(seed)
    alone_engine = make(model_dir, mode=mode)
    assert alone_engine.runner.use_graphs
    if moe_layers is not None:
        assert alone_engine.model_config.moe_layers == moe_layers
    alone = run(alone_engine, [target])["target"]
    del alone_engine
    mismatches = []
    for budget in (64, 512):
        for eager in (False, True):
            engine = make(model_dir, mode=mode, max_num_batched_tokens=budget, enforce_eager=eager)
            calls = graph_calls(engine)
            got = run(engine, [target, *others])
            assert bool(calls) == (not eager)
            mismatches.append(got["target"] != alone)
            del engine
    if mode == "deterministic":
        assert not any(mismatches)
    else:
        assert any(mismatches), "fast mode showed no batch variance in these scenarios"


def test_padded_graph_batches_do_not_change_real_rows(model_dir):
    """The same request decoded in graph batches of 1 (no padding), 3 (padded to 4), 5 (to 8), 13 (to 16)
    and eagerly: identical bits. The others have different prompts, so real rows differ from each other."""
    rng = random.Random(5)
    prompt = [rng.randrange(3, VOCAB) for _ in range(33)]
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=3, ignore_eos=True)
    results = {}
    for n, eager in ((1, False), (3, False), (5, False), (13, False), (5, True)):
        engine = make(model_dir, enforce_eager=eager)
        calls = graph_calls(engine)
        reqs = [(0, "target", prompt, params)] + [
            (0, f"o{i}", [rng.randrange(3, VOCAB) for _ in range(9 + i)], params) for i in range(n - 1)]
        results[(n, eager)] = run(engine, reqs)["target"]
        if not eager:
            assert n in calls, f"expected decode steps of {n} sequences to replay a graph, saw {set(calls)}"
            assert n == 1 or n not in engine.runner.graph_sizes, "this size should need padding"
    first = results[(1, False)]
    assert all(r == first for r in results.values())


def test_graph_capture_sizes_and_memory(model_dir):
    # The budget is what is in use now plus 6 GiB: under pytest-xdist other workers hold GPU memory too, so
    # a fixed fraction of the card can already be taken by them.
    free, total = torch.cuda.mem_get_info()
    utilization = min(0.95, (total - free + 6 * 2**30) / total)
    engine = make(model_dir, max_num_seqs=40, num_kv_blocks=None, gpu_memory_utilization=utilization)
    runner = engine.runner
    assert runner.graph_sizes == [1, 2, 4, 8, 16, 32, 40]
    assert runner.mixed_graph_tokens == [16, 32, 64, 128, 160, 192, 224, 256, 320, 384, 448, 512]
    assert runner.num_kv_blocks >= runner.max_blocks_per_seq
    assert torch.cuda.memory_allocated() < utilization * total
    # The reserve kept out of the KV pool covers what the capture really took.
    print(f"capture {runner.graphs.capture_seconds:.2f} s, pool {runner.graphs.pool_bytes / 2**20:.0f} MiB, "
          f"reserve {runner.graph_reserve_bytes / 2**20:.0f} MiB")
    assert 0 < runner.graphs.pool_bytes + runner.graphs.static_bytes() <= runner.graph_reserve_bytes
    off = make(model_dir, max_num_seqs=40, cuda_graph_max_tokens=0)
    # 7 decode batch sizes x 2 kv bounds (the table's 1024 tokens and SHORT_KV_TOKENS), no mixed graphs.
    assert off.runner.mixed_graph_tokens == [] and len(off.runner.graphs.shapes) == 14
    assert sorted(key[1:] for key in off.runner.graphs.shapes) == sorted(
        (b, kv) for b in off.runner.graph_sizes for kv in (1024, SHORT_KV_TOKENS))


def graph_vs_eager_every_step(engine):
    """Every step with a graph shape runs its graph, then (KV pools restored) eagerly: the logits and the
    KV pools afterwards are compared bitwise. Returns (shapes replayed, mismatches); mismatches are
    recorded, not raised, because the engine turns an exception inside a step into failed requests."""
    runner, replayed, bad = engine.runner, [], []

    def pools():
        return [t.clone() for pair in runner.kv_cache for t in pair]

    def restore(saved_pools):
        for t, saved in zip((t for pair in runner.kv_cache for t in pair), saved_pools):
            t.copy_(saved)

    def execute(batch, input_ids=None, argmax_only=False):
        layout = batch.layout
        shape = runner.graph_shape(layout)
        if shape is None:
            return runner._run_eager(layout, input_ids=input_ids, argmax_only=argmax_only)
        before = pools()
        graph = runner._run_graph(layout, shape, input_ids).clone()
        after_graph = pools()
        restore(before)
        if argmax_only:  # the step as the engine asked for it too: its graph's ids
            ids = runner._run_graph(layout, shape, input_ids, True).clone()
            restore(before)
        eager = runner._run_eager(layout, input_ids=input_ids)
        if not torch.equal(graph, eager):
            bad.append(f"{shape}: logits differ")
        if argmax_only and not torch.equal(ids, torch.argmax(eager, dim=-1)):
            bad.append(f"{shape}: argmax ids differ from the logits' argmax")
        if not all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(after_graph, pools())):
            bad.append(f"{shape}: KV pools differ")
        replayed.append(shape)
        return ids if argmax_only else eager

    runner.execute = execute
    return replayed, bad


def test_argmax_only_graph_steps_give_the_eager_logits_argmax(model_dir):
    """Plain greedy requests: every step asks for argmax ids only; each graph replay's ids equal the argmax
    of the eager step's logits (and its graph logits equal the eager ones)."""
    target, others = workload(7, n_other=14, plain=True)
    engine = make(model_dir, max_num_batched_tokens=128)
    replayed, bad = graph_vs_eager_every_step(engine)
    asked, checked = [], engine.runner.execute

    def execute(batch, input_ids=None, argmax_only=False):
        asked.append(argmax_only)
        return checked(batch, input_ids, argmax_only)

    engine.runner.execute = execute
    got = run(engine, [target, *others])
    assert not bad, bad[:4]
    assert asked and all(asked), "plain greedy steps should finish as argmax ids"
    assert {s.kind for s in replayed} == {"mixed", "decode"}
    assert all(len(sig[1][0][0]) > 0 for sig in got.values())


@pytest.mark.parametrize("seed", range(4))
def test_mixed_graph_steps_replay_eager_bits(model_dir, seed):
    """Random mixed batches (prefill chunks of random lengths, decodes, shared prefixes: prefix-cache hits):
    every graph replay (decode and mixed) gives the eager step's logits and KV bits, and every request's
    output equals its output alone."""
    target, others = workload(100 + seed, n_other=14)
    engine = make(model_dir, max_num_batched_tokens=(64, 128, 256, 512)[seed])
    replayed, bad = graph_vs_eager_every_step(engine)
    got = run(engine, [target, *others])
    assert not bad, bad[:4]
    kinds = [s.kind for s in replayed]
    assert kinds.count("mixed") >= 3 and "decode" in kinds, kinds
    del engine
    for req in (target, *others[:4]):
        alone = run(make(model_dir), [(0, *req[1:])])
        assert got[req[1]] == alone[req[1]], f"{req[1]} differs from its run alone"


def test_short_and_long_kv_decode_graphs_replay_eager_bits(model_dir):
    """Decodes crossing SHORT_KV_TOKENS keys, alone (batch 1) and in a padded batch of 5 with short and long
    sequences: steps whose sequences are all short replay the short-KV decode graphs, the others the
    capacity ones; every replay gives the eager step's logits and KV bits, and the outputs equal those of
    an eager engine and of an engine without the short-KV graphs."""
    rng = random.Random(21)

    def prompt(n):
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=24, logprobs=2, ignore_eos=True)
    # "solo" decodes alone (kv 251 -> 274) and finishes before the others arrive; of those, 236 and 244
    # cross 256 keys mid-run while 30 and 60 stay short.
    requests = [(0, "solo", prompt(250), params)] + [
        (40, f"b{i}", prompt(n), sampled if i % 2 else params) for i, n in enumerate((236, 244, 30, 60, 240))]
    engine = make(model_dir)
    assert engine.runner.kv_capacity == 1024
    replayed, bad = graph_vs_eager_every_step(engine)
    got = run(engine, requests)
    assert not bad, bad[:4]
    decodes = {(s.tokens, s.max_kv_len) for s in replayed if s.kind == "decode"}
    for shape in ((1, SHORT_KV_TOKENS), (1, 1024), (8, SHORT_KV_TOKENS), (8, 1024)):
        assert shape in decodes, f"expected a decode replay of {shape} (batch size, kv bound), saw {decodes}"
    del engine
    assert got == run(make(model_dir, enforce_eager=True), requests)
    without = make(model_dir, cuda_graph_short_kv=False)
    assert {key[2] for key in without.runner.graphs.shapes} == {1024}
    assert got == run(without, requests)


def test_fast_mode_mixed_graphs_replay(model_dir):
    """Fast mode replays the same mixed-step graphs (its bits may move with the bucket: not compared)."""
    target, others = workload(7)
    engine = make(model_dir, mode="fast", max_num_batched_tokens=256)
    kinds = []
    orig = engine.runner._run_graph

    def counting(layout, *shape):
        kinds.append(engine.runner.graph_shape(layout).kind)
        return orig(layout, *shape)

    engine.runner._run_graph = counting
    got = run(engine, [target, *others])
    assert len(got) == 1 + len(others) and "mixed" in kinds and "decode" in kinds


def pending_input_steps(engine):
    """Count the steps whose input ids were (partly) gathered on the device from the previous step."""
    calls, orig = [0], engine.runner.execute

    def counting(batch, input_ids=None, argmax_only=False):
        calls[0] += input_ids is not None
        return orig(batch, input_ids=input_ids, argmax_only=argmax_only)

    engine.runner.execute = counting
    return calls


@pytest.mark.parametrize("eager", [False, True])
def test_async_scheduling_on_equals_off(model_dir, eager):
    """Overlapped scheduling on vs off, graphs on (decode steps replay graphs fed from the previous step's
    sampled ids on the device) and off: every request's token ids and logprobs are bit-identical, with
    stop tokens that finish requests while their next step is in flight, and every block comes back."""
    target, others = workload(2)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = run(make(model_dir, async_scheduling=False), [(0, f"p{i}", others[i][2], greedy) for i in range(2)])
    # Each stops at its greedy output's token 5 (or earlier, where that id came before).
    stops = [(1, f"stop-{i}", others[i][2], SamplingParams(temperature=0.0, max_tokens=40, logprobs=1,
                                                            ignore_eos=True,
                                                            stop_token_ids=[plain[f"p{i}"][1][0][0][5]]))
             for i in range(2)]
    requests = [target, *others, *stops]
    results = {}
    for overlap in (True, False):
        engine = make(model_dir, async_scheduling=overlap, enforce_eager=eager, max_num_batched_tokens=64)
        calls = graph_calls(engine)
        gathered = pending_input_steps(engine)
        results[overlap] = run(engine, requests)
        assert bool(calls) == (not eager)
        # Control: with overlap the decodes really took their input ids from the previous step on the
        # device (and never without it), so the equality below compares two different pipelines.
        assert (gathered[0] > 0) == overlap
        assert engine.stats().kv_blocks_used == 0
        del engine
    assert results[True].keys() == {r[1] for r in requests}
    assert all(results[True][f"stop-{i}"][1][0][1] == "stop" for i in range(2))
    assert results[True] == results[False]


def test_async_decode_steps_never_wait_for_the_device(model_dir):
    """In steady decode with overlap and graphs, nothing in a step synchronizes with the device except
    reading the previous step's results through its event: torch's sync debug mode raises on any hidden
    synchronizing call (a pageable copy, .item(), .tolist() of a device tensor)."""
    engine = make(model_dir, async_scheduling=True)
    rng = random.Random(9)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=40, logprobs=2, ignore_eos=True)
    for i in range(5):
        engine.add_request(f"r{i}", [rng.randrange(3, VOCAB) for _ in range(20 + i)], params)
    for _ in range(4):  # prefills and the first decodes: allocations, first launches
        engine.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(20):
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    run(engine, [])
