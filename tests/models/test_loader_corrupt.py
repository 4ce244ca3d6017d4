"""A malformed checkpoint gives one clear error naming the file and the tensor: NaN/Inf weights, a truncated
or corrupt safetensors file, a wrong shape, a missing tensor, an unknown architecture. And an out-of-memory
at engine start-up says which setting to lower."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from detinfer.engine import EngineConfig, LLMEngine
from detinfer.engine.llm_engine import out_of_memory_message
from detinfer.models import load_model
from detinfer.models.testing import write_tiny_checkpoint


@pytest.fixture
def ckpt(tmp_path):
    return write_tiny_checkpoint(tmp_path / "m", "LlamaForCausalLM", num_hidden_layers=1)


def _edit(path, name, fn):
    tensors = load_file(path / "model.safetensors")
    tensors[name] = fn(tensors[name])
    save_file(tensors, str(path / "model.safetensors"))


@pytest.mark.parametrize("value,word", [(float("nan"), "NaN"), (float("inf"), "Inf")])
def test_non_finite_weights_name_file_and_tensor(ckpt, value, word):
    def poison(t):
        t = t.clone()
        t.view(-1)[3] = value
        return t

    _edit(ckpt, "model.layers.0.mlp.up_proj.weight", poison)
    with pytest.raises(ValueError) as err:
        load_model(ckpt)
    msg = str(err.value)
    assert "model.safetensors" in msg and "model.layers.0.mlp.up_proj.weight" in msg and word in msg


def test_weight_that_overflows_the_target_dtype_is_refused(ckpt):
    _edit(ckpt, "model.norm.weight", lambda t: torch.full_like(t, 1e30))  # fine in fp32, inf in fp16
    load_model(ckpt, dtype="float32")
    with pytest.raises(ValueError, match=r"model.norm.weight holds Inf values \(as float16\)"):
        load_model(ckpt, dtype="float16")


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_safetensors_names_the_file(ckpt, keep):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(ValueError) as err:
        load_model(ckpt)
    assert str(path) in str(err.value) and "truncated" in str(err.value)


def test_garbage_header_names_the_file(ckpt):
    path = ckpt / "model.safetensors"
    path.write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_model(ckpt)


def test_wrong_shape_names_file_and_tensor(ckpt):
    _edit(ckpt, "model.layers.0.self_attn.q_proj.weight", lambda t: t[:-1])
    with pytest.raises(ValueError, match=r"q_proj.weight has shape .*\(in model.safetensors\)"):
        load_model(ckpt)


def test_missing_tensor_and_unknown_architecture(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.0.input_layernorm.weight"]
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensors: model.layers.0.input_layernorm.weight"):
        load_model(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "architectures": ["MambaForCausalLM"]}))
    with pytest.raises(ValueError, match="unsupported architecture 'MambaForCausalLM'"):
        LLMEngine(ckpt, EngineConfig(num_kv_blocks=8), device="cpu")


def test_out_of_memory_at_start_up_names_the_settings_to_lower(ckpt, monkeypatch):
    import detinfer.engine.llm_engine as llm_engine

    def oom(*_a, **_k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(llm_engine, "load_model", oom)
    with pytest.raises(RuntimeError) as err:
        LLMEngine(ckpt, EngineConfig(num_kv_blocks=8, max_num_seqs=4), device="cpu")
    msg = str(err.value)
    for setting in ("--gpu-memory-utilization", "--max-model-len", "--max-num-seqs (now 4)", "--num-kv-blocks"):
        assert setting in msg
    assert "Tried to allocate 2.00 GiB" in msg
    assert "--max-num-seqs" in out_of_memory_message(EngineConfig(), torch.device("cpu"), MemoryError())
