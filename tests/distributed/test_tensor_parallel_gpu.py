"""Tensor parallelism on GPUs (NCCL, bf16, Triton kernels), asserted bitwise.

Skipped (shown as skipped) without CUDA; the TP>1 tests also with a single GPU. The model is a random bf16
Qwen3-shaped checkpoint (q/k norm, GQA 8/2, head_dim 128, 8 reduction chunks), big enough that the matmul
and attention kernels pick several configs. Checked: TP=1 with the chunk tree in CUDA graphs == eager (one
GPU); TP=2 == TP=1 with tp_invariant_reduction (requests and a forward's logits); TP=2 alone == batched
with the default reduction; TP=4 == TP=1 when 4 GPUs are visible; fast mode (NCCL all-reduce) runs; TP=2
with CUDA graphs == eager == overlap off; exact_sum (NCCL all-reduce at TP=2) == all-gather + tree in graphs.
"""

import hashlib
import os
import random

import pytest
import torch
from test_tensor_parallel import REQUESTS, engine_at, forward_logits, greedy, prompt, run, sampled

from detinfer.models.testing import write_tiny_checkpoint

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0



@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tp_gpu") / "qwen3", "Qwen3ForCausalLM", seed=13,
                                 vocab_size=2048, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                                 num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                                 max_position_embeddings=1024, dtype="bfloat16")


def _results(model_dir, tp, **kw):
    engine = engine_at(model_dir, tp, device="cuda", max_num_batched_tokens=64, max_num_seqs=8, **kw)
    try:
        batched = run(engine, REQUESTS)
        alone = {rid: run(engine, [(0, rid, p, params)])[rid] for _, rid, p, params in REQUESTS}
        return batched, alone, forward_logits(engine).cpu()
    finally:
        engine.close()


def test_tp1_invariant_reduction_graphs_equal_eager(model_dir):
    """One GPU: the chunk-tree o_proj/down_proj inside CUDA graphs give the eager bits, alone == batched."""
    graphs = _results(model_dir, 1, tp_invariant_reduction=True)
    eager = _results(model_dir, 1, tp_invariant_reduction=True, enforce_eager=True)
    assert graphs[0] == graphs[1] == eager[0] == eager[1]
    assert torch.equal(graphs[2], eager[2])


def test_tp2_and_tp4_give_tp1_bits_with_invariant_reduction(model_dir, two_gpus):
    b1, a1, l1 = _results(model_dir, 1, tp_invariant_reduction=True)
    assert b1 == a1
    for tp in [2] + ([4] if GPUS >= 4 else []):
        b, a, logits = _results(model_dir, tp, tp_invariant_reduction=True)
        assert b == a, f"TP={tp}: alone != batched"
        assert b == b1, f"TP={tp} differs from TP=1"
        assert torch.equal(logits, l1)


