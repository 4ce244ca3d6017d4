"""Data-parallel trainer ranks of `detinfer rl` (`--trainer-ranks T`): one `GRPOTrainer` per process, the
trainer an FSDP2 shard (`detinfer.train.FSDPTrainer`: fixed-order gradient reduce-scatter), the sampler on
rank 0 only.

Rank 0 is the process that runs `detinfer rl`: it spawns ranks 1..T-1, joins them in torch.distributed's
default group (gloo on CPUs, NCCL on GPUs; rank r's trainer on the r-th GPU from the trainer's), samples,
scores the rewards and computes the advantages. The other ranks follow its commands, broadcast over the group
before every collective section, so every rank enters the same collectives in the same order:

  ("update", (step, rollout))   the step's update: every rank scores its block of each mini-batch (rank order =
                                sequence order, the order of the fixed gradient sum), FSDP reduces the
                                gradients, every rank steps its shard of AdamW; the full weights are gathered
                                bucket by bucket and rank 0 pushes them into the sampler; then the weights'
                                fingerprint over the gathered tensors.
  ("checkpoint", None)          gather the full weights and AdamW moments for rank 0 to write.
  ("resume", directory)         restore this rank's shards of a checkpoint rank 0 validated.
  ("stop", None)                leave.

The sampler's logprobs keep the trainer's bits: each rank's forward runs on the all-gathered weights (a data
move), which are the pushed weights. A follower that fails exits; rank 0's next collective then fails (gloo
notices the closed sockets; NCCL after the group's timeout), and the run stops with that error.
"""

from __future__ import annotations

import contextlib
import datetime
import signal
import traceback

import torch
import torch.distributed as dist

from detinfer.distributed.group import DEFAULT_TIMEOUT_S, NCCL_ENV_DEFAULTS, backend_for, master_store


def trainer_device(device: torch.device, rank: int) -> torch.device:
    """Trainer rank `rank`'s device: the same CPU, or the rank-th GPU from rank 0's."""
    if device.type != "cuda":
        return device
    base = device.index if device.index is not None else torch.cuda.current_device()
    return torch.device("cuda", base + rank)


class Followers:
    """Rank 0's handle on ranks 1..T-1 and the default process group they share."""

    def __init__(self, trainer_class, model, config, arm: str, device: torch.device, max_model_len: int,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        import torch.multiprocessing as mp

        if dist.is_initialized():
            raise RuntimeError("trainer_ranks > 1 (--trainer-ranks) sets up torch.distributed's default process "
                               "group, but this process has one already")
        size = config.trainer_ranks
        if device.type == "cuda" and trainer_device(device, size - 1).index >= torch.cuda.device_count():
            raise ValueError(f"trainer_ranks={size} (--trainer-ranks) needs {size} GPUs from {device}, but only "
                             f"{torch.cuda.device_count()} are visible")
        store = master_store(size, timeout_s=timeout_s)
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=follower_main, name=f"detinfer-rl-trainer{r}",
                                  args=(trainer_class, r, size, store.port, str(model), config, arm,
                                        str(trainer_device(device, r)), max_model_len, timeout_s))
                      for r in range(1, size)]
        for proc in self.procs:
            proc.start()
        try:
            _join_group(0, size, store, device, timeout_s)
        except BaseException:
            self._stop_processes(wait_s=0.0)
            raise
        self._store = store
        self.broken = False  # set when a collective section failed (see close)

    def send(self, command: str, payload=None) -> None:
        dist.broadcast_object_list([command, payload], src=0)

    @contextlib.contextmanager
    def guard(self):
        """A collective section: an error there caused by a trainer rank's exit is raised naming that rank."""
        try:
            yield
        except BaseException as e:  # the ranks' collectives are out of step from here on: no "stop" command
            self.broken = True
            if not isinstance(e, Exception):
                raise
            for rank, proc in enumerate(self.procs, 1):
                proc.join(timeout=2.0)
                if not proc.is_alive():
                    raise RuntimeError(f"trainer rank {rank} of {len(self.procs) + 1} failed (exit code "
                                       f"{proc.exitcode}; its traceback, if any, is on stderr): the run stops "
                                       f"({type(e).__name__}: {str(e)[:200]})") from e
            raise

    def close(self) -> None:
        """Stop the other ranks: by command, or, after a failure that left collectives half done (`broken`),
        by ending their processes (a command could wait on a collective they never finish)."""
        if self.broken:
            self._stop_processes(wait_s=0.0)
        if dist.is_initialized():
            if not self.broken:
                try:
                    self.send("stop")
                except Exception:  # noqa: BLE001 - a follower already gone: stop the processes below
                    pass
            dist.destroy_process_group()
        self._stop_processes()

    def _stop_processes(self, wait_s: float = 30.0) -> None:
        for proc in self.procs:
            proc.join(timeout=wait_s)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


