"""Model code: config, the Llama / Qwen2 / Qwen3 transformer, checkpoint + GGUF loading, tokenizer.

`detinfer.models.pull.pull(name)` fetches known models (kept out of this namespace: the submodule is
named pull too)."""

from detinfer.models.attention_ref import ReferenceAttention
from detinfer.models.config import ModelConfig, RopeScaling
from detinfer.models.loader import load_model, load_tokenizer
from detinfer.models.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer
from detinfer.models.transformer import Transformer

__all__ = [
    "ChatTemplateError", "IncrementalDetokenizer", "ModelConfig", "ReferenceAttention", "RopeScaling",
    "Tokenizer", "Transformer", "load_model", "load_tokenizer",
]
