"""Model code: config, the one transformer every model family (`detinfer.models.families`: Llama, Qwen2,
Qwen3) runs on, checkpoint + GGUF loading, hub-id resolution, tokenizer.

`detinfer.models.pull.pull(name)` fetches known models (kept out of this namespace: the submodule is
named pull too)."""

from detinfer.models.attention_ref import ReferenceAttention
from detinfer.models.config import ModelConfig, RopeScaling
from detinfer.models.hub import resolve_model_path
from detinfer.models.loader import load_model, load_tokenizer
from detinfer.models.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer
from detinfer.models.transformer import Transformer

__all__ = [
    "ChatTemplateError", "IncrementalDetokenizer", "ModelConfig", "ReferenceAttention", "RopeScaling",
    "Tokenizer", "Transformer", "load_model", "load_tokenizer", "resolve_model_path",
]
