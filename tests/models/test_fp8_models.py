"""FP8 models on CPU: HF block-scaled FP8 checkpoints (dense and MoE families) load with their scales fused
like their weights, `quantization="fp8"` quantizes a 16/32-bit checkpoint or a random model at load, the
engine generates in FP8 with a request's outputs the same alone and batched (bitwise), and unsupported
formats are refused naming the field."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from detinfer.engine import EngineConfig, LLMEngine
from detinfer.engine.testing import drive, mixed_requests
from detinfer.kernels.fp8_quant import FP8_DTYPE, dequantize_weight, quantize_weight_rows
from detinfer.models.config import ModelConfig
from detinfer.models.loader import load_model, load_state
from detinfer.models.random_weights import random_state
from detinfer.models.testing import tiny_config_dict, write_fp8_checkpoint, write_tiny_checkpoint
from detinfer.models.weight_sources import RandomWeights

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=True)
# name -> (architecture, write_tiny_checkpoint kwargs): dense and MoE families, sizes that are not
# multiples of the 128 block (q/k/v and gate/up parts end mid-block, so their fused scales must follow).
VARIANTS = {
    "llama": ("LlamaForCausalLM", dict(hidden_size=64, intermediate_size=96, num_attention_heads=2,
                                       num_key_value_heads=1, head_dim=64)),
    "qwen3-wide": ("Qwen3ForCausalLM", dict(hidden_size=160, intermediate_size=200, num_attention_heads=5,
                                            num_key_value_heads=1, head_dim=32)),
    "qwen2-bias": ("Qwen2ForCausalLM", dict(num_key_value_heads=1)),
    "qwen3-moe": ("Qwen3MoeForCausalLM", dict(head_dim=32, extra=dict(MOE, mlp_only_layers=[1]))),
    "mixtral": ("MixtralForCausalLM", dict(extra=dict(num_local_experts=4, num_experts_per_tok=2))),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (16-bit dir, FP8 dir written from it)."""
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for name, (arch, kwargs) in VARIANTS.items():
        src = write_tiny_checkpoint(root / name, arch, seed=5, dtype="bfloat16", **kwargs)
        out[name] = (src, write_fp8_checkpoint(src, root / f"{name}-fp8"))
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_fp8_checkpoint_loads_with_scales_fused_like_weights(checkpoints, name):
    src, fp8_dir = checkpoints[name]
    model, config = load_model(fp8_dir)
    ref, _ = load_model(src)
    assert config.quantization == "fp8"
    params, ref_params = dict(model.named_parameters()), dict(ref.named_parameters())
    fp8_params = [p for p in params if p + "_scale" in params]
    assert fp8_params and all(params[p].dtype == FP8_DTYPE for p in fp8_params)
    assert all(".router" not in p and "embed" not in p and "norm" not in p for p in fp8_params)
    for p in fp8_params:
        # each part (q/k/v, gate/up, expert) quantized in its own 128-blocks, fused after: dequantizing the
        # fused parameter gives the concatenation of the parts' dequantized values, each within fp8 error
        back = dequantize_weight(params[p], params[p + "_scale"])
        full = ref_params[p].float()
        assert bool(((back - full).abs() <= full.abs() * 2.0 ** -4 + 1e-3).all()), p
    for p, t in params.items():  # everything else is loaded as stored
        if p not in fp8_params and not p.endswith("_scale"):
            assert torch.equal(t, ref_params[p]), p


@pytest.mark.parametrize("name", ["qwen3-wide", "qwen3-moe"])
def test_quantize_at_load_equals_the_fp8_checkpoint_bitwise(checkpoints, name):
    """quantization="fp8" on the 16-bit checkpoint builds exactly the state the FP8 checkpoint of it loads."""
    src, fp8_dir = checkpoints[name]
    config = dataclasses.replace(ModelConfig.from_dir(src), quantization="fp8")
    quantized = load_state(src, config, torch.bfloat16, "cpu")
    stored = load_state(fp8_dir, ModelConfig.from_dir(fp8_dir), torch.bfloat16, "cpu")
    assert quantized.keys() == stored.keys()
    for k in quantized:
        a, b = quantized[k], stored[k]
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dtype == FP8_DTYPE else a,
                                                  b.view(torch.uint8) if b.dtype == FP8_DTYPE else b), k


def test_fp32_checkpoint_quantized_at_load(tmp_path):
    src = write_tiny_checkpoint(tmp_path / "f32", "LlamaForCausalLM", seed=2, dtype="float32")
    config = dataclasses.replace(ModelConfig.from_dir(src), quantization="fp8")
    state = load_state(src, config, torch.float32, "cpu")
    assert state["layers.0.mlp.down_proj.weight"].dtype == FP8_DTYPE
    assert state["layers.0.mlp.down_proj.weight_scale"].shape == (64, 1)


ENGINE = dict(max_num_batched_tokens=64, max_num_seqs=8, block_size=16, num_kv_blocks=64)


