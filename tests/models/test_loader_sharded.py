"""Sharded loading without processes: what each tensor-parallel rank reads of a checkpoint, and draws of a
random preset, is bit for bit the slice the in-memory split (`shard_state` of the whole model) gives it, and
it reads nothing else.

Models: stories260k (real, tied embeddings, 4 KV heads), a Llama with one KV head (replicated on 2 and 4
ranks), biases everywhere and a vocab that does not divide by 4 (padded last shard), and tiny Qwen3-MoE and
Mixtral checkpoints in two files (experts split in contiguous blocks). Errors name the tensor and the rank.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from detinfer.distributed.layers import shard_state
from detinfer.models import loader
from detinfer.models import random_weights as rw
from detinfer.models.config import ModelConfig
from detinfer.models.loader import load_model, load_state
from detinfer.models.sharding import shard_spec, take_shard
from detinfer.models.testing import expected_shard_numel, write_tiny_checkpoint
from detinfer.repro.random_model import build_random_model, preset_config

LLAMA = dict(vocab_size=322, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=1,
             head_dim=8, attention_bias=True, mlp_bias=True)
MOE = {"Qwen3MoeForCausalLM": dict(extra=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                              mlp_only_layers=[1])),
       "MixtralForCausalLM": dict(intermediate_size=48, extra=dict(num_local_experts=4))}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, stories_dir):
    root = tmp_path_factory.mktemp("sharded")
    dirs = {"stories260k": stories_dir,
            "llama": write_tiny_checkpoint(root / "llama", "LlamaForCausalLM", seed=3, **LLAMA)}
    for arch, kw in MOE.items():
        dirs[arch] = write_tiny_checkpoint(root / arch, arch, seed=4, num_shards=2, **kw)
    return dirs


@pytest.mark.parametrize("name", ["stories260k", "llama", "Qwen3MoeForCausalLM", "MixtralForCausalLM"])
@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_reads_exactly_its_in_memory_shard(checkpoints, name, size, monkeypatch):
    model_dir = checkpoints[name]
    full, cfg = load_model(model_dir, torch.bfloat16)
    read = []
    real_read = loader._read_tensor

    def counting(*args, **kw):
        t = real_read(*args, **kw)
        read.append(t.numel())
        return t

    monkeypatch.setattr(loader, "_read_tensor", counting)
    for rank in range(size):
        read.clear()
        mine = load_state(model_dir, cfg, torch.bfloat16, "cpu", rank, size)
        want = shard_state(full, cfg, rank, size)
        assert mine.keys() == want.keys()
        for key in want:
            assert mine[key].dtype == torch.bfloat16 and torch.equal(mine[key], want[key]), key
        held = sum(t.numel() for t in mine.values())
        assert held == expected_shard_numel(cfg, size)
        padding = -(-cfg.vocab_size // size) * size - cfg.vocab_size
        pad_here = padding * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2) if rank == size - 1 else 0
        assert sum(read) == held - pad_here  # read from disk: the shard and nothing more


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2", "tiny-qwen3-moe", "tiny-mixtral"])
@pytest.mark.parametrize("size", [2, 4])
def test_random_preset_shards_are_slices_of_the_full_random_model(preset, size):
    model, cfg = build_random_model(preset, dtype=torch.bfloat16, seed=5)
    for rank in range(size):
        mine = rw.random_state(cfg, seed=5, dtype=torch.bfloat16, device="cpu", rank=rank, size=size)
        want = shard_state(model, cfg, rank, size)
        assert mine.keys() == want.keys()
        for key in want:
            assert torch.equal(mine[key], want[key]), key
        assert sum(t.numel() for t in mine.values()) == expected_shard_numel(cfg, size)


def test_random_weights_have_the_intended_scale_and_depend_on_seed_and_name():
    cfg = preset_config("tiny")
    a = rw.random_state(cfg, seed=1, dtype=torch.float32, device="cpu")
    b = rw.random_state(cfg, seed=2, dtype=torch.float32, device="cpu")
    w = a["layers.0.mlp.gate_up_proj.weight"]
    assert abs(w.std().item() * math.sqrt(cfg.hidden_size) - 1) < 0.05 and abs(w.mean().item()) < 0.01
    assert abs(a["layers.0.input_layernorm.weight"].mean().item() - 1) < 0.05
    assert not torch.equal(w, b["layers.0.mlp.gate_up_proj.weight"])
    assert not torch.equal(a["layers.0.input_layernorm.weight"], a["layers.1.input_layernorm.weight"])


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 40), data=st.data(), chunk=st.sampled_from([1, 7, 1 << 24]))
def test_any_block_of_a_draw_equals_that_block_of_the_whole(rows, cols, data, chunk):
    """The counter-based draw: a block drawn alone (any rows, any columns, any chunking) has the whole
    tensor's bits there."""
    key = data.draw(st.integers(0, 2 ** 32 - 1))
    whole = rw.draw(key, [(0, rows)], (0, cols), 0.0, 0.3, torch.float32, torch.device("cpu"))
    r0 = data.draw(st.integers(0, rows - 1))
    r1 = data.draw(st.integers(r0 + 1, rows))
    r2 = data.draw(st.integers(0, rows - 1))
    c0 = data.draw(st.integers(0, cols - 1))
    c1 = data.draw(st.integers(c0 + 1, cols))
    old = rw.CHUNK_ELEMENTS
    rw.CHUNK_ELEMENTS = chunk
    try:
        part = rw.draw(key, [(r0, r1), (r2, r2 + 1)], (c0, c1), 0.0, 0.3, torch.float32, torch.device("cpu"))
    finally:
        rw.CHUNK_ELEMENTS = old
    assert torch.equal(part, torch.cat((whole[r0:r1, c0:c1], whole[r2:r2 + 1, c0:c1])))


