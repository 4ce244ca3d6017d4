"""Fixtures for training tests: `model_dirs`, by name, tiny random Llama / Qwen3 checkpoints (head_dim 64, so
the engine runs its Triton attention kernel, in Triton's interpreter on CPU) and the real stories260k
checkpoint (tests/conftest.py's `stories_dir`)."""

from pathlib import Path

import pytest

from detinfer.models.testing import write_tiny_checkpoint

TINY = {
    # GQA, attention + MLP biases, tied embeddings (the embedding gets gradients from two places)
    "llama-bias-tied": ("LlamaForCausalLM", dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                                 num_key_value_heads=2, head_dim=64, attention_bias=True,
                                                 mlp_bias=True, tie_word_embeddings=True)),
    # q/k norm, MQA
    "qwen3-mqa": ("Qwen3ForCausalLM", dict(hidden_size=64, intermediate_size=96, num_attention_heads=2,
                                           num_key_value_heads=1, head_dim=64)),
}



@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, stories_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("train_ckpts")
    dirs = {name: write_tiny_checkpoint(root / name, arch, seed=i + 11, **kw)
            for i, (name, (arch, kw)) in enumerate(TINY.items())}
    dirs["stories260k"] = stories_dir
    return dirs