def _join_group(rank: int, size: int, store, device: torch.device, timeout_s: float) -> None:
    backend = backend_for(device)
    if backend == "nccl":
        for key, value in NCCL_ENV_DEFAULTS.items():
            import os

            os.environ.setdefault(key, value)
        torch.cuda.set_device(trainer_device(device, 0))  # "cuda" without an index: the current GPU
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def follower_main(trainer_class, rank: int, size: int, port: int, model: str, config, arm: str, device: str,
                  max_model_len: int, timeout_s: float) -> None:
    """Trainer rank `rank` (> 0): build the same trainer as rank 0 (`trainer_class`: GRPOTrainer, passed in so
    that this module does not import grpo.py, which imports it), no sampler; then follow rank 0's commands."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle; it stops us
    try:
        store = dist.TCPStore("127.0.0.1", port, size, False, timeout=datetime.timedelta(seconds=timeout_s))
        _join_group(rank, size, store, torch.device(device), timeout_s)
        trainer = trainer_class(model, config, arm, device=device, max_model_len=max_model_len, _follower=True)
        while True:
            box = [None, None]
            dist.broadcast_object_list(box, src=0)
            command, payload = box
            if command == "update":
                trainer.step_index, rollout = payload
                trainer.update(rollout)
                trainer.refresh_fingerprint()
            elif command == "checkpoint":
                trainer.checkpoint_tensors()
            elif command == "resume":  # rank 0 validated the checkpoint; restore this rank's shards of it
                trainer.restore_shards(payload)
            elif command == "stop":
                break
            else:
                raise RuntimeError(f"unknown command {command!r}")
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        raise SystemExit(1) from None


def shareable(rollout):
    """What the other ranks need of a rollout (token ids, sampler logprobs, rewards, truncation): not the
    examples, texts and reward details, which may hold objects that do not pickle (a task's own data)."""
    import dataclasses

    return dataclasses.replace(rollout, examples=[], texts=[], scores=None)


# -- what every rank runs inside an update (grpo.py calls these when trainer_ranks > 1) --------------------
def rank_block(seqs: list, rank: int, size: int) -> list:
    """Rank `rank`'s contiguous block of a mini-batch: rank order is sequence order, the order in which the
    fixed-order reduce-scatter adds the ranks' gradients (config checks that `size` divides it)."""
    per = len(seqs) // size
    return list(seqs[rank * per:(rank + 1) * per])


def merged_across_ranks(part: dict) -> dict:
    """Every rank's {key: value} merged (all ranks get the union); tensors travel on the CPU."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in part.items()})
    out = {}
    for p in parts:  # rank order
        out.update(p)
    return out


def summed_across_ranks(values: dict, keys) -> dict:
    """`values` with `keys` summed over the ranks in rank order (the logged loss and token counts)."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {k: values[k] for k in keys})
    out = dict(values)
    for k in keys:
        total = parts[0][k]
        for p in parts[1:]:
            total = total + p[k]
        out[k] = total
    return out


def full(t):
    """A DTensor shard's full tensor (an all-gather: every rank must call it), or `t` itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def copy_full_into(p: torch.Tensor, full_tensor: torch.Tensor) -> None:
    """`p` <- the full tensor (a DTensor shard: its own slice of it, cut locally on every rank)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(p, DTensor):
        p.copy_(full_tensor)
        return
    mine = distribute_tensor(full_tensor.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
    p.to_local().copy_(mine.to_local())


def in_param_layout(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """An optimizer state tensor read whole, laid out like its parameter (a DTensor shard's own slice; a
    state of another shape, AdamW's step count, stays as it is)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(p, DTensor) or tuple(value.shape) != tuple(p.shape):
        return value
    return distribute_tensor(value.to(p.device), p.device_mesh, p.placements, src_data_rank=None)


PUSH_BUCKET_BYTES = 1 << 28  # full fp32 tensors gathered at a time for the push (bounds the memory it takes)


@torch.no_grad()
def push_gathered(named_parameters, sampler) -> None:
    """Gather the full weights bucket by bucket (every rank) and push each bucket into rank 0's sampler (None
    on the other ranks): `engine.admin.push_weights` casts them to the sampler's dtype as it copies (round to
    nearest even: the bits FSDP's mixed precision gives the trainer's forward)."""
    from detinfer.engine.admin import push_weights

    bucket, size = {}, 0
    for name, p in list(named_parameters) + [(None, None)]:
        if name is not None:
            bucket[name] = full(p).detach()
            size += bucket[name].numel() * bucket[name].element_size()
        if bucket and (name is None or size >= PUSH_BUCKET_BYTES):
            if sampler is not None:
                push_weights(sampler.engine, bucket)
            bucket, size = {}, 0


def gathered_checkpoint(named_parameters, optimizer) -> tuple[dict, dict]:
    """({name: full weight on the CPU}, {name::key: full AdamW state on the CPU}): collectives, every rank."""
    weights, state = {}, {}
    for name, p in named_parameters:
        weights[name] = full(p).detach().cpu().contiguous()
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                state[f"{name}::{key}"] = full(value).detach().cpu().contiguous()
            else:  # plain numbers (older torch kept `step` as a float)
                state[f"{name}::{key}"] = torch.tensor(value, dtype=torch.float64)
    return weights, state