@pytest.mark.parametrize("name", ["llama", "qwen3-moe"])
def test_engine_fp8_alone_equals_batched_bitwise(checkpoints, name):
    _, fp8_dir = checkpoints[name]
    reqs = mixed_requests(max_tokens=6)
    engine = LLMEngine(fp8_dir, EngineConfig(**ENGINE), device="cpu")
    assert engine.model_config.quantization == "fp8"
    batched = drive(engine, reqs, max_steps=300)
    for _arrival, rid, prompt, params in reqs[:3]:
        alone = drive(LLMEngine(fp8_dir, EngineConfig(**ENGINE), device="cpu"), [(0, rid, prompt, params)],
                      max_steps=300)
        assert alone[rid] == batched[rid]
    assert all(sig.error is None and len(sig.completions[0].token_ids) == 6 for sig in batched.values())


def test_engine_quantization_flag_on_a_bf16_checkpoint_generates(checkpoints):
    src, fp8_dir = checkpoints["llama"]
    reqs = mixed_requests(3, max_tokens=6)
    flagged = drive(LLMEngine(src, EngineConfig(quantization="fp8", **ENGINE), device="cpu"), reqs, max_steps=300)
    stored = drive(LLMEngine(fp8_dir, EngineConfig(**ENGINE), device="cpu"), reqs, max_steps=300)
    plain = drive(LLMEngine(src, EngineConfig(**ENGINE), device="cpu"), reqs, max_steps=300)
    assert flagged == stored  # the same FP8 weights, however they were made
    assert flagged != plain  # and FP8 numerics, not the bf16 ones


