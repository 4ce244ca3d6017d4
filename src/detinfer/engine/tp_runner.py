"""Rank 0 of tensor parallelism: spawns the workers, hands out their weight shards, runs its own shard.

`TensorParallelRunner` stands where `ModelRunner` stands in the engine (same `execute(batch)` -> logits,
`num_kv_blocks`, `ops`, `device`, `dtype`): each step it sends the batch's layout to every worker, then runs
its local `ModelRunner` on its shard; the collectives inside the forward keep the ranks in step, and the
vocab-parallel logits come back full width on rank 0.

Start-up: given a weight source (models/weight_sources.py: a checkpoint directory or a random preset), rank 0
sends every worker only that small description in its `WorkerSpec`, and every rank, rank 0 included, reads
or draws only its own slices on its own device (`shard_spec`), all at the same time: no process holds the
full weights. Given an in-memory model (`LLMEngine.from_model`), rank 0 has it whole already: it keeps
shard 0 and sends each worker its shard as CPU tensors (shared memory). Every rank reports its resident
weight bytes (`weight_bytes`, in rank order). All ranks agree on the KV pool size (the smallest any rank
could allocate) before allocating it.

CUDA graphs: every rank's `ModelRunner` captures the same shapes in the same order, collectives included.
The shape a step replays is a pure function of its layout and the (shared) engine config; rank 0 sends its
choice with the layout and each worker checks that it picked the same, so all ranks replay matching graphs.
Overlapped scheduling: token ids sampled by the previous step stay on rank 0's device; they reach the
workers by a device broadcast inside the step (an exact data move), so rank 0 never waits for them.

Failures: any error in a step, or a worker's exit, is fatal for the group (collectives half done cannot be
resumed): the workers are stopped, and this and every later `execute` raises a RuntimeError naming the
failed rank (with its traceback when it sent one). Nothing waits forever: start-up waits check the workers'
liveness, a dead worker's closed sockets fail gloo collectives at once, the watcher thread aborts an NCCL
group when a worker exits, and every collective has a timeout (group.DEFAULT_TIMEOUT_S).
"""

from __future__ import annotations

import multiprocessing.connection as mpc
import threading
import time
import weakref

import torch
import torch.multiprocessing as mp

from detinfer.distributed.group import DEFAULT_TIMEOUT_S, connect, master_store
from detinfer.distributed.layers import (
    build_local_model,
    check_tp_config,
    local_config,
    shard_state,
    use_chunk_tree,
    weight_bytes,
)
from detinfer.engine.config import EngineConfig
from detinfer.engine.model_runner import ModelRunner
from detinfer.engine.tp_worker import WorkerSpec, step_message, worker_main
from detinfer.models.config import ModelConfig
from detinfer.models.transformer import Transformer
from detinfer.models.weight_sources import build_full_model
from detinfer.ops import Ops

STARTUP_TIMEOUT_S = 600.0  # spawning, importing torch and building a big shard can take minutes


def make_runner(model: Transformer | None, model_config: ModelConfig, config: EngineConfig,
                num_kv_blocks: int | None = None, *, weights=None, ops: Ops | None = None):
    """The engine's runner for `config.tensor_parallel_size` (and `tp_invariant_reduction` at TP=1). `model`:
    the full in-memory model, or None with `weights` (a models.weight_sources value) and rank 0's `ops`: then
    each rank loads only its own shard (TP=1: the whole model, from the same source)."""
    size = config.tensor_parallel_size
    check_tp_config(model_config, size, config.tp_invariant_reduction)
    if model is None and (weights is None or ops is None):
        raise ValueError("make_runner needs a model, or weights and ops")
    if size == 1:
        model = build_full_model(weights, model_config, ops) if model is None else model
        if config.tp_invariant_reduction:
            use_chunk_tree(model, model_config)
        return ModelRunner(model, model_config, config, num_kv_blocks)
    return TensorParallelRunner(model, model_config, config, num_kv_blocks, weights=weights, ops=ops)


