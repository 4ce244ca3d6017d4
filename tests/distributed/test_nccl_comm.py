"""The direct NCCL communicator (distributed/nccl_comm.py).

CPU: without a CUDA build of torch the library is missing and the error says so (no crash at import).
GPU (2 GPUs): fp32 all-reduce == all-gather + one addition bitwise (P=2: one IEEE addition, so NCCL's
algorithm cannot matter), eagerly and captured in a CUDA graph, over sizes that make NCCL switch
algorithm and protocol; all-gather and broadcast are exact data moves.
"""

import datetime
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from detinfer.distributed import nccl_comm

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_missing_library_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(nccl_comm, "_candidate_paths", lambda: ["libnccl-that-does-not-exist.so"])
    with pytest.raises(RuntimeError, match="NCCL library not found"):
        nccl_comm.load_library()


def _rank(rank: int, port: int, sizes: list[int], errors) -> None:
    import torch.distributed as dist
    try:
        torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
        comm = nccl_comm.NcclComm(rank, 2, torch.device("cuda", rank), store)
        for n in sizes:
            g = torch.Generator("cuda").manual_seed(100 * n + rank)
            x = torch.randn(n, device="cuda", generator=g) * torch.logspace(-30, 30, n, device="cuda")
            x[::7] = -0.0
            gathered = comm.all_gather(x)
            expect = gathered[0] + gathered[1]
            eager = comm.all_reduce_sum(x.clone())
            buf = x.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                comm.all_reduce_sum(buf)  # warm-up outside the capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                buf.copy_(x)
                comm.all_reduce_sum(buf)
            graph.replay()
            root = x.clone()
            comm.broadcast(root, root=1)
            torch.cuda.synchronize()
            assert torch.equal(gathered[rank], x)
            assert torch.equal(eager, expect), f"eager all-reduce != gather+add at {n} floats"
            assert torch.equal(buf, expect), f"graph all-reduce != gather+add at {n} floats"
            assert torch.equal(root, gathered[1])
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
    os._exit(0)


@pytest.mark.gpu
def test_fp32_all_reduce_equals_gather_then_add_on_two_gpus():
    if GPUS < 2:
        pytest.skip(f"needs 2 GPUs, {GPUS} visible")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sizes = [1, 7, 333, 2048, 16384, 262144, 1 << 20]
    procs = [ctx.Process(target=_rank, args=(r, port, sizes, errors)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
        if p.is_alive():
            p.kill()
    found = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert not found, found
    assert [p.exitcode for p in procs] == [0, 0]
