"""What the HTTP handlers share: the served model's facts, the engine front end, the limits.

The app sees the engine only through `AsyncEngine` (requests in, streams out) and `ServedModel` (the facts
that validation needs: tokenizer, vocabulary size, context length), never the engine object itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from detinfer.server.async_engine import AsyncEngine
from detinfer.server.config import ServerConfig
from detinfer.server.logprobs import TokenFormatter
from detinfer.server.prompts import PromptChecker
from detinfer.server.sampling import RequestLimits


@dataclass(frozen=True)
class ServedModel:
    """The model as the server presents and validates against it."""

    name: str
    tokenizer: Any
    vocab_size: int
    max_model_len: int
    fingerprint: str


@dataclass
class ServerState:
    engine: AsyncEngine
    config: ServerConfig
    model: ServedModel
    formatter: TokenFormatter
    prompts: PromptChecker
    limits: RequestLimits
    created: int = field(default=0)
    # weights digest -> system_fingerprint (the other inputs fixed); an admin weight load re-fingerprints
    refingerprint: Callable[[str], str] | None = None
