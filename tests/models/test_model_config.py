"""ModelConfig parsing from HF config.json dicts (both rotary spellings) and its validation."""

import dataclasses
import json

import pytest

from detinfer.models.config import ModelConfig, RopeScaling
from detinfer.models.testing import tiny_config_dict


def test_llama_defaults_and_derived_sizes():
    cfg = ModelConfig.from_dict(tiny_config_dict("LlamaForCausalLM", hidden_size=64, num_attention_heads=4,
                                                 num_key_value_heads=2))
    assert (cfg.model_type, cfg.head_dim, cfg.q_size, cfg.kv_size) == ("llama", 16, 64, 32)
    assert cfg.softmax_scale == 16 ** -0.5
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias, cfg.qk_norm) == (False, False, False, False)
    assert cfg.rope_scaling is None and cfg.rope_theta == 10000.0


def test_architecture_flags():
    llama = ModelConfig.from_dict(tiny_config_dict("LlamaForCausalLM", attention_bias=True, mlp_bias=True))
    assert (llama.qkv_bias, llama.o_bias, llama.mlp_bias, llama.qk_norm) == (True, True, True, False)
    qwen2 = ModelConfig.from_dict(tiny_config_dict("Qwen2ForCausalLM"))
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.mlp_bias, qwen2.qk_norm) == (True, False, False, False)
    qwen3 = ModelConfig.from_dict(tiny_config_dict("Qwen3ForCausalLM", head_dim=32))
    assert (qwen3.qkv_bias, qwen3.o_bias, qwen3.qk_norm, qwen3.head_dim) == (False, False, True, 32)


@pytest.mark.parametrize("style", ["legacy", "parameters"])
def test_both_rope_spellings_parse_the_same(style):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    cfg = ModelConfig.from_dict(tiny_config_dict(rope_theta=500000.0, rope_scaling=scaling, rope_style=style))
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)


def test_legacy_type_key_and_original_max_defaults_to_max_positions():
    d = tiny_config_dict(max_position_embeddings=128)
    d["rope_scaling"] = {"type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    assert ModelConfig.from_dict(d).rope_scaling.original_max_position_embeddings == 128
    d["rope_scaling"] = {"type": "linear", "factor": 2.0}
    assert ModelConfig.from_dict(d).rope_scaling == RopeScaling("linear", 2.0)


def test_eos_ids_union_config_and_generation_config_and_dtype_spellings():
    d = tiny_config_dict()
    d["eos_token_id"] = [2, 5]
    d.pop("torch_dtype")
    d["dtype"] = "bfloat16"  # transformers 5 spelling
    cfg = ModelConfig.from_dict(d, {"eos_token_id": [7, 2], "bos_token_id": 0})
    assert cfg.eos_token_ids == (7, 2, 5) and cfg.bos_token_id == 0 and cfg.torch_dtype == "bfloat16"


def test_from_dir_reads_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config_dict()))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (9, 2)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ModelConfig.from_dir(tmp_path / "nowhere")
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelConfig.from_dir(tmp_path)


def test_config_is_frozen():
    cfg = ModelConfig.from_dict(tiny_config_dict())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 3


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["MistralForCausalLM"]}, "unsupported architecture 'MistralForCausalLM'"),
    ({"architectures": []}, "no 'architectures'"),
    ({"hidden_act": "gelu"}, "hidden_act must be 'silu'"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "unsupported rope type 'dynamic'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "unsupported rope type 'yarn'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3 rope scaling needs a positive"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0.5}}, "factor must be a number >= 1"),
    ({"partial_rotary_factor": 0.5}, "partial rotary"),
    ({"use_sliding_window": True}, "sliding-window"),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps must be a positive"),
    ({"rope_theta": 0}, "rope_theta must be a positive"),
    ({"vocab_size": 0}, "vocab_size must be a positive int"),
    ({"eos_token_id": 10_000}, "eos_token_ids must be a tuple of ids in"),
    ({"torch_dtype": "int8"}, "torch_dtype must be one of"),
    ({"intermediate_size": None}, "missing required field.*intermediate_size"),
])
def test_invalid_configs_are_refused_with_a_reason(change, message):
    d = {**tiny_config_dict(), **change}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(d)
