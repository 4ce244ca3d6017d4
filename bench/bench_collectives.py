"""Cross-rank sums for tensor parallelism, per call inside a CUDA graph (2 GPUs): torch's ProcessGroupNCCL
vs detinfer's direct communicator (distributed/nccl_comm.py), fp32 all-reduce and all-gather + add, and
whether each result equals the gather-then-add bits (it must at 2 ranks: one IEEE addition). `peer`: the
row-parallel layer's whole sum + cast to bf16, through the peer kernel (distributed/peer_sum.py) against
the direct NCCL all-reduce followed by the cast, side by side in the same processes; then a decode step's
o_proj matmul and the fused sum + RMSNorm after it, through each transport (values and flags, the matmul's
pushed partial, tagged words the sum kernel sends).

    PYTHONPATH=src python bench/bench_collectives.py [--sizes-kb 8,64,256,1024] [--which ours,torch,peer]

Each rank prints its lines; a rank stuck for 60 s dumps its stack and exits (a hang is a finding too).
NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends are set if unset).
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)


def _graph_us(fn, iters: int = 10, reps: int = 50) -> float:
    """Per-call time of `fn` captured `iters` times in one graph, replayed `reps` times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (reps * iters) * 1e6


def _collectives(which: str, rank: int, size: int, store):
    if which == "torch":
        pg = dist.ProcessGroupNCCL(store, rank, size, dist.ProcessGroupNCCL.Options())

        def all_gather(t, out):
            pg.allgather([list(out.unbind(0))], [t]).wait()
        return (lambda t: pg.allreduce([t]).wait()), all_gather
    from detinfer.distributed.nccl_comm import NcclComm
    comm = NcclComm(rank, size, torch.device("cuda", rank), store)
    return comm.all_reduce_sum, (lambda t, out: out.copy_(comm.all_gather(t)))


def _rank(rank: int, size: int, port: int, which: str, sizes_kb: list[int]) -> None:
    faulthandler.dump_traceback_later(60, exit=True)
    torch.cuda.set_device(rank)
    if which == "peer":
        _peer_rank(rank, size, port, sizes_kb)
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=datetime.timedelta(seconds=30))
    all_reduce, all_gather = _collectives(which, rank, size, store)
    for kb in sizes_kb:
        n = kb * 1024 // 4
        x = torch.randn(n, device="cuda", generator=torch.Generator("cuda").manual_seed(7 + rank))
        out = x.new_empty((size, n))
        all_gather(x, out)
        ref = out.sum(0) if size > 2 else out[0] + out[1]
        buf, summed = x.clone(), torch.empty_like(x)

        def reduce_once(x=x, buf=buf):
            buf.copy_(x)
            all_reduce(buf)

        def gather_once(x=x, out=out, summed=summed):
            all_gather(x, out)
            torch.add(out[0], out[1], out=summed)
        us_ar, us_ag = _graph_us(reduce_once), _graph_us(gather_once)
        if rank == 0:
            print(f"{which:5s} {kb:6d} KB  all-reduce {us_ar:6.1f} us (== gather+add: {torch.equal(buf, ref)})  "
                  f"all-gather+add {us_ag:6.1f} us", flush=True)
    faulthandler.cancel_dump_traceback_later()
    os._exit(0)


def _peer_rank(rank: int, size: int, port: int, sizes_kb: list[int]) -> None:
    from detinfer.distributed.group import connect

    group = connect(rank, size, port, torch.device("cuda", rank))
    if group.peer is None:
        print(f"rank {rank}: no peer sum (no peer access, or DETINFER_TP_PEER_SUM=0)", flush=True)
        os._exit(0)
    for kb in sizes_kb:
        n = kb * 1024 // 4
        gen = torch.Generator("cuda").manual_seed(rank)
        x = torch.randn(n // 4096 or 1, min(n, 4096), device="cuda", generator=gen)  # [tokens, hidden]
        buf = x.clone()
        fused = lambda x=x: group.exact_sum_rounded(x[None], None, torch.bfloat16)  # noqa: E731
        unfused = lambda x=x, buf=buf: group.exact_sum(buf.copy_(x)).to(torch.bfloat16)  # noqa: E731
        us_peer, us_nccl = _graph_us(fused), _graph_us(unfused)
        same = torch.equal(fused().view(torch.int16), unfused().view(torch.int16))
        if rank == 0:
            print(f"peer  {kb:6d} KB  peer sum + cast {us_peer:6.1f} us   NCCL all-reduce + cast {us_nccl:6.1f} us   "
                  f"same bits: {same}", flush=True)
    # A decode step's o_proj (K 2048 per rank, N 4096) and the fused sum + residual + RMSNorm after it: the
    # matmul, then the sum kernel exchanging values and flags, against the matmul pushing its partial as it
    # stores it and the sum kernel only receiving (kernels/peer_push.py); and the sum + norm alone per transport.
    from detinfer.kernels.chunked_linear import linear_parts
    weight = torch.rand(4096, device="cuda").to(torch.bfloat16) + 0.5
    w = (torch.randn(4096, 2048, device="cuda") / 32).to(torch.bfloat16)
    for rows in (1, 2, 4, 8, 16, 32, 64):
        gen = torch.Generator("cuda").manual_seed(rank)
        a = torch.randn(rows, 2048, device="cuda", generator=gen).to(torch.bfloat16)
        res = torch.randn(rows, 4096, device="cuda", generator=gen).to(torch.bfloat16)
        push = group.peer.push_for(rows, 4096)
        line, outs = [], []
        for transport in ("flags", "pushed", "tagged"):
            def fn(a=a, r=res, t=transport, p=push):
                parts = linear_parts(a, w, 1, p if t == "pushed" else None)
                return group.peer.sum_rms_norm(parts, None, torch.bfloat16, weight, 1e-6, r, t)
            line.append(f"{transport} {_graph_us(fn):6.1f}")
            outs.append(fn()[0].view(torch.int16))
        parts = linear_parts(a, w, 1)
        alone = _graph_us(lambda p=parts, r=res: group.peer.sum_rms_norm(p, None, torch.bfloat16, weight, 1e-6, r))
        matmul = _graph_us(lambda a=a: linear_parts(a, w, 1))
        if rank == 0:
            print(f"o_proj + sum + norm, {rows:3d} rows (us per pair): {'  '.join(line)}  (matmul alone {matmul:5.1f}, "
                  f"flags sum + norm alone {alone:5.1f})   same bits: {all(torch.equal(o, outs[0]) for o in outs)}",
                  flush=True)
    faulthandler.cancel_dump_traceback_later()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-kb", default="8,64,256,1024")
    ap.add_argument("--which", default="ours,torch,peer")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes_kb.split(",")]
    ctx = mp.get_context("spawn")
    for which in args.which.split(","):
        with socket.socket() as so:
            so.bind(("127.0.0.1", 0))
            port = so.getsockname()[1]
        procs = [ctx.Process(target=_rank, args=(r, 2, port, which, sizes)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            if p.is_alive():
                p.kill()
        print(f"{which}: exit codes {[p.exitcode for p in procs]}", flush=True)


if __name__ == "__main__":
    main()