# Imported once by the fork server; each worker is forked from it (no re-import of torch per worker and per
# engine). The server is a fresh single-threaded process that never touches CUDA, so forking it is safe
# (unlike forking the engine's own process).
_WORKER_PRELOAD = ["detinfer.engine.tp_worker", "detinfer.distributed.layers", "detinfer.engine.model_runner"]


def _process_context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_WORKER_PRELOAD)
    return ctx


def rank_devices(device: torch.device, size: int) -> list[torch.device]:
    """Rank r's device: CPU for all, or the r-th CUDA device from the engine's."""
    if device.type != "cuda":
        return [device] * size
    base = device.index if device.index is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if base + size > count:
        raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs from cuda:{base}, but only {count} "
                         "are visible (CUDA_VISIBLE_DEVICES)")
    return [torch.device("cuda", base + r) for r in range(size)]


class TensorParallelRunner:
    """See the module docstring."""

    def __init__(self, model: Transformer | None, model_config: ModelConfig, config: EngineConfig,
                 num_kv_blocks: int | None = None, *, weights=None, ops: Ops | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        size = config.tensor_parallel_size
        if model is not None:  # in memory: rank 0 shards it (weights and ops are the model's)
            weights, ops, device = None, model.ops, model.embed_tokens.device
        else:
            device = torch.device(ops.device)
        devices = rank_devices(device, size)
        self.config, self.size, self.model_config = config, size, model_config
        self._procs, self._conns, self._failure, self._closing = [], [], None, False
        store = master_store(size, timeout_s=timeout_s)
        port = store.port
        ctx = _process_context()
        threads = max(1, torch.get_num_threads() // size) if device.type == "cpu" else None
        try:
            for r in range(1, size):
                parent, child = ctx.Pipe()
                spec = WorkerSpec(r, size, port, str(devices[r]), model_config, config, ops.mode, ops.dtype,
                                  ops.attention, ops.cpu_triton, num_kv_blocks, timeout_s, threads, weights)
                proc = ctx.Process(target=worker_main, args=(spec, child), name=f"detinfer-tp-rank{r}")
                proc.start()
                child.close()
                self._procs.append(proc)
                self._conns.append(parent)
            self._finalizer = weakref.finalize(self, _stop_workers, self._procs, self._conns)
            self._expect("hello")
            self.group = connect(0, size, port, device, timeout_s=timeout_s, store=store)
            # From here a worker's exit aborts the group (NCCL would wait for it until the timeout). A weak
            # reference: a dropped engine must still be collected (and its workers stopped).
            self._watcher = threading.Thread(target=_watch, args=([p.sentinel for p in self._procs],
                                                                  weakref.ref(self)),
                                             name="detinfer-tp-watcher", daemon=True)
            self._watcher.start()
            if weights is None:
                for r, conn in enumerate(self._conns, 1):
                    conn.send(("state", shard_state(model, model_config, r, size, device="cpu")))
                state = shard_state(model, model_config, 0, size)
            else:  # the workers are loading theirs meanwhile
                state = weights.state(model_config, 0, size, device)
            local = build_local_model(model_config, size, ops, self.group, state, device,
                                      config.tp_invariant_reduction)
            del state
            # Every shard is built before the runners' start-up collectives (KV pool agreement, profiling,
            # graph capture): a worker that fails to load is reported as such, not as a broken collective.
            loaded = self._expect("loaded")
            self.weight_bytes = (weight_bytes(local),) + tuple(msg[1] for msg in loaded)
            self.local = self._start_local_runner(local, model_config, config, num_kv_blocks)
            blocks = [self.local.num_kv_blocks] + [msg[1] for msg in self._expect("ready")]
            if len(set(blocks)) > 1:  # agreed inside ModelRunner (group.agree_min): a bug if not
                raise RuntimeError(f"tensor-parallel ranks built KV pools of different sizes: {blocks} blocks")
        except BaseException:
            self.close()
            raise

    def _start_local_runner(self, local, model_config: ModelConfig, config: EngineConfig, num_kv_blocks):
        """Rank 0's ModelRunner; a worker's failure during the collectives it runs is reported as that."""
        try:
            return ModelRunner(local, local_config(model_config, self.size), config, num_kv_blocks,
                               tp_group=self.group)
        except Exception as e:
            failure = self._worker_failure(wait_s=2.0)
            if failure is None:
                raise
            raise RuntimeError(failure) from e


    # -- what the engine reads ------------------------------------------------------------------------
    @property
    def ops(self):
        return self.local.ops

    @property
    def model(self):
        return self.local.model

    def __getattr__(self, name):  # device, dtype, num_kv_blocks, block_size, ...: the local runner's
        if name == "local":
            raise AttributeError(name)
        return getattr(self.local, name)

    # -- steps -----------------------------------------------------------------------------------------
    def execute(self, batch, input_ids: torch.Tensor | None = None, argmax_only: bool = False) -> torch.Tensor:
        return self._step(batch.layout, input_ids, False,
                          lambda ids: self.local.execute(batch, input_ids=ids, argmax_only=argmax_only), argmax_only)

    def run_padded_eager(self, layout, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Test hook: `ModelRunner.run_padded_eager` on every rank (the step padded as its graph pads it)."""
        return self._step(layout, input_ids, True, lambda ids: self.local.run_padded_eager(layout, ids))

    def _step(self, layout, input_ids: torch.Tensor | None, padded: bool, run_local,
              argmax_only: bool = False) -> torch.Tensor:
        if self._failure is None:
            self._failure = self._worker_failure()
        if self._failure is not None:
            raise RuntimeError(self._failure)
        try:
            msg = step_message(self.local, layout, input_ids is not None, padded, argmax_only)
            for conn in self._conns:
                conn.send(msg)
            if input_ids is not None:
                # Overlapped scheduling: some ids (the previous step's samples) are on rank 0's device only.
                # The workers receive them by this broadcast (ordered on the stream: no host sync).
                input_ids = self.group.broadcast(input_ids.contiguous())
            return run_local(input_ids)
        except Exception as e:
            self._fail(self._worker_failure(wait_s=2.0) or
                       f"tensor-parallel step failed on rank 0 ({type(e).__name__}: {e})")
            raise RuntimeError(self._failure) from e
        except BaseException:  # interrupted mid-step: the ranks' collectives are out of step from here on
            self._fail("a tensor-parallel step was interrupted")
            raise

    # -- the KV pools' memory (config.releasable_kv_cache) -----------------------------------------------
    def release_kv_cache(self) -> None:
        self._kv_cache_on_every_rank("release")

    def restore_kv_cache(self) -> None:
        self._kv_cache_on_every_rank("restore")

    def _kv_cache_on_every_rank(self, what: str) -> None:
        if self._failure is not None:
            raise RuntimeError(self._failure)
        getattr(self.local, f"{what}_kv_cache")()  # rank 0 first: a pool that is not releasable raises here
        try:
            for conn in self._conns:
                conn.send(("kv_cache", what))
            self._expect("kv_cache_done")
        except Exception as e:
            self._fail(self._worker_failure(wait_s=2.0) or f"{what} of the KV cache failed ({e})")
            raise RuntimeError(self._failure) from e

    # -- weight updates --------------------------------------------------------------------------------
    def load_full_weights(self, state, bucket_bytes: int | None = None) -> int:
        """Copy full (TP=1-shaped) weights `{name: tensor}` into every rank's shard, in place, in buckets
        scattered over the TP group (distributed/weight_push.py); returns the tensors loaded. Validated first
        (nothing changes on a bad name or shape); a failure during the transfer stops the group like a failed
        step. The caller drops the prefix cache (its blocks hold the old weights' K/V)."""
        from detinfer.distributed.weight_push import (
            DEFAULT_BUCKET_BYTES,
            check_full_state,
            full_shapes,
            plan_buckets,
            send_weights,
        )

        if self.model_config.quantization is not None:  # a 16-bit tensor copied into an fp8 one loses its scales
            raise ValueError(f"loading weights into a running {self.model_config.quantization} engine is not "
                             "supported; start a new engine on the checkpoint")
        check_full_state(state, full_shapes(self.model_config, self.local.ops))
        buckets = plan_buckets(self.local.model, state, bucket_bytes or DEFAULT_BUCKET_BYTES)
        if self._failure is None:
            self._failure = self._worker_failure()
        if self._failure is not None:
            raise RuntimeError(self._failure)
        try:
            for conn in self._conns:
                conn.send(("load_weights", buckets))
            send_weights(self.group, self.local.model, self.model_config, buckets, state)
        except Exception as e:
            self._fail(self._worker_failure(wait_s=2.0) or
                       f"tensor-parallel weight load failed on rank 0 ({type(e).__name__}: {e})")
            raise RuntimeError(self._failure) from e
        except BaseException:
            self._fail("a tensor-parallel weight load was interrupted")
            raise
        return len(state)

    def _fail(self, message: str) -> None:
        self._failure = (f"{message}; the tensor-parallel group (size {self.size}) is stopped: build a new "
                         "engine to continue")
        self.close()

    def _worker_failure(self, wait_s: float = 0.0) -> str | None:
        """A message naming a worker that failed (its traceback if it sent one), else None."""
        deadline = time.monotonic() + wait_s
        while True:
            for r, (proc, conn) in enumerate(zip(self._procs, self._conns), 1):
                text = self._error_from(conn)
                if text is not None or not proc.is_alive():
                    proc.join(timeout=1.0)
                    detail = f":\n{text}" if text else ""
                    return f"tensor-parallel worker rank {r} failed (exit code {proc.exitcode}){detail}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    @staticmethod
    def _error_from(conn) -> str | None:
        try:
            while conn.poll():
                msg = conn.recv()
                if msg[0] == "error":
                    return msg[1]
        except (EOFError, OSError):
            return None
        return None

    def _expect(self, kind: str) -> list:
        """One `kind` message from every worker, failing fast (with its traceback) if one dies first."""
        got, deadline = {}, time.monotonic() + STARTUP_TIMEOUT_S
        while len(got) < len(self._conns):
            for r, (proc, conn) in enumerate(zip(self._procs, self._conns), 1):
                if r in got:
                    continue
                try:
                    msg = conn.recv() if conn.poll(0.05) else None
                except (EOFError, OSError):
                    msg = None
                if msg is not None and msg[0] == kind:
                    got[r] = msg
                elif (msg is not None and msg[0] == "error") or not proc.is_alive():
                    proc.join(timeout=1.0)
                    detail = f":\n{msg[1]}" if msg is not None else ""
                    raise RuntimeError(f"tensor-parallel worker rank {r} failed during start-up (exit code "
                                       f"{proc.exitcode}){detail}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers did not send {kind!r} within {STARTUP_TIMEOUT_S} s")
        return [got[r] for r in sorted(got)]

    def close(self) -> None:
        """Stop the workers (idempotent). The engine is unusable afterwards."""
        self._closing = True
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        else:
            _stop_workers(self._procs, self._conns)


def _watch(sentinels, runner_ref) -> None:
    """Abort the group when a worker exits unasked, so rank 0 cannot wait on it (NCCL would)."""
    mpc.wait(sentinels)
    runner = runner_ref()
    group = None if runner is None else runner.__dict__.get("group")
    if runner is not None and not runner._closing and group is not None and group.backend == "nccl":
        group.abort()


def _stop_workers(procs, conns, timeout_s: float = 2.0) -> None:
    for conn in conns:
        try:
            conn.send(("stop",))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=2.0)
    for conn in conns:
        conn.close()
