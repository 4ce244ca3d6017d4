"""detinfer: deterministic, batch-invariant LLM inference.

Drop-in mode for any PyTorch / Hugging Face model:

    import detinfer
    with detinfer.batch_invariant():
        out = model(**inputs)
"""

from detinfer.ops.mode import (
    NotBatchInvariantError,
    batch_invariant,
    disable,
    enable,
    is_enabled,
)

__version__ = "0.1.0"

__all__ = ["NotBatchInvariantError", "__version__", "batch_invariant", "disable", "enable", "is_enabled"]