def test_shard_spec_splits_experts_in_contiguous_blocks():
    cfg = preset_config("tiny-qwen3-moe")
    shape = (cfg.num_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
    per = cfg.num_experts // 4
    for rank in range(4):
        spec = shard_spec("layers.0.mlp.gate_up_proj", shape, cfg, rank, 4)
        assert (spec.dim, spec.ranges) == (0, ((rank * per, (rank + 1) * per),))
    assert shard_spec("layers.0.mlp.router", (cfg.num_experts, cfg.hidden_size), cfg, 1, 4).dim is None
    t = torch.arange(48.0).reshape(8, 3, 2)
    assert cfg.num_experts == 8
    assert torch.equal(take_shard(t, shard_spec("layers.0.mlp.down_proj", (8, 3, 2), cfg, 1, 2)), t[4:])


def _edit(path, fn):
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_loading_errors_name_the_tensor_and_the_rank(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "m", "LlamaForCausalLM", num_hidden_layers=1)
    cfg = ModelConfig.from_dir(ckpt)
    name = "model.layers.0.self_attn.q_proj.weight"

    def poison_last_row(tensors):  # a row only the last rank's q heads read
        tensors[name][-1, 0] = float("nan")

    _edit(ckpt, poison_last_row)
    load_state(ckpt, cfg, torch.float32, "cpu", 0, 2)  # rank 0 never reads that row
    with pytest.raises(ValueError, match=rf"(?s)rank 1 of 2: .*{name} holds NaN"):
        load_state(ckpt, cfg, torch.float32, "cpu", 1, 2)
    _edit(ckpt, lambda tensors: tensors.pop("model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"(?s)rank 1 of 4: .*missing tensors: model.layers.0.mlp.up_proj.weight"):
        load_state(ckpt, cfg, torch.float32, "cpu", 1, 4)
    ckpt2 = write_tiny_checkpoint(tmp_path / "m2", "LlamaForCausalLM", num_hidden_layers=1)
    _edit(ckpt2, lambda tensors: tensors.update({name: tensors[name][:-1]}))
    with pytest.raises(ValueError, match=rf"(?s)rank 0 of 2: .*{name} has shape"):
        load_state(ckpt2, cfg, torch.float32, "cpu", 0, 2)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_random_shards_of_any_shape_are_slices_of_the_whole(data):
    """Any head / KV-head / vocab / intermediate shape and any TP size the model allows: each rank's own draw
    is its slice of the whole draw, and holds the parameter count the config implies."""
    from detinfer.distributed import check_tp_config
    from detinfer.models.testing import tiny_config_dict

    size = data.draw(st.sampled_from([2, 4]))
    kv = data.draw(st.sampled_from([1, 2, 4, 8]))
    heads = kv * data.draw(st.sampled_from([1, 2, 4]))
    if heads % size:
        heads *= size
    cfg = ModelConfig.from_dict(tiny_config_dict(
        data.draw(st.sampled_from(["LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen2ForCausalLM"])),
        vocab_size=data.draw(st.integers(5, 70)), hidden_size=16, head_dim=4, num_attention_heads=heads,
        num_key_value_heads=kv, intermediate_size=size * data.draw(st.integers(1, 6)), num_hidden_layers=1,
        tie_word_embeddings=data.draw(st.booleans()), attention_bias=data.draw(st.booleans()),
        mlp_bias=data.draw(st.booleans())))
    check_tp_config(cfg, size)
    whole = rw.random_state(cfg, seed=2, dtype=torch.float32, device="cpu")
    for rank in range(size):
        mine = rw.random_state(cfg, seed=2, dtype=torch.float32, device="cpu", rank=rank, size=size)
        for name, t in whole.items():
            assert torch.equal(mine[name], take_shard(t, shard_spec(name, tuple(t.shape), cfg, rank, size))), name
        assert sum(t.numel() for t in mine.values()) == expected_shard_numel(cfg, size)
