"""Tensor parallelism's building blocks (see docs/tensor-parallel.md): the process group and its collectives
(`group`, `nccl_comm`) and the tensor-parallel layers of the one Transformer (`layers`). The engine side of
tensor parallelism (rank 0's runner, the worker ranks' step loop) lives in engine/tp_runner.py and
engine/tp_worker.py: it runs the engine's `ModelRunner`, and this package sits below the engine."""

from detinfer.distributed.layers import MAX_TP_CHUNKS, check_tp_config, tp_invariant_chunks

__all__ = ["MAX_TP_CHUNKS", "check_tp_config", "tp_invariant_chunks"]