def test_random_model_in_fp8_quantizes_the_drawn_weights():
    config = ModelConfig.from_dict(tiny_config_dict("Qwen3ForCausalLM", head_dim=32, dtype="bfloat16"))
    plain = random_state(config, seed=4, dtype=torch.bfloat16, device="cpu")
    fp8 = random_state(dataclasses.replace(config, quantization="fp8"), seed=4, dtype=torch.bfloat16, device="cpu")
    q, s = quantize_weight_rows(plain["layers.1.self_attn.qkv_proj.weight"])
    assert torch.equal(fp8["layers.1.self_attn.qkv_proj.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(fp8["layers.1.self_attn.qkv_proj.weight_scale"], s)
    assert torch.equal(fp8["embed_tokens"], plain["embed_tokens"])
    engine = LLMEngine.from_weights(RandomWeights(4, torch.bfloat16), config,
                                    EngineConfig(quantization="fp8", **ENGINE), device="cpu")
    assert engine.model_config.quantization == "fp8"
    out = drive(engine, mixed_requests(2, max_tokens=6), max_steps=300)
    assert set(out) == {"r0", "r1"}


# -- errors ----------------------------------------------------------------------------------------------
def _with_quant(src, tmp_path, **changes):
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"].update(changes)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return ModelConfig.from_dict(cfg)


@pytest.mark.parametrize("changes,match", [
    (dict(quant_method="gptq"), "quant_method 'gptq'"),
    (dict(weight_block_size=[64, 64]), r"weight_block_size \[64, 64\]"),
    (dict(weight_block_size=None), "weight_block_size None"),
    (dict(activation_scheme="static"), "activation_scheme 'static'"),
    (dict(fmt="e5m2"), "fmt 'e5m2'"),
])
def test_unsupported_quantization_configs_are_named(checkpoints, tmp_path, changes, match):
    with pytest.raises(ValueError, match=match):
        _with_quant(checkpoints["llama"][1], tmp_path, **changes)


def test_missing_scales_and_e5m2_weights_are_named(checkpoints, tmp_path):
    src, fp8_dir = checkpoints["llama"]
    missing = write_fp8_checkpoint(src, tmp_path / "missing",
                                   skip=("model.layers.0.self_attn.k_proj.weight_scale_inv",))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.0\.self_attn\.k_proj\.weight_scale_inv"):
        load_model(missing)
    weights = load_file(str(fp8_dir / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    weights[name] = weights[name].float().to(torch.float8_e5m2)
    e5m2 = tmp_path / "e5m2"
    e5m2.mkdir()
    for f in fp8_dir.iterdir():
        if f.suffix != ".safetensors":
            (e5m2 / f.name).write_bytes(f.read_bytes())
    save_file(weights, str(e5m2 / "model.safetensors"))
    with pytest.raises(ValueError, match=r"up_proj\.weight is stored as F8_E5M2.*e4m3"):
        load_model(e5m2)


def test_fp8_weights_without_a_quantization_config_are_refused(checkpoints, tmp_path):
    _, fp8_dir = checkpoints["llama"]
    cfg = json.loads((fp8_dir / "config.json").read_text())
    del cfg["quantization_config"]
    for f in fp8_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"stored as F8_E4M3.*quantization_config"):
        load_model(tmp_path)


def test_engine_from_model_checks_the_quantization(checkpoints):
    model, config = load_model(checkpoints["llama"][0])
    with pytest.raises(ValueError, match=r"quantization 'fp8' was asked for but the model was built with "
                                         r"quantization None"):
        LLMEngine.from_model(model, config, EngineConfig(quantization="fp8", **ENGINE))


def test_engine_config_and_parallelism_errors(checkpoints):
    with pytest.raises(ValueError, match=r"quantization must be one of \('auto', 'fp8'\)"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match=r"FP8 needs whole 128-column scale blocks per row-parallel slice"):
        LLMEngine(checkpoints["llama"][1], EngineConfig(tp_invariant_reduction=True, **ENGINE), device="cpu")


def test_weight_reload_into_an_fp8_engine_is_refused(checkpoints):
    from detinfer.engine.admin import load_weights

    src, fp8_dir = checkpoints["llama"]
    engine = LLMEngine(fp8_dir, EngineConfig(**ENGINE), device="cpu")
    with pytest.raises(ValueError, match="running fp8 engine is not supported"):
        load_weights(engine, src)


def test_training_an_fp8_model_is_refused(checkpoints):
    from detinfer.train.model import TrainableModel

    model, _ = load_model(checkpoints["llama"][1])
    with pytest.raises(ValueError, match=r"training runs on 16/32-bit weights only.*\(fp8\)"):
        TrainableModel(model)


# -- tensor-parallel sharding of FP8 scales (the loader's slices; the engine itself runs FP8 at TP=1) ---------
TP_SHAPES = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, vocab_size=320)


@pytest.mark.parametrize("arch,extra", [("Qwen3ForCausalLM", {}),
                                        ("Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2,
                                                                     moe_intermediate_size=64))])
def test_sharded_fp8_load_slices_scales_with_their_weights(tmp_path, arch, extra):
    from detinfer.models.sharding import shard_spec, take_shard

    src = write_tiny_checkpoint(tmp_path / "src", arch, seed=1, dtype="bfloat16", extra=extra, **TP_SHAPES)
    fp8_dir = write_fp8_checkpoint(src, tmp_path / "fp8")
    config = ModelConfig.from_dir(fp8_dir)
    full = load_state(fp8_dir, config, torch.bfloat16, "cpu")
    for rank in range(2):
        shard = load_state(fp8_dir, config, torch.bfloat16, "cpu", rank=rank, size=2)
        for name, t in full.items():
            want = take_shard(t, shard_spec(name, tuple(t.shape), config, rank, 2))
            got = shard[name]
            as_bits = (lambda v: v.view(torch.uint8)) if t.dtype == FP8_DTYPE else (lambda v: v)
            assert got.shape == want.shape and torch.equal(as_bits(got), as_bits(want)), (rank, name)
    # row-parallel scales are sliced by whole 128-column blocks: o_proj's K = 256 splits into 2 x 128
    assert shard["layers.0.self_attn.o_proj.weight_scale"].shape == (256, 1)


def test_row_parallel_scale_shards_must_hold_whole_blocks():
    from detinfer.models.sharding import shard_spec

    cfg = dataclasses.replace(ModelConfig.from_dict(tiny_config_dict("LlamaForCausalLM")), quantization="fp8")
    with pytest.raises(ValueError, match=r"whole 128-column scale blocks"):
        shard_spec("layers.0.mlp.down_proj.weight_scale", (64, 1), cfg, 0, 2)


def test_engine_with_tiled_fp8_weights_gives_the_same_bits(tmp_path, monkeypatch):
    """The engine lays its FP8 linears out for the backend's kernel (models/fp8.py `lay_out_fp8_linears`: tiled
    for the deterministic CUDA kernel); on CPU the reference reads [N, K], so tiling is forced here: every dense
    FP8 linear tiled, the same tokens and logprobs, the same weights digest."""
    from detinfer.engine.admin import weights_sha256
    from detinfer.kernels.fp8_quant import can_tile, is_tiled, tile_weight
    from detinfer.ops import Ops

    src = write_tiny_checkpoint(tmp_path / "q3", "Qwen3ForCausalLM", seed=3, dtype="bfloat16", hidden_size=128,
                                intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    reqs = mixed_requests(4, max_tokens=6)
    config = EngineConfig(quantization="fp8", **ENGINE)
    plain_engine = LLMEngine(src, config, device="cpu")
    assert not any(is_tiled(p) for p in plain_engine.runner.model.parameters())  # CPU: [N, K]
    plain = drive(plain_engine, reqs, max_steps=300)
    monkeypatch.setattr(Ops, "fp8_weight_layout", lambda self, w: tile_weight(w) if can_tile(w) else w)
    tiled_engine = LLMEngine(src, config, device="cpu")
    tiled = [n for n, p in tiled_engine.runner.model.named_parameters() if is_tiled(p)]
    assert {n.split(".")[-2] for n in tiled} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert drive(tiled_engine, reqs, max_steps=300) == plain
    assert weights_sha256(tiled_engine.runner.model) == weights_sha256(plain_engine.runner.model)
