"""Fixtures for the repro tests: one tiny random chat checkpoint per session, small engine flags."""

from pathlib import Path

import pytest

# A small, quick engine for CPU runs (the tiny model's context is 256 tokens).
ENGINE_FLAGS = ["--max-num-seqs", "16", "--max-num-batched-tokens", "256", "--num-kv-blocks", "128",
                "--max-model-len", "256"]
# A light load: the experiment's machinery is what is tested, not throughput.
LOAD_FLAGS = ["--max-background", "3", "--background-max-tokens", "8", "--background-prompt-words", "12",
              "--run-gap", "2", "--arrival-window", "3"]


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory) -> Path:
    from detinfer.models.testing import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("repro-model") / "tiny-qwen3", "Qwen3ForCausalLM",
                                 seed=3)


@pytest.fixture
def repro_flags() -> list[str]:
    """Engine and load flags for a quick `detinfer repro` run on the tiny model."""
    return ENGINE_FLAGS + LOAD_FLAGS
