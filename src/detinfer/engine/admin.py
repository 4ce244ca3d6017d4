"""Operations on a running engine that change or inspect its state as a whole: load new weights in place,
reset the prefix cache, fingerprint the weights. The rollout server's admin endpoints reach them through the
engine-core protocol (engine/core.py's `Admin` command), so they work the same with the engine in its own process
and on the server's engine thread.

Idle-only. Such an operation runs only while the engine has no unfinished request: in-flight requests finish
on the weights they started with (their KV cache holds those weights' keys and values), never on a mix.
`HeldCommands` implements the wait: from the moment an operation arrives, it and every command after it
(new requests included) are held in arrival order; the operation runs once the requests before it finished,
then the held commands are applied in order. So a request sent after a weight load always samples from the
new weights, and a stream of new requests cannot starve the load.

Weight loads are atomic: every tensor is read and validated (names, shapes, stored dtypes, finite values)
before the first one is copied, so a bad checkpoint leaves the served weights untouched. The copy is in place
(`Tensor.copy_`), so CUDA graphs captured over the weights stay valid; the prefix cache is then dropped (its
blocks hold the old weights' K/V). Under tensor parallelism rank 0 takes the full tensors and scatters each
rank its shards in buckets (`push_weights`, distributed/weight_push.py); `weights_fingerprint` needs TP=1.
"""

from __future__ import annotations

import collections
import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ADMIN_OPS = ("load_weights", "reset_prefix_cache", "weights_fingerprint")


class HeldCommands:
    """Ordered commands held behind an idle-only operation (see the module docstring). Pure Python."""

    def __init__(self, is_admin: Callable[[Any], bool]):
        self._is_admin = is_admin
        self._queue: collections.deque = collections.deque()

    def __bool__(self) -> bool:
        return bool(self._queue)

    def offer(self, command: Any) -> bool:
        """Hold `command` (True) if it is an operation or queued behind one; False: apply it now."""
        if self._queue or self._is_admin(command):
            self._queue.append(command)
            return True
        return False

    def release(self, idle: Callable[[], bool], apply: Callable[[Any], None]) -> None:
        """Apply held commands in order; an operation at the front waits until `idle()`."""
        while self._queue and (not self._is_admin(self._queue[0]) or idle()):
            apply(self._queue.popleft())


def run_admin(engine: Any, op: str, arg: Any = None) -> dict[str, Any]:
    """Run one operation on an idle engine; ValueError (nothing changed) for a bad request."""
    if engine.has_unfinished_requests():  # HeldCommands guarantees idleness; never swap under a request
        raise RuntimeError(f"{op}: the engine has unfinished requests")
    if op == "reset_prefix_cache":
        return {"prefix_cache_blocks_dropped": engine.reset_prefix_cache()}
    if op == "weights_fingerprint":  # the whole model's: under tensor parallelism rank 0 holds only a shard
        if engine.config.tensor_parallel_size > 1:
            raise ValueError("weights_fingerprint needs tensor_parallel_size 1 (each rank holds a shard); at a "
                             "larger size load_weights returns the digest of the full weights it loaded")
        return {"weights_sha256": weights_sha256(engine.runner.model)}
    if op == "load_weights":
        return load_weights(engine, arg)
    raise ValueError(f"unknown admin operation {op!r}; allowed: {', '.join(ADMIN_OPS)}")


def weights_sha256(model: Any) -> str:
    """sha256 over every parameter's name, dtype, shape and bytes, in name order: equal digests, equal weights.
    FP8 weights the engine stores tiled (models/fp8.py) are hashed as [N, K], as every other engine holds them."""
    from detinfer.kernels.fp8_quant import is_tiled, untile_weight

    return state_sha256({name: untile_weight(p) if is_tiled(p) else p for name, p in model.named_parameters()})


