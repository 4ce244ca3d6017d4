"""The two-GPU peer sum's start-up agreement (distributed/peer_sum.connect_pair), on a CPU with the CUDA calls
replaced: both ranks must take the same path for every sum, or one waits in a kernel the other never runs.
So a failure on either rank (sharing the block, mapping the peer's) turns the peer sum off on BOTH ranks,
with a warning naming the cause, and nothing is left mapped; when both succeed both build it. The real
set-up runs in tests/distributed/test_peer_sum_gpu.py."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from detinfer.distributed import peer_sum


class _Store:
    """The group store's set / blocking get, between two threads."""

    def __init__(self):
        self._data, self._cond = {}, threading.Condition()

    def set(self, key, value):
        with self._cond:
            self._data[key] = value
            self._cond.notify_all()

    def get(self, key):
        with self._cond:
            assert self._cond.wait_for(lambda: key in self._data, timeout=30), f"no {key}"
            return self._data[key]


class _Min:
    """The group's agree_min over two threads."""

    def __init__(self):
        self._values, self._barrier = {}, threading.Barrier(2, timeout=30)

    def __call__(self, rank, value):
        self._values[rank] = value
        self._barrier.wait()
        return min(self._values.values())


def _both_ranks(monkeypatch, export_fails=(), open_fails=()):
    built, closed, results, caught = [], [], {}, {}
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: None)

    def export(block):
        if threading.current_thread().name in export_fails:
            raise RuntimeError("cuIpcGetMemHandle failed (CUresult 1)")
        return b"h" * 64, 8

    def open_peer(handle):
        if threading.current_thread().name in open_fails:
            raise RuntimeError("cuIpcOpenMemHandle failed (CUresult 201)")
        return 1 << 40

    monkeypatch.setattr(peer_sum, "_export", export)
    monkeypatch.setattr(peer_sum, "_open_peer_allocation", open_peer)
    monkeypatch.setattr(peer_sum, "_close_peer_allocation", closed.append)

    class Recorded(peer_sum.PeerSum):  # the block layout of the real one; no CUDA stream or pinned memory
        def __init__(self, *args):
            built.append(args)

    monkeypatch.setattr(peer_sum, "PeerSum", Recorded)
    # warnings.catch_warnings is process-wide, not per thread: record each thread's warnings instead.
    def record(message, *args, **kwargs):
        caught.setdefault(threading.current_thread().name, []).append(str(message))

    monkeypatch.setattr(peer_sum.warnings, "warn", record)
    store, agree = _Store(), _Min()
    caught.update({"0": [], "1": []})

    def run(rank):
        results[rank] = peer_sum.connect_pair(rank, torch.device("cpu"), store, 5.0, lambda v, r=rank: agree(r, v))

    threads = [threading.Thread(target=run, args=(r,), name=str(r)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results, caught, built, closed


def test_both_ranks_build_it_when_both_can():
    with pytest.MonkeyPatch.context() as mp:
        results, caught, built, closed = _both_ranks(mp)
    assert all(isinstance(results[r], peer_sum.PeerSum) for r in (0, 1)) and not caught["0"] and not caught["1"]
    assert sorted(args[0] for args in built) == [0, 1] and all(args[4] == (1 << 40) + 8 for args in built)
    assert not closed


@pytest.mark.parametrize("where", ["export", "open"])
@pytest.mark.parametrize("failing_rank", ["0", "1"])
def test_a_failure_on_either_rank_turns_it_off_on_both(where, failing_rank):
    kw = {"export_fails": (failing_rank,)} if where == "export" else {"open_fails": (failing_rank,)}
    with pytest.MonkeyPatch.context() as mp:
        results, caught, built, closed = _both_ranks(mp, **kw)
    assert results == {0: None, 1: None} and not built
    for rank in ("0", "1"):
        assert len(caught[rank]) == 1 and "peer sum is off" in caught[rank][0]
    cause = "cuIpcGetMemHandle" if where == "export" else "cuIpcOpenMemHandle"
    assert cause in caught[failing_rank][0]  # the failing rank names the cause
    # A rank that had mapped the peer's block unmaps it before falling back.
    assert closed == ([1 << 40] if where == "open" else [])
