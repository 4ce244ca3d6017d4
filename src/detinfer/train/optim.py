"""The optimizer the RL loop steps with, and what training costs in memory per parameter.

`adamw(params, ...)`: torch's AdamW with the implementation that allocates the least besides its state:
  * CUDA: `fused=True`, one kernel per group of tensors that reads param, grad and both moments and
    writes param and moments in place, no temporaries. Each element's update is its own arithmetic (no
    reduction across elements), so two identical runs give identical bits.
  * elsewhere: `foreach=False`, the single-tensor loop: temporaries of one parameter's size at a time,
    never the multi-tensor (`foreach`) path's copies of whole lists of tensors.
A run's implementation is part of its trajectory (fused and single-tensor AdamW may round differently),
so compare weights only between runs on the same kind of device.

Memory per parameter (`state_bytes_per_param`), 16-bit engine with fp32 master weights (the default):
the engine's weight (2 B) + fp32 master (4) + fp32 gradient (4) + AdamW's exp_avg and exp_avg_sq (4 + 4)
= 18 B. An fp32 engine trains its own tensors: 4 + 4 + 8 = 16 B.

`OffloadedAdamW`: the moments in host memory, the step on the CPU: 10 B per parameter on the GPU (engine
weight, master, gradient) instead of 18, for host memory (the moments, 8 B per parameter, plus a fixed staging
area: the masters and gradients pass through it a few hundred MB at a time, so the host holds no copy of the
model besides the moments; a 30B model's two trainer ranks on one host need 244 GB, not 488) and PCIe traffic
each step (gradients and masters down, masters up: 12 B per parameter). The CPU step is torch's fused CPU
AdamW over the host copies (plain tensors): one vectorized pass per tensor that reads and writes each element
once, where the single-tensor loop makes ~8 passes and allocates a temporary per parameter; at 8B parameters
the host step was ~75-95% of a GRPO step (docs/performance.md). Each element's update is its own arithmetic,
so the step is deterministic and a shard's update is the whole tensor's (tested), but it rounds differently
from the single-tensor loop and from the fused CUDA step: an offloaded run is its own trajectory (a resume
keeps the setting).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["OffloadedAdamW", "adamw", "state_bytes_per_param"]


def adamw(params: Iterable, lr: float, weight_decay: float = 0.0, **kwargs) -> torch.optim.AdamW:
    """AdamW, fused on CUDA, single-tensor elsewhere (see the module doc). params: parameters, or param
    groups (dicts with "params" and their own settings, as torch.optim takes). kwargs go to AdamW (betas,
    eps); `fused` / `foreach` given there override the choice."""
    params = list(params)
    groups = params if params and isinstance(params[0], dict) else [{"params": params}]
    tensors = [p for g in groups for p in g["params"]]
    if not tensors:
        raise ValueError("adamw: no parameters to optimize")
    on_cuda = all(p.is_cuda and p.dtype.is_floating_point for p in tensors)
    impl = {"fused": True} if on_cuda else {"foreach": False}
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **{**impl, **kwargs})


def state_bytes_per_param(engine_dtype: torch.dtype, master_weights: bool | None = None,
                          offload_optimizer: bool = False) -> int:
    """Bytes per parameter on the device that training with AdamW holds between steps: the engine's
    weight, the fp32 master copy (if any), the fp32 gradient, AdamW's two fp32 moments (on the host with
    `offload_optimizer`). master_weights defaults to TrainableModel's rule (masters unless fp32)."""
    engine = torch.empty(0, dtype=engine_dtype).element_size()
    masters = engine_dtype != torch.float32 if master_weights is None else master_weights
    trained = 4 if masters else engine  # the tensors the optimizer steps (and their grads) are fp32 masters
    moments = 0 if offload_optimizer else 2 * trained
    return engine + (trained if masters else 0) + trained + moments


