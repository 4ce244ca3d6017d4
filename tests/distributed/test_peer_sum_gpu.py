"""The two-GPU peer sum (distributed/peer_sum.py, kernels/peer_sum.py) on real GPUs, asserted bitwise.

- `TPGroup.exact_sum_rounded` through the peer kernel == the unfused path (NCCL all-reduce, + bias, round)
  == all-gather + add, from 1 element to past the kernel's capacity (where it hands over to NCCL), with
  -0.0, infinities and subnormals; eagerly, captured in a CUDA graph, and over hundreds of calls while one
  rank lags the other by random amounts (the mailboxes' reuse two calls later).
- The sum fused with the norm through each transport (values and flags; tagged words the kernel sends; an
  fp32 partial the matmul pushed as it stored it): the bits of the rounded sum
  followed by the standalone norm; the transports interleaved while one rank lags.
- A peer that never joins a sum: the waiting kernel traps (abort from the host, or its timeout), so the
  caller gets an error instead of a hang.
Skipped (shown as skipped) without 2 GPUs that can access each other's memory.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

pytestmark = pytest.mark.gpu



def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _case(gen: torch.Generator, rows: int, cols: int, rank: int) -> torch.Tensor:
    scale = torch.exp2(torch.randint(-100, 100, (rows, cols), generator=gen).float())
    x = torch.randn(rows, cols, generator=gen) * scale
    flat = x.view(-1)
    flat[::13] = -0.0
    flat[5::97] = float("inf") if rank == 0 else 1.0
    flat[7::101] = 1e-42  # subnormal
    return x


def _sum_checks(rank: int, port: int, queue) -> None:
    from detinfer.distributed.group import connect
    from detinfer.kernels.peer_sum import CAPACITY

    dev = torch.device("cuda", rank)
    group = connect(rank, 2, port, dev)
    out = {"peer": group.peer is not None}
    gen = torch.Generator().manual_seed(1234)  # same draws on both ranks: each takes its own part
    # Past CAPACITY elements: row pieces, one launch each (the bits of one launch and of NCCL).
    shapes = [(1, 1), (1, 7), (3, 333), (1, 4096), (64, 4096), (CAPACITY // 4096, 4096), (CAPACITY // 4096 + 1, 4096),
              (2 * CAPACITY // 4096 + 3, 4096), (CAPACITY // 1000 + 1, 1000)]
    for rows, cols in shapes:
        parts = [_case(gen, rows, cols, r) for r in range(2)]
        bias = (torch.randn(cols, generator=gen) * 4).to(torch.bfloat16).to(dev)
        mine = parts[rank].to(dev)
        for b in (None, bias):
            fused = group.exact_sum_rounded(mine.clone()[None], b, torch.bfloat16)
            unfused = group.exact_sum(mine.clone())
            unfused = (unfused if b is None else unfused + b.float()).to(torch.bfloat16)
            gathered = group.all_gather(mine.clone())
            ref = gathered[0] + gathered[1]
            ref = (ref if b is None else ref + b.float()).to(torch.bfloat16)
            out[f"{rows}x{cols} bias={b is not None}"] = (torch.equal(_bits(fused), _bits(ref)),
                                                          torch.equal(_bits(unfused), _bits(ref)))
    # Captured: three sums of different sizes in one graph, replayed on new inputs.
    statics = [torch.zeros(r, 4096, device=dev) for r in (1, 5, 64)]
    for s in statics:  # warm-up (compiles) outside the capture
        group.exact_sum_rounded(s[None], None, torch.bfloat16)
    torch.cuda.synchronize(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        captured = [group.exact_sum_rounded(s[None], None, torch.bfloat16) for s in statics]
    ok = True
    for _ in range(3):
        for s in statics:
            s.copy_(_case(gen, s.shape[0], 4096, rank).to(dev))
        graph.replay()
        for s, c in zip(statics, captured):
            g = group.all_gather(s)
            ok &= torch.equal(_bits(c), _bits((g[0] + g[1]).to(torch.bfloat16)))
    out["graph"] = ok
    # Drift: rank 1 sleeps a random while before some calls; 300 calls of alternating sizes.
    lag = torch.Generator().manual_seed(7)
    results, inputs = [], []
    for i in range(300):
        x = torch.randn(1 + (i % 3) * 31, 4096, device=dev)
        if rank == 1 and torch.rand(1, generator=lag).item() < 0.3:
            torch.cuda._sleep(int(torch.randint(1000, 2_000_000, (1,), generator=lag)))
        inputs.append(x)
        results.append(group.exact_sum_rounded(x[None], None, torch.float32))
    drift_ok = True
    for x, r in zip(inputs, results):
        g = group.all_gather(x)
        drift_ok &= torch.equal(_bits(r), _bits(g[0] + g[1]))
    out["drift"] = drift_ok
    # --tp-invariant-reduction: 4 chunk partials per rank, added in the kernel == the tree over all 8 chunks.
    from detinfer.kernels.chunked_linear import pairwise_tree_sum
    for rows in (1, 64):
        parts = [torch.stack([_case(gen, rows, 4096, r) for _ in range(4)]) for r in range(2)]
        fused = group.exact_sum_rounded(parts[rank].to(dev), None, torch.bfloat16).cpu()
        full = pairwise_tree_sum(torch.cat(parts)).to(torch.bfloat16)  # rank 0's chunks, then rank 1's
        out[f"chunk tree {rows}"] = torch.equal(_bits(fused), _bits(full))
    # The sum fused with the RMSNorm after it == the rounded sum, then the standalone norm kernel: values and
    # flags (any size), tagged words the kernel sends itself, and partials the matmul pushed as it stored them.
    from detinfer.kernels.chunked_linear import linear_parts
    from detinfer.kernels.rmsnorm import rms_norm
    for rows, c in ((1, 1), (7, 4), (64, 1), (65, 1), (512, 1), (512, 4), (513, 1), (1100, 4)):  # > 512: pieces
        parts = [_case(gen, c * rows, 4096, r).view(c, rows, 4096) for r in range(2)]
        weight = (torch.rand(4096, generator=gen) + 0.5).to(torch.bfloat16).to(dev)
        residual = torch.randn(rows, 4096, generator=gen).to(torch.bfloat16).to(dev)
        mine = parts[rank].to(dev)
        y2, h2 = rms_norm(group.exact_sum_rounded(mine, None, torch.bfloat16), weight, 1e-6, residual=residual)
        for transport in ("flags",) + (("tagged",) if group.peer.can_push(rows, 4096) else ()):
            y, h = group.peer.sum_rms_norm(mine, None, torch.bfloat16, weight, 1e-6, residual, transport)
            out[f"sum + norm {rows}x{c} {transport}"] = torch.equal(_bits(y), _bits(y2)) and \
                torch.equal(_bits(h), _bits(h2))
    out["no push past the tagged channel"] = group.peer.push_for(64, 4096) is None
    for rows in (1, 7, 16):  # every row count the engine pushes (`PeerSum.can_push`)
        xs = [(torch.randn(rows, 2048, generator=gen) * 2).to(torch.bfloat16) for _ in range(2)]
        ws = [(torch.randn(4096, 2048, generator=gen) / 32).to(torch.bfloat16) for _ in range(2)]
        weight = (torch.rand(4096, generator=gen) + 0.5).to(torch.bfloat16).to(dev)
        residual = torch.randn(rows, 4096, generator=gen).to(torch.bfloat16).to(dev)
        x, w = xs[rank].to(dev), ws[rank].to(dev)
        plain = linear_parts(x, w, 1)
        y2, h2 = rms_norm(group.exact_sum_rounded(plain.clone(), None, torch.bfloat16), weight, 1e-6, residual=residual)
        pushed = linear_parts(x, w, 1, group.peer.push_for(rows, 4096))
        s, y, h = group.peer.sum_rms_norm(pushed, None, torch.bfloat16, weight, 1e-6, residual, "pushed",
                                          want_sum=True)
        out[f"pushed {rows}"] = (torch.equal(_bits(pushed), _bits(plain)), torch.equal(_bits(y), _bits(y2))
                                 and torch.equal(_bits(h), _bits(h2)))
    # Drift through every transport: pushed (1 and 16 rows), flags (40), tagged (3), while rank 1 lags.
    weight = (torch.rand(4096, generator=gen) + 0.5).to(torch.bfloat16).to(dev)
    w = (torch.randn(4096, 1024, device=dev) / 16).to(torch.bfloat16)
    results, inputs = [], []
    for i in range(300):
        rows, transport = ((1, "pushed"), (40, "flags"), (16, "pushed"), (3, "tagged"))[i % 4]
        x = torch.randn(rows, 1024, device=dev).to(torch.bfloat16)
        if rank == 1 and torch.rand(1, generator=lag).item() < 0.3:
            torch.cuda._sleep(int(torch.randint(1000, 2_000_000, (1,), generator=lag)))
        parts = linear_parts(x, w, 1, group.peer.push_for(rows, 4096) if transport == "pushed" else None)
        inputs.append(parts.clone())
        results.append(group.peer.sum_rms_norm(parts, None, torch.float32, weight, 1e-6, None, transport))
    drift_ok = True
    for p, r in zip(inputs, results):
        g = group.all_gather(p[0])
        drift_ok &= torch.equal(_bits(r), _bits(rms_norm(g[0] + g[1], weight, 1e-6)))
    out["drift, sum + norm"] = drift_ok
    # Fast mode's bf16 partials through the same kernel: one fp32 addition, one rounding.
    halves = [torch.randn(64, 4096, generator=gen).to(torch.bfloat16) for _ in range(2)]
    fast = group.fast_sum(halves[rank].to(dev)).cpu()
    out["fast bf16"] = torch.equal(_bits(fast), _bits((halves[0].float() + halves[1].float()).to(torch.bfloat16)))
    torch.cuda.synchronize(dev)
    _report(queue, (rank, out))
    os._exit(0)


def _spawn(target, extra=(), done_event=False):
    """Both ranks of `target(rank, port, queue[, done], *extra)`; `done_event`: also a shared event that
    rank 0 sets once it has reported (a rank that must stay alive until then waits on it, not on a clock),
    returned third: the caller holds it until the ranks are joined (a collected event's semaphore is gone
    before a spawned child can open it)."""
    from detinfer.distributed.group import free_port

    ctx = torch.multiprocessing.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    shared = (ctx.Event(),) if done_event else ()
    procs = [ctx.Process(target=target, args=(r, port, queue, *shared, *extra)) for r in range(2)]
    for p in procs:
        p.start()
    return (procs, queue, *shared)


def _join(procs, timeout_s=120):
    for p in procs:
        p.join(timeout_s)
        if p.is_alive():
            p.kill()


def test_peer_sum_equals_nccl_and_gather_in_and_out_of_graphs(peer_gpus):
    procs, queue = _spawn(_sum_checks)
    got = dict(queue.get(timeout=300) for _ in procs)
    _join(procs)
    for rank in (0, 1):
        out = got[rank]
        assert out.pop("peer"), f"rank {rank}: the peer sum was not set up"
        bad = {k: v for k, v in out.items() if v not in (True, (True, True))}
        assert not bad, f"rank {rank}: {bad}"


# The kernel's wait limit when the abort is what must end it: far past LONELY_BOUND_S, so an abort that did
# not work is caught by the bound, and far past any compile time, so a slow machine does not race it.
ABORT_CASE_TIMEOUT_S = 900.0
LONELY_BOUND_S = 300.0


def _lonely_sum(rank: int, port: int, queue, done, how: str, what: str) -> None:
    from detinfer.distributed.group import connect

    dev = torch.device("cuda", rank)
    group = connect(rank, 2, port, dev, timeout_s=3.0 if how == "timeout" else ABORT_CASE_TIMEOUT_S)
    if group.peer is None:  # the sum would go through NCCL, which has no timeout here: report, don't hang
        _report(queue, (rank, ("no peer sum", 0.0)))
        done.set()
        os._exit(0)
    if rank == 1:  # never joins the sum; stays alive (its memory mapped by rank 0) until rank 0 has reported
        _report(queue, (1, "idle"))
        done.wait(2 * LONELY_BOUND_S)
        os._exit(0)
    if how == "abort":
        threading.Timer(1.0, group.abort).start()
    start = time.monotonic()
    try:
        if what == "sum":
            group.exact_sum_rounded(torch.ones(1, 4096, device=dev), None, torch.bfloat16)
        else:  # a pushed matmul's sum + norm: the tagged-words wait
            from detinfer.kernels.chunked_linear import linear_parts
            x, w = torch.ones(1, 256, device=dev, dtype=torch.bfloat16), torch.ones(4096, 256, device=dev,
                                                                                   dtype=torch.bfloat16)
            parts = linear_parts(x, w, 1, group.peer.push_for(1, 4096))
            group.peer.sum_rms_norm(parts, None, torch.bfloat16, None, 1e-6, None, "pushed")
        torch.cuda.synchronize(dev)
        result = "returned"
    except RuntimeError as e:
        result = f"error: {e}"
    _report(queue, (0, (result, time.monotonic() - start)))
    done.set()
    os._exit(0)


def _report(queue, item) -> None:
    """Put `item` and wait until it is written: os._exit does not flush a queue's feeder thread."""
    queue.put(item)
    queue.close()
    queue.join_thread()


@pytest.mark.parametrize("how, what", [("abort", "sum"), ("timeout", "sum"), ("abort", "pushed sum + norm"),
                                       ("timeout", "pushed sum + norm")])
def test_a_sum_whose_peer_never_comes_fails_instead_of_hanging(peer_gpus, how, what):
    procs, queue, _done = _spawn(_lonely_sum, (how, what), done_event=True)
    got = dict(queue.get(timeout=2 * LONELY_BOUND_S) for _ in procs)
    _join(procs, 60)
    result, seconds = got[0]
    assert got[1] != ("no peer sum", 0.0), "the peer sum was not set up"

    assert result.startswith("error"), result
    # Abort: well before the kernel's own limit (ABORT_CASE_TIMEOUT_S); timeout: 3 s plus compiling.
    assert seconds < LONELY_BOUND_S, seconds
