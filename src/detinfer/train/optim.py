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
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["adamw", "state_bytes_per_param"]


def adamw(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float = 0.0,
          **kwargs) -> torch.optim.AdamW:
    """AdamW, fused on CUDA, single-tensor elsewhere (see the module doc). kwargs go to AdamW (betas,
    eps); `fused` / `foreach` given there override the choice."""
    params = list(params)
    if not params:
        raise ValueError("adamw: no parameters to optimize")
    on_cuda = all(p.is_cuda and p.dtype.is_floating_point for p in params)
    impl = {"fused": True} if on_cuda else {"foreach": False}
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **{**impl, **kwargs})


def state_bytes_per_param(engine_dtype: torch.dtype, master_weights: bool | None = None) -> int:
    """Bytes per parameter that training with AdamW holds between steps: the engine's weight, the fp32
    master copy (if any), the fp32 gradient, AdamW's two fp32 moments. master_weights defaults to
    TrainableModel's rule (masters for every dtype but fp32)."""
    engine = torch.empty(0, dtype=engine_dtype).element_size()
    masters = engine_dtype != torch.float32 if master_weights is None else master_weights
    trained = 4 if masters else engine  # the tensors the optimizer steps (and their grads) are fp32 masters
    return engine + (trained if masters else 0) + trained + 2 * trained