def state_sha256(state: dict[str, Any]) -> str:
    """`weights_sha256` of a {name: full tensor} dict: a TP=1 model holding these tensors has this digest."""
    import torch

    h = hashlib.sha256()
    for name, p in sorted(state.items()):
        t = p.detach().contiguous().cpu()
        h.update(f"{name}\0{str(t.dtype).removeprefix('torch.')}\0{list(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def push_weights(engine: Any, state: dict[str, Any], bucket_bytes: int | None = None) -> dict[str, Any]:
    """Copy full (TP=1-shaped) weights {detinfer parameter name: tensor} into an idle engine's tensors in place,
    at any tensor_parallel_size (rank 0 scatters each rank its shards in buckets: distributed/weight_push.py),
    then drop the prefix cache. Any subset of the parameters; validated before anything changes."""
    import torch

    from detinfer.distributed.weight_push import check_full_state

    if engine.has_unfinished_requests():  # their KV cache holds the old weights' keys and values
        raise RuntimeError(f"push_weights: the engine has {engine.get_num_unfinished_requests()} unfinished "
                           "requests; finish or abort them before updating the weights")
    if engine.model_config.quantization is not None:  # a 16-bit tensor copied into an fp8 one loses its scales
        raise ValueError(f"loading weights into a running {engine.model_config.quantization} engine is not "
                         "supported; start a new engine on the checkpoint")
    runner = engine.runner
    if engine.config.tensor_parallel_size > 1:
        loaded = runner.load_full_weights(state, bucket_bytes)
    else:
        params = dict(runner.model.named_parameters())
        check_full_state(state, {n: tuple(p.shape) for n, p in params.items()})
        with torch.no_grad():
            for name, tensor in state.items():
                params[name].copy_(tensor)
        loaded = len(state)
    return {"tensors_loaded": loaded, "prefix_cache_blocks_dropped": engine.reset_prefix_cache()}


def load_weights(engine: Any, path: Any) -> dict[str, Any]:
    """Copy the weights at `path` into the engine's tensors, in place, then drop the prefix cache.

    `path`: a HF-format checkpoint directory (model.safetensors or an index with shards; every tensor the
    running model's config implies), or one .safetensors file holding either the HF-named tensors of a full
    checkpoint or detinfer-named parameters (any subset: only those change; under tensor parallelism all of
    them, so that the returned digest is the full weights'). Under tensor parallelism rank 0 reads the full
    tensors on the CPU and scatters each rank its shards (`push_weights`)."""
    import torch

    from detinfer.distributed.weight_push import full_shapes

    if engine.model_config.quantization is not None:
        raise ValueError(f"loading weights into a running {engine.model_config.quantization} engine is not "
                         "supported; start a new engine on the checkpoint")
    tp = engine.config.tensor_parallel_size > 1
    shapes = (full_shapes(engine.model_config, engine.runner.ops) if tp else
              {name: tuple(t.shape) for name, t in engine.runner.model.named_parameters()})
    state = read_weights(path, shapes, engine.model_config, engine.dtype,
                         torch.device("cpu") if tp else engine.device)
    missing = sorted(set(shapes) - set(state))
    if tp and missing:
        raise ValueError(f"{path}: under tensor parallelism a weights file must hold every parameter; missing "
                         f"{missing[0]}" + (f" ({len(missing) - 1} more)" if len(missing) > 1 else ""))
    result = push_weights(engine, state)
    digest = state_sha256(state) if tp else weights_sha256(engine.runner.model)
    del state
    return {**result, "weights_sha256": digest}


def read_weights(path: Any, params: dict[str, tuple], model_config: Any, dtype: Any, device: Any) -> dict[str, Any]:
    """Validated {detinfer parameter name: tensor in `dtype` on `device`} from `path` (see load_weights), for a
    model whose parameters have the full shapes `params` {name: shape}; ValueError naming the tensor and the
    problem otherwise."""
    from detinfer.models.loader import load_state

    if not isinstance(path, str) or not path:
        raise ValueError(f"path must be a non-empty string (a checkpoint directory or a .safetensors file), "
                         f"got {path!r}")
    p = Path(path)
    if p.is_dir():
        state = _load_hf(lambda: load_state(p, model_config, dtype, device))
    elif p.is_file():
        state = _read_file(p, params, model_config, dtype, device)
    else:
        raise ValueError(f"{path}: no such file or directory (on the server's machine)")
    for name, tensor in state.items():
        if name not in params:
            raise ValueError(f"tensor {name}: the running model has no such parameter")
        _check_shape(name, tuple(tensor.shape), params[name])
    return state


def _check_shape(name: str, shape: tuple, expected: tuple) -> None:
    if shape != expected:
        raise ValueError(f"tensor {name} has shape {list(shape)}, the running model's is {list(expected)}")


def _load_hf(load: Callable[[], dict]) -> dict:
    try:
        return load()
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None


def _read_file(path: Path, params: dict[str, tuple], model_config: Any, dtype: Any, device: Any) -> dict:
    from detinfer.models.loader import STORED_FLOAT_DTYPES, _open, _read_tensor, load_state

    with _open(path) as f:
        names = list(f.keys())
        ours = [n for n in names if n in params]
        if not ours:  # HF names: a full checkpoint, fused into our parameters by the model family's loader
            with tempfile.TemporaryDirectory() as tmp:
                os.symlink(path.resolve(), Path(tmp) / "model.safetensors")
                return _load_hf(lambda: load_state(tmp, model_config, dtype, device))
        if len(ours) != len(names):
            stray = sorted(set(names) - set(ours))
            raise ValueError(f"{path.name}: tensor {stray[0]} is not a parameter of the running model"
                             + (f" ({len(stray) - 1} more)" if len(stray) > 1 else "")
                             + "; a file holds either detinfer parameter names or a full HF checkpoint's names")
        for name in names:
            sl = f.get_slice(name)
            shape, stored = tuple(sl.get_shape()), sl.get_dtype()
            _check_shape(name, shape, params[name])
            if stored not in STORED_FLOAT_DTYPES:
                raise ValueError(f"tensor {name} is stored as {stored}; allowed: {', '.join(STORED_FLOAT_DTYPES)}")
        return {name: _read_tensor(f, path, name, device, dtype) for name in names}
