"""load_model: sharded checkpoints, dtype conversion, and a clear error for each way a directory can be
wrong."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from detinfer.models import load_model
from detinfer.models.testing import write_tiny_checkpoint


@pytest.fixture
def ckpt(tmp_path):
    return write_tiny_checkpoint(tmp_path / "m", "Qwen2ForCausalLM", num_hidden_layers=1)


def _rewrite_weights(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_sharded_checkpoint_loads_the_same_weights(tmp_path):
    single = write_tiny_checkpoint(tmp_path / "one", seed=3)
    sharded = write_tiny_checkpoint(tmp_path / "three", seed=3, num_shards=3)
    assert len(list(sharded.glob("model-*-of-00003.safetensors"))) == 3
    a, _ = load_model(single, mode="fast")
    b, _ = load_model(sharded, mode="fast")
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_fused_weights_are_hf_weights_concatenated(ckpt):
    model, _ = load_model(ckpt, mode="fast")
    hf = load_file(ckpt / "model.safetensors")
    p = "model.layers.0."
    qkv = torch.cat([hf[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(model.layers[0].self_attn.qkv_proj.weight, qkv)
    assert torch.equal(model.layers[0].self_attn.qkv_proj.bias,
                       torch.cat([hf[p + f"self_attn.{n}_proj.bias"] for n in "qkv"]))
    assert torch.equal(model.layers[0].mlp.gate_up_proj.weight,
                       torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]]))
    assert model.lm_head is not None and torch.equal(model.lm_head, hf["lm_head.weight"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, "float16", None])
def test_dtype_conversion(ckpt, dtype):
    model, config = load_model(ckpt, dtype=dtype, mode="fast")
    want = {None: torch.float32, "float16": torch.float16}.get(dtype, dtype)
    assert {p.dtype for p in model.parameters()} == {want}
    assert model.rotary.inv_freq.dtype == torch.float32  # rotary angles always in fp32


def test_dtype_auto_is_decided_with_the_device(ckpt, monkeypatch):
    """load_model and LLMEngine resolve "auto" with the one rule (dtypes.resolve_dtype) for the device they
    load on: a bf16 checkpoint stays bf16 on CUDA (it used to become fp32 whatever the device)."""
    import detinfer.models.loader as loader
    from detinfer.dtypes import resolve_dtype

    bf16 = write_tiny_checkpoint(ckpt.parent / "bf16", dtype="bfloat16")
    assert load_model(bf16, "auto", device="cpu")[0].embed_tokens.dtype == torch.float32
    loaded = {}
    monkeypatch.setattr(loader, "load_state", lambda d, c, dtype, device: loaded.setdefault("dtype", dtype))
    monkeypatch.setattr(loader, "model_from_state", lambda config, ops, state: None)
    loader.load_model(bf16, "auto", device="cuda")  # nothing is allocated: load_state is stubbed
    assert loaded["dtype"] == resolve_dtype("auto", torch.bfloat16, "cuda") == torch.bfloat16


def test_tied_checkpoint_may_carry_a_redundant_lm_head(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "t", tie_word_embeddings=True)
    _rewrite_weights(path, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    model, _ = load_model(path, mode="fast")
    assert model.lm_head is None


def test_missing_files(tmp_path, ckpt):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")
    (ckpt / "model.safetensors").rename(ckpt / "weights.bin")
    with pytest.raises(FileNotFoundError, match=r"no model.safetensors.*found weights.bin"):
        load_model(ckpt)
    (ckpt / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(ckpt)


def test_missing_shard(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "s", num_shards=2)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="missing.*model-00002-of-00002.safetensors"):
        load_model(path)


def test_unsupported_architecture(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(ckpt)


def test_missing_unexpected_and_misshapen_tensors_are_all_reported(ckpt):
    def edit(t):
        del t["model.layers.0.self_attn.k_proj.bias"]
        t["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
        t["model.norm.weight"] = torch.zeros(3)

    _rewrite_weights(ckpt, edit)
    with pytest.raises(ValueError) as err:
        load_model(ckpt)
    msg = str(err.value)
    assert "missing tensors: model.layers.0.self_attn.k_proj.bias" in msg
    assert "unexpected tensors: model.layers.0.self_attn.extra.weight" in msg
    assert "model.norm.weight has shape [3], config implies [64]" in msg


def test_untied_checkpoint_without_lm_head(ckpt):
    _rewrite_weights(ckpt, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match="missing tensors: lm_head.weight"):
        load_model(ckpt)


def test_quantized_or_integer_stored_tensors_are_refused(ckpt):
    _rewrite_weights(ckpt, lambda t: t.__setitem__("model.norm.weight", torch.ones(64, dtype=torch.int8)))
    with pytest.raises(ValueError, match="model.norm.weight is stored as I8"):
        load_model(ckpt)


@pytest.mark.parametrize("dtype", ["int8", torch.int32, "fp32"])
def test_unsupported_target_dtype(ckpt, dtype):
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(ckpt, dtype=dtype)


def test_ignorable_rotary_buffers_in_old_checkpoints(tmp_path):
    src = write_tiny_checkpoint(tmp_path / "a")
    path = shutil.copytree(src, tmp_path / "b")
    _rewrite_weights(path, lambda t: t.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8)))
    a, _ = load_model(src, mode="fast")
    b, _ = load_model(path, mode="fast")
    assert torch.equal(a.rotary.inv_freq, b.rotary.inv_freq)
