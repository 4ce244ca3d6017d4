"""Export of trained weights as a Hugging Face checkpoint: the un-fusing inverts the loader's fusing bit for
bit on every family layout (dense, biases, tied and untied, MoE); after RL steps on stories260k the exported
directory holds exactly the trained bits (loaded back by detinfer's loader), keeps the embeddings tied, carries
the tokenizer, and transformers computes the same logits from it as detinfer's engine does."""

import json

import pytest
import torch
from safetensors.torch import load_file

from detinfer.models import load_model
from detinfer.models.config import ModelConfig
from detinfer.models.loader import load_state
from detinfer.models.testing import write_tiny_checkpoint
from detinfer.rl import RLConfig, run_arm
from detinfer.rl.export import export_checkpoint, export_hf, hf_state_dict
from detinfer.rl.export import main as export_main

CFG = RLConfig(task="emit-token", steps=2, prompts_per_step=3, n_samples=4, max_tokens=8, lr=3e-3)

LAYOUTS = {
    "llama-untied-biases": ("LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True, num_key_value_heads=4)),
    "qwen2-tied-qkv-bias": ("Qwen2ForCausalLM", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen3-qk-norm": ("Qwen3ForCausalLM", dict(head_dim=32)),
    "qwen3-moe": ("Qwen3MoeForCausalLM", dict(num_hidden_layers=3, extra=dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True,
        decoder_sparse_step=2))),
    "mixtral": ("MixtralForCausalLM", dict(intermediate_size=40)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_unfusing_inverts_the_loaders_fusing_bitwise(tmp_path, layout):
    arch, kw = LAYOUTS[layout]
    path = write_tiny_checkpoint(tmp_path / layout, arch, seed=3, **kw)
    config = ModelConfig.from_dir(path)
    state = load_state(path, config, torch.float32, "cpu")
    assert any("qkv_proj" in n for n in state)  # fused on load: the export must split
    exported = hf_state_dict(config, state)
    stored = load_file(str(path / "model.safetensors"))
    assert sorted(exported) == sorted(config.family.hf_weight_shapes(config))
    for name, tensor in exported.items():
        assert torch.equal(tensor, stored[name].to(torch.float32)), name


def test_unfusing_refuses_weights_of_another_model(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "m", "LlamaForCausalLM")
    config = ModelConfig.from_dir(path)
    state = load_state(path, config, torch.float32, "cpu")
    del state["norm.weight"]
    with pytest.raises(ValueError, match=r"missing \['norm.weight'\]"):
        hf_state_dict(config, state)


@pytest.fixture(scope="module")
def trained(stories_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("rl-export")
    history = run_arm(stories_dir, CFG, "deterministic", out, device="cpu", progress=False, max_model_len=64,
                      log=None, export_hf=True)
    return out, history


def test_exported_weights_are_the_trained_bits(trained, stories_dir):
    out, history = trained
    hf_dir = out / "deterministic" / "hf"
    trained_weights = load_file(str(out / "deterministic" / "checkpoint" / "weights.safetensors"))
    config = ModelConfig.from_dir(hf_dir)
    reloaded = load_state(hf_dir, config, torch.float32, "cpu")
    assert sorted(reloaded) == sorted(trained_weights)
    for name, tensor in reloaded.items():
        assert torch.equal(tensor, trained_weights[name]), name
    original = load_state(stories_dir, config, torch.float32, "cpu")
    assert any(not torch.equal(original[n], reloaded[n]) for n in reloaded)  # training changed the weights
    stored = load_file(str(hf_dir / "model.safetensors"))
    assert "lm_head.weight" not in stored and config.tie_word_embeddings  # tied embeddings stay tied
    assert "model.layers.0.self_attn.q_proj.weight" in stored and "model.layers.0.mlp.up_proj.weight" in stored
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (hf_dir / name).read_bytes() == (stories_dir / name).read_bytes()
    assert json.loads((hf_dir / "config.json").read_text())["torch_dtype"] == "float32"


def test_transformers_computes_detinfers_logits_from_the_export(trained):
    from transformers import AutoModelForCausalLM

    from detinfer.models import ReferenceAttention

    hf_dir = trained[0] / "deterministic" / "hf"
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32).eval()
    model, config = load_model(hf_dir, dtype=torch.float32, mode="deterministic")
    ids = torch.randint(0, config.vocab_size, (23,), generator=torch.Generator().manual_seed(5))
    attn = ReferenceAttention(config.num_hidden_layers, config.softmax_scale)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        ours = model.compute_logits(model(ids, attn.begin(["s"], [len(ids)]), attn))
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_export_command_writes_the_checkpoints_weights(trained, stories_dir, tmp_path, capsys):
    ckpt = trained[0] / "deterministic" / "checkpoint"
    assert export_main([str(ckpt), str(tmp_path / "x"), "--model", str(stories_dir)]) == 0
    a = load_file(str(tmp_path / "x" / "model.safetensors"))
    b = load_file(str(trained[0] / "deterministic" / "hf" / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)
    assert export_main([str(ckpt), str(tmp_path / "x"), "--model", str(stories_dir)]) == 2  # not empty
    assert "not empty" in capsys.readouterr().err
    export_checkpoint(ckpt, tmp_path / "x", stories_dir, dtype=torch.bfloat16, overwrite=True)
    assert json.loads((tmp_path / "x" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load_file(str(tmp_path / "x" / "model.safetensors"))["model.norm.weight"].dtype == torch.bfloat16


def test_export_refuses_the_source_directory_and_a_missing_config(trained, stories_dir, tmp_path):
    weights = load_file(str(trained[0] / "deterministic" / "checkpoint" / "weights.safetensors"))
    with pytest.raises(ValueError, match="source model directory"):
        export_hf(weights, stories_dir, stories_dir)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        export_hf(weights, tmp_path / "y", tmp_path)


def test_16_bit_engine_exports_fp32_masters_or_exactly_the_engines_bf16_weights(stories_dir, tmp_path):
    from detinfer.rl import GRPOTrainer

    trainer = GRPOTrainer(stories_dir, CFG.replace(dtype="bfloat16"), "deterministic", device="cpu",
                          max_model_len=64)
    try:
        trainer.step()
        engine = dict(trainer.engine.runner.model.state_dict())
        masters = dict(trainer.named_parameters())
        assert engine["norm.weight"].dtype == torch.bfloat16 and masters["norm.weight"].dtype == torch.float32
        for dtype, expected in ((None, masters), (torch.bfloat16, engine)):
            out = export_hf(trainer, tmp_path / str(dtype), stories_dir, dtype=dtype)
            config = ModelConfig.from_dir(out)
            reloaded = load_state(out, config, expected["norm.weight"].dtype, "cpu")
            assert sorted(reloaded) == sorted(masters)
            for name, tensor in reloaded.items():
                assert torch.equal(tensor, expected[name].detach()), (dtype, name)
    finally:
        trainer.close()
