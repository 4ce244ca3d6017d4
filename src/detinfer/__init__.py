"""detinfer: deterministic, batch-invariant LLM inference.

Drop-in mode for any PyTorch / Hugging Face model:

    import detinfer
    with detinfer.batch_invariant():
        out = model(**inputs)

The mode's names are imported lazily, so pure-Python parts (the scheduler, the block manager) can be
imported without torch.
"""

__version__ = "0.1.0"

_MODE_NAMES = ("NotBatchInvariantError", "batch_invariant", "disable", "enable", "is_enabled")

__all__ = ["__version__", *_MODE_NAMES]


def __getattr__(name: str):
    if name in _MODE_NAMES:
        from detinfer.ops import mode

        return getattr(mode, name)
    raise AttributeError(f"module 'detinfer' has no attribute {name!r}")