# OffloadedAdamW's staging area per dtype, in elements (x 2: masters and gradients; 512 MiB each in fp32):
# large enough that copies run at PCIe speed and the per-chunk host overhead is small, small enough to pin.
STAGE_ELEMENTS = 1 << 27


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank steps; FSDP2 parameters and their gradients), or `t`."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class OffloadedAdamW:
    """AdamW with its state in host memory, stepped on the CPU (see the module doc). The device
    parameters stay the source of truth: each step copies them and their gradients to host buffers,
    steps the host copies, and copies the results back, so anything that rewrites the device parameters
    between steps (a checkpoint restore) is seen. The torch.optim surface the RL loop and its
    checkpoints use: step, zero_grad, param_groups, state (keyed by the device parameters),
    state_dict / load_state_dict.

    params: parameters, or param groups (dicts with "params" and their own settings, as torch.optim
    takes). A DTensor parameter (an FSDP2 shard) is stepped through its local shard: the host buffers
    and moments are of `to_local()`'s size, and `state` presents the moments as DTensors laid out like
    the parameter (as torch's AdamW over DTensors keeps them), so a checkpoint gathers them alike."""

    def __init__(self, params: Iterable, lr: float, weight_decay: float = 0.0, **kwargs):
        params = list(params)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        self.params = [p for g in groups for p in g["params"]]
        if not self.params:
            raise ValueError("OffloadedAdamW: no parameters to optimize")
        self.on_cuda = any(p.is_cuda for p in self.params)  # pinned host buffers: asynchronous copies
        # One host tensor per parameter, the key of its AdamW state; between steps it holds no memory of its
        # own (an empty tensor, or a view into the staging area): only the moments persist on the host.
        host_groups = [{**g, "params": [torch.nn.Parameter(torch.empty(0, dtype=p.dtype)) for p in g["params"]]}
                       for g in groups]
        self.host = [h for g in host_groups for h in g["params"]]  # in the order of self.params
        self.inner = torch.optim.AdamW(host_groups, lr=lr, weight_decay=weight_decay, fused=True, **kwargs)
        self._staging: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # made at the first step
        self.stage_elements = STAGE_ELEMENTS

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self) -> dict:
        """{device parameter: its AdamW state}; a DTensor parameter's moments as DTensors like it (copies
        on its device: for reading, e.g. gathering a checkpoint)."""
        from torch.distributed.tensor import DTensor

        out = {}
        for p, h in zip(self.params, self.host):
            if h not in self.inner.state:
                continue
            entries = self.inner.state[h]
            if isinstance(p, DTensor):
                shard = _local(p).shape
                entries = {k: (DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, shape=p.shape,
                                                  stride=p.stride())
                               if isinstance(v, torch.Tensor) and v.shape == shard and v.dim() else v)
                           for k, v in entries.items()}
            out[p] = entries
        return out

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """torch.optim's state_dict format; DTensor state values (a parameter's layout) give their local
        shards, which is what the host copies hold."""
        state = {i: {k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in entries.items()}
                 for i, entries in state_dict["state"].items()}
        self.inner.load_state_dict({**state_dict, "state": state})

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        """Copies a chunk of masters and gradients into the staging area, steps them, copies the masters back;
        chunk after chunk. Each element's update is its own arithmetic, so the chunking (and where a tensor
        lands in the staging area) changes no bit; the host tensors of parameters outside the chunk have
        no gradient, which AdamW skips."""
        todo = [i for i, p in enumerate(self.params) if p.grad is not None]
        for h in self.host:
            h.grad = None
        for chunk in self._chunks(todo):
            for i, (param_view, grad_view) in chunk:
                self.host[i].data = param_view.copy_(_local(self.params[i]), non_blocking=True)
                self.host[i].grad = grad_view.copy_(_local(self.params[i].grad), non_blocking=True)
            if self.on_cuda:
                torch.cuda.synchronize()  # the host copies must have landed before the CPU reads them
            self.inner.step()
            for i, _ in chunk:
                # stream-ordered before any later use of the parameter, and before the next chunk's copies
                # overwrite the staging area (one stream: the copy down waits for this copy up)
                _local(self.params[i]).copy_(self.host[i], non_blocking=True)
                self.host[i].grad = None
        if self.on_cuda:
            torch.cuda.synchronize()  # the last chunk's copies up read the staging area

    def _chunks(self, indices: list[int]):
        """Yields lists of (parameter index, (param view, grad view)) whose views fit the staging area of
        their dtype; each view starts at a multiple of 64 elements."""
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in indices:
            by_dtype.setdefault(_local(self.params[i]).dtype, []).append(i)
        for dtype, members in by_dtype.items():
            stage_p, stage_g = self._stage(dtype, max(_local(self.params[i]).numel() for i in members))
            chunk, used = [], 0
            for i in members:
                shape = _local(self.params[i]).shape
                n = _local(self.params[i]).numel()
                if chunk and used + n > stage_p.numel():
                    yield chunk
                    chunk, used = [], 0
                chunk.append((i, (stage_p[used:used + n].view(shape), stage_g[used:used + n].view(shape))))
                used += -(-n // 64) * 64
            if chunk:
                yield chunk

    def _stage(self, dtype: torch.dtype, largest: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (masters, gradients) staging buffers of a dtype: `stage_elements` each (STAGE_ELEMENTS unless
        changed), or the largest tensor's size rounded up to 64."""
        size = max(self.stage_elements, -(-largest // 64) * 64)
        have = self._staging.get(dtype)
        if have is None or have[0].numel() < size:
            have = tuple(torch.empty(size, dtype=dtype, pin_memory=self.on_cuda) for _ in range(2))
            self._staging[dtype] = have
        return have
