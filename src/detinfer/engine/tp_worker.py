"""The loop of a tensor-parallel worker rank (a process the rank-0 engine spawned).

Rank 0 owns the scheduler, the block manager and the sampler (pure Python, one copy). Each step it sends
every worker the step's `StepLayout` (plain Python data) over a pipe; the worker runs the same
`ModelRunner.execute` on its shard, taking part in the same collectives in the same order, and discards
the logits (rank 0 samples). Workers never reply per step: a failure is reported by an ("error", traceback)
message followed by the worker's exit, which also closes its sockets, so rank 0's pending collective fails
instead of waiting (and rank 0's watcher aborts NCCL groups on a worker's exit).

CUDA graphs: the worker's runner captures the same shapes as rank 0's, in the same order (collectives
captured). A step message carries the graph shape rank 0 picked (None: eager), a pure function of the layout
and the shared config; the worker checks that it picks the same before running, so every rank replays the
matching graph (a mismatch is a bug, reported as an error, never a silent hang of mismatched collectives).
Pending token ids (overlapped scheduling) are in the layout as PENDING_TOKEN; when the message says so, the
step's ids come from rank 0 by a device broadcast before the forward.

Weights: with `WorkerSpec.weights` (a models.weight_sources value: a checkpoint path or a random preset's
seed, plus the dtype) the worker reads / draws only its own slices on its device; without it, rank 0 sends
them (an in-memory model it sharded).

Messages to a worker: ("state", {name: cpu tensor}) (only without `weights`), ("step", layout, shape key,
ids_follow, padded), ("load_weights", buckets) (new weights: this rank's shards follow by
scatter, distributed/weight_push.py), ("stop",).
Messages from a worker: ("hello",), ("loaded", resident weight bytes) (its shard is built: the runner's
start-up collectives follow), ("ready", num_kv_blocks), ("error", text).
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from detinfer.cache.layout import StepLayout
from detinfer.engine.config import EngineConfig
from detinfer.models.config import ModelConfig


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    size: int
    port: int
    device: str
    model_config: ModelConfig
    engine_config: EngineConfig  # rank 0's: the same graphs, shapes and KV pool on every rank
    mode: str
    dtype: torch.dtype
    attention: str
    cpu_triton: bool
    num_kv_blocks: int | None
    timeout_s: float
    num_threads: int | None
    weights: Any = None  # a models.weight_sources value; None: rank 0 sends the shard ("state")


@dataclass(frozen=True)
class LayoutBatch:
    """What `ModelRunner.execute` reads of a `ScheduledBatch`: the layout."""

    layout: StepLayout
    is_empty: bool = False


def step_message(runner, layout: StepLayout, ids_follow: bool, padded: bool = False,
                 argmax_only: bool = False) -> tuple:
    """Rank 0's per-step message: the layout, the graph shape it replays (its key; None: eager), whether
    the step's token ids follow by broadcast (`ids_follow`: some are pending on rank 0's device), `padded`
    (test hook: run it as `ModelRunner.run_padded_eager`), and `argmax_only` (the logits are finished as
    argmax ids, not gathered: every rank must take part in the same collective)."""
    return ("step", layout, _shape_key(runner, layout), ids_follow, padded, argmax_only)


def _shape_key(runner, layout: StepLayout):
    shape = runner.graph_shape(layout) if runner.use_graphs else None
    return None if shape is None else shape.key


def run_step(runner, group, layout: StepLayout, shape_key, ids_follow: bool, padded: bool = False,
             argmax_only: bool = False) -> None:
    """A worker's share of one step (its logits are discarded: rank 0 samples)."""
    mine = _shape_key(runner, layout)
    if mine != shape_key:
        raise RuntimeError(f"rank {group.rank} picked graph shape {mine} for a step rank 0 runs as {shape_key}: "
                           "the ranks' configs differ")
    ids = None
    if ids_follow:
        ids = group.broadcast(torch.empty(layout.num_tokens, dtype=torch.int64, device=runner.device))
    if padded:
        runner.run_padded_eager(layout, input_ids=ids)
    else:
        runner.execute(LayoutBatch(layout), input_ids=ids, argmax_only=argmax_only)


def worker_main(spec: WorkerSpec, conn) -> None:
    """Entry point of worker rank `spec.rank` (multiprocessing spawn target)."""
    try:
        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        from detinfer.distributed.group import connect
        from detinfer.distributed.layers import build_local_model, local_config, weight_bytes
        from detinfer.engine.model_runner import ModelRunner
        from detinfer.ops import Ops

        conn.send(("hello",))
        device = torch.device(spec.device)
        group = connect(spec.rank, spec.size, spec.port, device, timeout_s=spec.timeout_s)
        cfg = spec.model_config
        if spec.weights is not None:
            state = spec.weights.state(cfg, spec.rank, spec.size, device)
        else:
            kind, state = conn.recv()
            if kind != "state":
                raise RuntimeError(f"expected the weights first, got {kind!r}")
        ops = Ops(spec.mode, device, spec.dtype, head_dim=cfg.head_dim, attention=spec.attention,
                  cpu_triton=spec.cpu_triton)
        model = build_local_model(cfg, spec.size, ops, group, state, device,
                                  spec.engine_config.tp_invariant_reduction)
        del state
        conn.send(("loaded", weight_bytes(model)))  # rank 0 waits for this before the runner's collectives
        runner = ModelRunner(model, local_config(cfg, spec.size), spec.engine_config, spec.num_kv_blocks,
                             tp_group=group)
        conn.send(("ready", runner.num_kv_blocks))
        _serve(conn, runner, group)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        sys.exit(0)  # rank 0 went away: nothing to report to
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:  # noqa: BLE001 - rank 0 may be gone already
            pass
        sys.exit(1)


def _serve(conn, runner, group) -> None:
    while True:
        msg = conn.recv()
        if msg[0] == "step":
            run_step(runner, group, *msg[1:])
        elif msg[0] == "load_weights":  # new full weights: this rank's shards arrive by scatter
            from detinfer.distributed.weight_push import receive_weights

            receive_weights(group, runner.model, msg[1])
        elif msg[0] == "kv_cache":  # "release" or "restore" this rank's KV pool; rank 0 waits for the reply
            getattr(runner, f"{msg[1]}_kv_cache")()
            conn.send(("kv_cache_done",))
        elif msg[0] == "stop":
            return
        else:
            raise RuntimeError(f"unknown message {msg[0]!r}")
