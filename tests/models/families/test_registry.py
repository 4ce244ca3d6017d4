"""The family registry: lookups, clear refusals, every preset against transformers' own module for it, and
that a new family is one registered module (a toy family goes through config parsing, the tiny-checkpoint
writer, the loader and a forward without any other file knowing its name)."""

import dataclasses
import json

import pytest
import torch

import detinfer.models.families as registry
from detinfer.models import ReferenceAttention, load_model
from detinfer.models.config import ModelConfig
from detinfer.models.families import (
    FLAG_FIELDS,
    ModelFamily,
    families,
    family_for_architecture,
    family_for_gguf_arch,
    preset_hf_config,
    preset_names,
    register,
    supported_architectures,
)
from detinfer.models.families import llama as llama_module
from detinfer.models.testing import tiny_config_dict, write_tiny_checkpoint
from detinfer.repro.random_model import build_random_model

# Public models' parameter counts (their model cards / safetensors index total sizes).
PUBLIC_PARAMETER_COUNTS = {"llama-3.1-8b": 8_030_261_248, "qwen3-8b": 8_190_735_360, "qwen3-0.6b": 596_049_920,
                           "qwen3-30b-a3b": 30_532_122_624, "mixtral-8x7b": 46_702_792_704}


def test_the_builtin_families_are_registered():
    assert [f.model_type for f in families()] == ["llama", "mixtral", "qwen2", "qwen3", "qwen3_moe"]
    assert supported_architectures() == ("LlamaForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM",
                                         "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    assert {"qwen3-8b", "qwen3-0.6b", "llama-3.1-8b", "tiny", "qwen3-30b-a3b", "tiny-qwen3-moe",
            "mixtral-8x7b", "tiny-mixtral"} <= set(preset_names())


@pytest.mark.parametrize("family", families(), ids=lambda f: f.model_type)
def test_each_family_is_found_by_every_name_it_owns(family):
    for arch in family.architectures:
        assert family_for_architecture(arch) is family
        config = ModelConfig.from_dict(tiny_config_dict(arch))
        assert config.family is family and config.model_type == family.model_type
    if family.gguf_arch is not None:
        assert family_for_gguf_arch(family.gguf_arch) is family
    for name in family.presets:
        assert preset_hf_config(name)["architectures"] == [family.architectures[0]]


def test_every_family_has_an_hf_parity_variant(tiny_checkpoints):
    """test_transformer_parity compares logits with transformers on tests/models/conftest.py's VARIANTS; a
    registered family missing there would go unchecked."""
    covered = {json.loads((d / "config.json").read_text())["architectures"][0] for d in tiny_checkpoints.values()}
    assert set(supported_architectures()) <= covered


def test_unknown_names_are_refused_naming_the_supported_ones():
    with pytest.raises(ValueError, match="unsupported architecture 'Qwen2MoeForCausalLM'; supported: "
                                         "LlamaForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM, "
                                         "Qwen3ForCausalLM, Qwen3MoeForCausalLM"):
        family_for_architecture("Qwen2MoeForCausalLM")
    with pytest.raises(ValueError, match="unsupported architecture None"):
        family_for_architecture(None)
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gemma'; supported: llama, qwen2, qwen3"):
        family_for_gguf_arch("gemma")
    with pytest.raises(ValueError, match=r"unknown random model 'qwen9'; known: .*qwen3-8b.*tiny"):
        preset_hf_config("qwen9")


def test_register_refuses_clashes_and_non_families():
    llama = family_for_architecture("LlamaForCausalLM")
    with pytest.raises(ValueError, match="model_type 'llama', architecture 'LlamaForCausalLM', GGUF arch "
                                         "'llama', preset 'llama-3.1-8b'"):
        register(llama)
    with pytest.raises(ValueError, match="preset 'tiny'"):
        register(dataclasses.replace(llama, model_type="other", architectures=("OtherForCausalLM",),
                                     gguf_arch=None, presets={"tiny": {}}))
    with pytest.raises(TypeError, match="register takes a ModelFamily"):
        register("llama")
    assert family_for_architecture("LlamaForCausalLM") is llama  # nothing half-registered
    assert "OtherForCausalLM" not in supported_architectures()