def test_tp2_default_reduction_is_batch_invariant(model_dir, two_gpus):
    rng = random.Random(3)
    reqs = [(i // 3, f"r{i}", prompt(rng, 5 + 11 * i), greedy(6) if i % 2 else sampled(6, seed=i)) for i in range(6)]
    engine = engine_at(model_dir, 2, device="cuda", max_num_batched_tokens=32, max_num_seqs=8)
    try:
        batched = run(engine, reqs)
        alone = {rid: run(engine, [(0, rid, p, params)])[rid] for _, rid, p, params in reqs}
        assert batched == alone
    finally:
        engine.close()


def test_tp2_fast_mode_runs(model_dir, two_gpus):
    engine = engine_at(model_dir, 2, device="cuda", mode="fast")
    try:
        out = run(engine, [(0, "x", [5, 6, 7, 8], greedy(4))])["x"]
        assert out.error is None and len(out.completions[0].token_ids) == 4
    finally:
        engine.close()


def test_tp2_graphs_equal_eager_and_overlap_off(model_dir, two_gpus):
    """CUDA graphs under TP (collectives captured, every rank replaying the same shape; pending ids broadcast
    from rank 0) give the eager steps' bits, with overlapped scheduling on and off; decode and mixed steps
    both replay graphs. Plain greedy requests (their steps finish as argmax ids: each rank's best, picked)
    get the tokens the same requests get with logprobs (full logits, the sampler), in every variant."""
    from test_tensor_parallel import PLAIN
    from test_tensor_parallel_graphs import MORE

    reqs = REQUESTS + MORE
    results, replays = {}, {}
    variants = (("graphs", {}), ("eager", dict(enforce_eager=True)), ("graphs_sync", dict(async_scheduling=False)))
    for name, kw in variants:
        engine = engine_at(model_dir, 2, device="cuda", max_num_batched_tokens=64, max_num_seqs=8,
                           tp_invariant_reduction=True, **kw)
        try:
            local, kinds = engine.runner.local, []
            assert (local.graphs is not None) == (name != "eager")
            orig = local._run_graph

            def counted(layout, *args, _orig=orig, _kinds=kinds, **kwargs):
                _kinds.append("decode" if layout.all_single_token else "mixed")
                return _orig(layout, *args, **kwargs)

            local._run_graph = counted
            results[name] = (run(engine, reqs), forward_logits(engine).cpu(), run(engine, PLAIN),
                             run(engine, [(t, rid, p, greedy(5)) for t, rid, p, _ in PLAIN]),
                             forward_logits(engine, argmax_only=True).cpu())
            replays[name] = set(kinds)
        finally:
            engine.close()
    assert replays["graphs"] == {"decode", "mixed"}, replays
    assert results["graphs"][0] == results["eager"][0] == results["graphs_sync"][0]
    assert torch.equal(results["graphs"][1], results["eager"][1])
    assert all(sig.error is None for sig in results["graphs"][0].values())
    for name, (_, logits, plain, with_logprobs, ids) in results.items():
        assert torch.equal(ids, torch.argmax(logits, dim=-1)), name
        assert plain == results["eager"][2], name
        assert {r: s.completions[0].token_ids for r, s in plain.items()} == \
            {r: s.completions[0].token_ids for r, s in with_logprobs.items()}, name


def _sum_worker(rank, port, cases, queue):
    from detinfer.distributed.group import connect
    from detinfer.kernels.chunked_linear import pairwise_tree_sum

    dev = torch.device("cuda", rank)
    group = connect(rank, 2, port, dev)
    out = []
    for parts in cases:
        mine = parts[rank].to(dev)
        tree = pairwise_tree_sum(group.all_gather(mine.clone()))
        eager = group.exact_sum(mine.clone())
        static = mine.clone()
        torch.cuda.synchronize(dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            captured = group.exact_sum(static)
        static.copy_(mine)
        graph.replay()
        torch.cuda.synchronize(dev)
        # Compared here; only plain values cross the queue (a tensor would be passed as a file descriptor
        # that the parent fetches from this process's resource sharer, which is gone once it exits).
        # Bit patterns, not values: inf + -inf partials give NaN, and NaN == NaN is False.
        tree, eager, captured = (t.view(torch.int32) for t in (tree, eager, captured))
        out.append((torch.equal(eager, tree), torch.equal(captured, tree),
                    hashlib.sha256(tree.cpu().numpy()).hexdigest()))
    queue.put((rank, out))
    # Flush the queue's feeder thread, then leave without running NCCL's teardown at interpreter exit.
    queue.close()
    queue.join_thread()
    os._exit(0)


def test_exact_sum_nccl_is_gather_and_tree_in_and_out_of_graphs(two_gpus):
    """TP=2 on NCCL: exact_sum (one fp32 all-reduce) == all-gather + tree, bit for bit, eagerly and inside a
    CUDA graph, from 1 element to 1 MiB (NCCL switches protocol / algorithm with the size), with -0.0,
    infinities and subnormals in the partials."""
    from detinfer.distributed.group import free_port

    gen = torch.Generator().manual_seed(0)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e-45, -1e-40, 3.4e38, -3.4e38])
    cases = []
    for n in (1, 7, 2048, 16384, 65536, 262144):
        parts = [torch.randn(n, generator=gen) * torch.exp2(torch.randint(-130, 120, (n,), generator=gen).float())
                 for _ in range(2)]
        for p in parts:
            idx = torch.randint(0, n, (min(n, 64),), generator=gen)
            p[idx] = special[torch.randint(0, len(special), (len(idx),), generator=gen)]
        parts[1][: n // 4] = -parts[0][: n // 4]  # exact cancellations
        cases.append(parts)
    ctx = torch.multiprocessing.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_sum_worker, args=(r, port, cases, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for rank in (0, 1):
        for i, (eager_ok, captured_ok, _) in enumerate(got[rank]):
            assert eager_ok and captured_ok, f"rank {rank}, case {i}: eager {eager_ok}, in a graph {captured_ok}"
    assert [c[2] for c in got[0]] == [c[2] for c in got[1]], "the ranks' sums differ"


def test_tp2_peer_sum_on_and_off_give_the_same_bits(model_dir, peer_gpus, monkeypatch):
    """The row-parallel sums through the peer kernel (the default with two GPUs that reach each other's
    memory) and through NCCL + a cast (DETINFER_TP_PEER_SUM=0) give the same requests and logits, in CUDA
    graphs, with and without the chunk tree."""
    for invariant in (False, True):
        results = {}
        for flag in ("1", "0"):
            monkeypatch.setenv("DETINFER_TP_PEER_SUM", flag)  # read by every rank as it joins the group
            engine = engine_at(model_dir, 2, device="cuda", max_num_batched_tokens=64, max_num_seqs=8,
                               tp_invariant_reduction=invariant)
            try:
                assert (engine.runner.group.peer is not None) == (flag == "1")
                results[flag] = (run(engine, REQUESTS), forward_logits(engine).cpu())
            finally:
                engine.close()
        assert results["1"][0] == results["0"][0]
        assert torch.equal(results["1"][1].view(torch.int32), results["0"][1].view(torch.int32))


def test_tp2_killed_worker_is_an_error_not_a_hang_with_the_peer_sum(model_dir, two_gpus):
    """A worker killed between requests: rank 0's next step waits in a peer-sum kernel, the watcher's abort
    makes it trap, and the request ends with an error naming the worker (no hang)."""
    import signal
    import time

    engine = engine_at(model_dir, 2, device="cuda", max_num_batched_tokens=64, max_num_seqs=8)
    try:
        first = run(engine, [(0, "ok", [5, 6, 7, 8], greedy(3))])["ok"]
        assert first.error is None and len(first.completions[0].token_ids) == 3
        worker = engine.runner._procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=30)
        start = time.monotonic()
        dead = run(engine, [(0, "after", [5, 6, 7], greedy(3))])["after"]
        assert dead.error is not None and "worker rank 1 failed" in dead.error, dead.error
        assert time.monotonic() - start < 60
    finally:
        engine.close()
