"""Tensor parallelism (see docs/tensor-parallel.md): process group and collectives (`group`), sharded layers
and weights (`layers`), the worker loop (`worker`) and rank 0's runner (`runner`)."""

from detinfer.distributed.layers import MAX_TP_CHUNKS, check_tp_config, tp_invariant_chunks
from detinfer.distributed.runner import TensorParallelRunner, make_runner

__all__ = ["MAX_TP_CHUNKS", "TensorParallelRunner", "check_tp_config", "make_runner", "tp_invariant_chunks"]