def test_a_family_is_validated_when_declared():
    llama = family_for_architecture("LlamaForCausalLM")
    with pytest.raises(ValueError, match="architectures must be a non-empty tuple"):
        dataclasses.replace(llama, architectures=[])
    with pytest.raises(ValueError, match="needs gguf_config_fields and hf_name_from_gguf"):
        dataclasses.replace(llama, hf_name_from_gguf=None)
    with pytest.raises(ValueError, match="must not set 'architectures'"):
        dataclasses.replace(llama, presets={"x": {"architectures": ["LlamaForCausalLM"]}})
    broken = dataclasses.replace(llama, flags_from_hf=lambda cfg: {"qkv_bias": 1})
    with pytest.raises(ValueError, match=r"must return bools for exactly \('qkv_bias'"):
        broken.flags({})
    assert set(llama.flags({})) == set(FLAG_FIELDS)


@pytest.mark.parametrize("name", preset_names())
def test_presets_have_transformers_tensor_layout(name, transformers_weight_shapes):
    """Each preset is a config.json that transformers accepts, and its model has exactly the tensors (names
    and shapes) the family's layout lists; the public ones have their model's parameter count."""
    hf_config = preset_hf_config(name)
    config = ModelConfig.from_dict(hf_config)
    ours = config.family.hf_weight_shapes(config)
    assert ours == transformers_weight_shapes({**hf_config, "model_type": config.model_type})
    if name in PUBLIC_PARAMETER_COUNTS:
        assert sum(torch.Size(s).numel() for s in ours.values()) == PUBLIC_PARAMETER_COUNTS[name]


@pytest.mark.parametrize("name", [n for n in preset_names() if n.startswith("tiny")])
def test_cpu_presets_build_and_are_batch_invariant(name):
    model, config = build_random_model(name, mode="deterministic", dtype=torch.float32, seed=1)
    assert config == ModelConfig.from_dict(preset_hf_config(name))
    a, b = torch.arange(3, 20), torch.arange(40, 51)

    def logits(ids_list):
        attn = ReferenceAttention(config.num_hidden_layers, config.softmax_scale)
        positions = attn.begin(list(range(len(ids_list))), [len(x) for x in ids_list])
        with torch.no_grad():
            return model.compute_logits(model(torch.cat(ids_list), positions, attn))

    alone, packed = logits([a]), logits([b, a])
    assert torch.isfinite(alone).all()
    assert torch.equal(alone, packed[len(b):])


TOY = ModelFamily(
    model_type="toy", architectures=("ToyForCausalLM",), flags_from_hf=llama_module.flags_from_hf,
    hf_config_fields=llama_module.hf_config_fields, hf_weight_shapes=llama_module.FAMILY.hf_weight_shapes,
    state_dict_from_hf=llama_module.FAMILY.state_dict_from_hf,
    presets={"toy-tiny": dict(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5)},
)


@pytest.fixture
def toy_registered(monkeypatch):
    for table in ("_BY_TYPE", "_BY_ARCHITECTURE", "_BY_GGUF_ARCH", "_PRESET_OWNER"):
        monkeypatch.setattr(registry, table, dict(getattr(registry, table)))
    return register(TOY)


def test_a_registered_family_works_end_to_end(toy_registered, tmp_path):
    """A Llama-shaped toy under its own name: the writer, the config parser and the loader find it through
    the registry alone, and it computes exactly what the same weights under Llama compute."""
    assert "ToyForCausalLM" in supported_architectures() and "toy-tiny" in preset_names()
    assert ModelConfig.from_dict(preset_hf_config("toy-tiny")).model_type == "toy"
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'toy'"):
        family_for_gguf_arch("toy")
    kwargs = dict(seed=4, attention_bias=True, mlp_bias=True)
    toy_dir = write_tiny_checkpoint(tmp_path / "toy", "ToyForCausalLM", **kwargs)
    llama_dir = write_tiny_checkpoint(tmp_path / "llama", "LlamaForCausalLM", **kwargs)
    logits, configs = [], []
    for d in (toy_dir, llama_dir):
        model, config = load_model(d, mode="fast")
        attn = ReferenceAttention(config.num_hidden_layers, config.softmax_scale)
        ids = torch.arange(5, 30, 2)
        with torch.no_grad():
            logits.append(model.compute_logits(model(ids, attn.begin([0], [len(ids)]), attn)))
        configs.append(config)
    assert [c.model_type for c in configs] == ["toy", "llama"]
    assert configs[0] == dataclasses.replace(configs[1], architecture="ToyForCausalLM")
    assert configs[0].qkv_bias and configs[0].o_bias and configs[0].mlp_bias
    assert torch.equal(logits[0], logits[1])
