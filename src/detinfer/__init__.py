"""detinfer: deterministic, batch-invariant LLM inference."""

__version__ = "0.1.0"
