"""FP8 checkpoints that leave some linears unquantized (quantization_config `modules_to_not_convert`, or vLLM's
`ignored_layers`): the listed modules load as stored, in the model dtype, and run the 16-bit linear; the rest
stay FP8; the model matches a float64 reference of its weights; the engine's outputs are the same alone and
batched (bitwise); a fused projection listed in part, listed experts and malformed lists are refused, named."""

import dataclasses
import json

import pytest
import torch

from detinfer.engine import EngineConfig, LLMEngine
from detinfer.engine.testing import drive, mixed_requests
from detinfer.kernels.fp8_quant import BLOCK, FP8_DTYPE, QuantizedRows, dequantize_weight, quantize_activations
from detinfer.models import ReferenceAttention, fp8
from detinfer.models.config import ModelConfig
from detinfer.models.loader import load_model, model_from_state
from detinfer.models.testing import write_fp8_checkpoint, write_tiny_checkpoint
from detinfer.ops import Ops

QWEN3 = dict(hidden_size=160, intermediate_size=200, num_attention_heads=5, num_key_value_heads=1, head_dim=32)
MOE = dict(head_dim=32, extra=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40,
                                   norm_topk_prob=True, mlp_only_layers=[1]))
# name -> (architecture, checkpoint kwargs, quantization_config additions, Transformer linears left 16-bit)
CASES = {
    "hf-names": ("Qwen3ForCausalLM", QWEN3,
                 dict(modules_to_not_convert=["lm_head", "model.layers.1.mlp", "model.layers.0.self_attn.o_proj"]),
                 {"layers.1.mlp.gate_up_proj", "layers.1.mlp.down_proj", "layers.0.self_attn.o_proj"}),
    "vllm-regex": ("LlamaForCausalLM", dict(hidden_size=64, intermediate_size=96, num_attention_heads=2,
                                            num_key_value_heads=1, head_dim=64),
                   dict(ignored_layers=["model.layers.*.self_attn", "down_proj"]),
                   {"layers.0.self_attn.qkv_proj", "layers.1.self_attn.qkv_proj", "layers.0.self_attn.o_proj",
                    "layers.1.self_attn.o_proj", "layers.0.mlp.down_proj", "layers.1.mlp.down_proj"}),
    # Qwen3-MoE FP8 checkpoints list their routers (`mlp.gate`, 16-bit here anyway): not `mlp.gate_up_proj`
    "moe": ("Qwen3MoeForCausalLM", MOE,
            dict(modules_to_not_convert=["lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate_proj",
                                         "model.layers.1.mlp.up_proj"]),
            {"layers.1.mlp.gate_up_proj"}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (16-bit source dir, FP8 dir leaving the case's modules unquantized)."""
    root = tmp_path_factory.mktemp("fp8_unquantized")
    out = {}
    for name, (arch, kwargs, listed, _) in CASES.items():
        src = write_tiny_checkpoint(root / name, arch, seed=8, dtype="float32", **kwargs)
        out[name] = (src, write_fp8_checkpoint(src, root / f"{name}-fp8",
                                               quantization_config={**fp8.quantization_config_json(), **listed}))
    return out


def _linears(model):
    from detinfer.models.transformer import Linear

    return {n: m for n, m in model.named_modules() if isinstance(m, Linear)}


@pytest.mark.parametrize("name", list(CASES))
def test_listed_modules_load_as_stored_and_the_rest_stay_fp8(checkpoints, name):
    src, fp8_dir = checkpoints[name]
    model, config = load_model(fp8_dir)
    ref, _ = load_model(src)
    assert config.quantization == "fp8" and config.fp8_unquantized
    want16 = CASES[name][3]
    ref_linears = _linears(ref)
    for n, linear in _linears(model).items():
        if n in want16:
            assert linear.weight_scale is None and linear.weight.dtype == torch.float32, n
            assert torch.equal(linear.weight, ref_linears[n].weight), n  # as stored, not quantized
        else:
            assert linear.weight.dtype == FP8_DTYPE and linear.weight_scale is not None, n
    for n, m in model.named_modules():  # experts stay FP8
        if hasattr(m, "gate_up_proj_scale"):
            assert m.gate_up_proj.dtype == FP8_DTYPE and m.gate_up_proj_scale is not None, n


def test_listed_linear_runs_the_16bit_linear(checkpoints):
    model, _ = load_model(checkpoints["hf-names"][1])
    ops = model.ops
    x = torch.randn(7, 160, generator=torch.Generator().manual_seed(1))
    o_proj = model.layers[0].self_attn.o_proj
    assert torch.equal(o_proj(x, ops), ops.linear(x, o_proj.weight))
    fp8_o = model.layers[1].self_attn.o_proj
    assert torch.equal(fp8_o(x, ops), ops.linear_fp8(x, fp8_o.weight, fp8_o.weight_scale))


@dataclasses.dataclass(frozen=True)
class _Float64Fp8Ops(Ops):
    """float64 numerics whose FP8 linear is the exact float64 of its quantized operands (the activations
    quantized per token per 128-group, as the FP8 linear does): the model's FP8 arithmetic without roundings."""

    def linear_fp8(self, x, weight, weight_scale, bias=None):
        k = x.shape[-1]  # x may come quantized (a norm or SiLU*mul feeding only FP8 linears: ops.rms_norm_fp8)
        x_q, sx = (x.q, x.scale) if isinstance(x, QuantizedRows) else quantize_activations(x.reshape(-1, k))
        xd = x_q.double() * sx.double().repeat_interleave(BLOCK, -1)[:, :k]
        y = xd @ dequantize_weight(weight, weight_scale).double().t() + (0 if bias is None else bias.double())
        return y.reshape(*x.shape[:-1], -1)


def _float64_reference(model, config):
    """The same weights (FP8 ones as they are, the rest in float64) under `_Float64Fp8Ops`."""
    state = {n: t if t.dtype == FP8_DTYPE or n.endswith(fp8.SCALE_SUFFIX) else t.double()
             for n, t in model.named_parameters()}
    return model_from_state(config, _Float64Fp8Ops("deterministic", "cpu", torch.float64, head_dim=config.head_dim),
                            state)


@pytest.mark.parametrize("name", list(CASES))
def test_outputs_match_the_float64_reference(checkpoints, name):
    model, config = load_model(checkpoints[name][1])
    ref = _float64_reference(model, config)
    ids = torch.randint(3, config.vocab_size, (23,), generator=torch.Generator().manual_seed(2))

    def logits(m):
        attn = ReferenceAttention(config.num_hidden_layers, config.softmax_scale)
        return m.compute_logits(m(ids, attn.begin(["s"], [23]), attn)).double()

    got, want = logits(model), logits(ref)
    # fp32 roundings only (the model runs fp32; its listed linears in fp32 too): had a listed module been
    # quantized after all, its fp8 weight error (~2^-5 relative) would show here a thousand times over
    assert bool(((got - want).norm(dim=-1) <= 1e-4 * want.norm(dim=-1)).all())


ENGINE = dict(max_num_batched_tokens=64, max_num_seqs=8, block_size=16, num_kv_blocks=64)


@pytest.mark.parametrize("name", ["hf-names", "moe"])
def test_engine_alone_equals_batched_bitwise(checkpoints, name):
    fp8_dir = checkpoints[name][1]
    reqs = mixed_requests(max_tokens=5)
    batched = drive(LLMEngine(fp8_dir, EngineConfig(**ENGINE), device="cpu"), reqs, max_steps=300)
    for _arrival, rid, prompt, params in reqs[:3]:
        alone = drive(LLMEngine(fp8_dir, EngineConfig(**ENGINE), device="cpu"), [(0, rid, prompt, params)],
                      max_steps=300)
        assert alone[rid] == batched[rid]
    assert all(sig.error is None and len(sig.completions[0].token_ids) == 5 for sig in batched.values())


# -- the matching rule and refusals -------------------------------------------------------------------------
@pytest.mark.parametrize("module,patterns,listed", [
    ("model.layers.1.mlp.down_proj", ["model.layers.1"], True),
    ("model.layers.11.mlp.down_proj", ["model.layers.1"], False),  # a prefix ends on a module boundary
    ("model.layers.11.mlp.down_proj", ["model.layers.*.mlp"], True),  # a regex
    ("model.layers.3.mlp.gate_proj", ["model.layers.3.mlp.gate"], False),  # the router's name, not gate_proj
    ("model.layers.3.mlp.gate", ["mlp.gate"], True),  # a suffix
    ("lm_head", ["lm_head"], True),
    ("model.layers.0.self_attn.q_proj", [], False),
])
def test_module_listed_follows_the_hf_rule(module, patterns, listed):
    assert fp8.module_listed(module, patterns) is listed


def test_both_spellings_merge_and_other_configs_list_nothing():
    q = dict(fp8.quantization_config_json(), modules_to_not_convert=["lm_head", "a"], ignored_layers=["a", "b"])
    assert fp8.parse_unquantized_modules({"quantization_config": q}) == ("lm_head", "a", "b")
    assert fp8.parse_unquantized_modules({}) == ()
    assert fp8.parse_unquantized_modules({"quantization_config": dict(q, modules_to_not_convert=None)}) == ("a", "b")


def _rewrite_config(src_fp8, dst, **listed):
    dst.mkdir()
    for f in src_fp8.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {**fp8.quantization_config_json(), **listed}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("listed,match", [
    (dict(modules_to_not_convert=["model.layers.0.self_attn.v_proj"]),
     r"model\.layers\.0\.self_attn\.v_proj listed but not model\.layers\.0\.self_attn\.q_proj, "
     r"model\.layers\.0\.self_attn\.k_proj: they run fused as one qkv_proj"),
    (dict(ignored_layers=["model.layers.1.mlp.up_proj"]), r"up_proj listed but not .*gate_proj.*gate_up_proj"),
])
def test_a_fused_projection_listed_in_part_is_refused(checkpoints, tmp_path, listed, match):
    bad = _rewrite_config(checkpoints["hf-names"][1], tmp_path / "bad", **listed)
    with pytest.raises(ValueError, match=match):
        load_model(bad)


def test_listed_experts_are_refused(checkpoints, tmp_path):
    bad = _rewrite_config(checkpoints["moe"][1], tmp_path / "bad",
                          modules_to_not_convert=["model.layers.0.mlp.experts"])
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.0\.gate_proj.*unquantized MoE experts"):
        load_model(bad)


@pytest.mark.parametrize("value,match", [
    ("lm_head", r"modules_to_not_convert must be a list of module names, got 'lm_head'"),
    ([""], r"modules_to_not_convert must be a list"),
    (["model.layers.(0"], r"entry 'model\.layers\.\(0' is not a valid module pattern"),
])
def test_malformed_lists_are_named(value, match):
    q = dict(fp8.quantization_config_json(), modules_to_not_convert=value)
    with pytest.raises(ValueError, match=match):
        fp8.parse_unquantized_modules({"quantization_config": q})


def test_a_listed_module_stored_as_fp8_is_refused(checkpoints, tmp_path):
    """The config says o_proj is unquantized but the file holds it in FP8 (with scales): named, not cast."""
    src, fp8_dir = checkpoints["hf-names"]
    plain = write_fp8_checkpoint(src, tmp_path / "plain")
    bad = _rewrite_config(plain, tmp_path / "bad", modules_to_not_convert=["model.layers.0.self_attn.o_proj"])
    with pytest.raises(ValueError, match=r"o_proj\.weight is stored as F8_E4M3.*|unexpected tensors: .*o_proj"):
        load_model(bad)
    assert ModelConfig.from_dir(bad).fp8_unquantized == ("model.layers.0.self_attn.o_proj",)
