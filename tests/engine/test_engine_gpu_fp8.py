"""FP8 engine on the GPU (Hopper: fp8 tensor cores): a request's outputs are the same bits alone and among
others (deterministic mode, the Triton FP8 kernel), with CUDA graphs on and off, for a dense and an MoE
model quantized at load (`quantization="fp8"`), and an FP8 checkpoint leaving some linears unquantized
(`modules_to_not_convert`); fast mode runs. Skipped (shown as skipped) without CUDA."""

import gc

import pytest
import torch

from detinfer.engine import EngineConfig, LLMEngine, SamplingParams
from detinfer.engine.testing import drive
from detinfer.models import fp8
from detinfer.models.testing import write_fp8_checkpoint, write_tiny_checkpoint

pytestmark = pytest.mark.gpu
VOCAB = 2048
ENGINE = dict(max_num_batched_tokens=512, max_num_seqs=16, block_size=16, num_kv_blocks=256, quantization="fp8")


@pytest.fixture(scope="module", params=["dense", "moe", "dense-partly-16bit"])
def model_dir(request, tmp_path_factory):
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tl.dot needs sm89+")
    common = dict(seed=13, vocab_size=VOCAB, hidden_size=512, num_hidden_layers=3, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=128, max_position_embeddings=1024, dtype="bfloat16")
    root = tmp_path_factory.mktemp("engine_gpu_fp8")
    if request.param == "dense":
        # down_proj's K of 64 scale blocks: two K runs (kernels/fp8_linear.py), in two programs at decode and one
        # at prefill; 8192 / 8 tp_invariant chunks = 1024 columns: whole 128-column FP8 scale blocks
        return write_tiny_checkpoint(root / "qwen3", "Qwen3ForCausalLM", intermediate_size=8192, **common)
    if request.param == "dense-partly-16bit":  # an FP8 checkpoint: layer 1's MLP and layer 0's attention 16-bit
        src = write_tiny_checkpoint(root / "qwen3-src", "Qwen3ForCausalLM", intermediate_size=8192, **common)
        listed = ["lm_head", "model.layers.1.mlp", "model.layers.0.self_attn"]
        return write_fp8_checkpoint(src, root / "qwen3-partial",
                                    quantization_config=dict(fp8.quantization_config_json(),
                                                             modules_to_not_convert=listed))
    return write_tiny_checkpoint(root / "qwen3moe", "Qwen3MoeForCausalLM", intermediate_size=1408, **common,
                                 extra=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=384))


def _requests(n=12):
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        length = int(torch.randint(4, 300, (1,), generator=g))
        prompt = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        params = SamplingParams(max_tokens=12, temperature=0.0 if i % 2 else 0.7, seed=i, logprobs=3,
                                ignore_eos=True)
        out.append((i // 3, f"r{i}", prompt, params))
    return out


def _run(model_dir, requests, **kw):
    gc.collect()
    engine = LLMEngine(model_dir, EngineConfig(**{**ENGINE, **kw}), device="cuda")
    try:
        return drive(engine, requests, max_steps=5000)
    finally:
        engine.close()


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_fp8_alone_equals_batched_bitwise(model_dir, enforce_eager):
    reqs = _requests()
    batched = _run(model_dir, reqs, enforce_eager=enforce_eager)
    for _, rid, prompt, params in reqs[:4]:
        alone = _run(model_dir, [(0, rid, prompt, params)], enforce_eager=enforce_eager)
        assert alone[rid] == batched[rid], rid


def test_fp8_graphs_equal_eager_bitwise(model_dir):
    reqs = _requests(6)
    assert _run(model_dir, reqs, enforce_eager=True) == _run(model_dir, reqs, enforce_eager=False)


def test_fp8_fast_mode_runs(model_dir):
    out = _run(model_dir, _requests(4), mode="fast")
    assert all(sig.error is None and len(sig.completions[0].token_ids) == 12 for sig in out.values())


def test_fp8_tp2_equals_tp1_with_invariant_reduction(model_dir):
    """NCCL, 2 GPUs: FP8 row-parallel partials per fixed K chunk give TP=1's bits at TP=2."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"tensor parallelism needs >= 2 GPUs, {torch.cuda.device_count()} visible")
    reqs = _requests(6)
    one = _run(model_dir, reqs, tp_invariant_reduction=True)
    two = _run(model_dir, reqs, tp_invariant_reduction=True, tensor_parallel_size=2)
    assert one == two


def test_fp8_quantized_hand_offs_change_no_bit(model_dir, monkeypatch):
    """The RMSNorm, SiLU*mul and attention kernels quantizing the rows they hand to FP8 linears
    (kernels/fp8_act_quant.py, kernels/attention_quant.py; counted) vs every FP8 linear quantizing its own
    input: the same tokens and logprobs, graphs on."""
    from detinfer.kernels import attention_quant, fp8_act_quant
    from detinfer.models.transformer import Attention, DecoderLayer
    from detinfer.ops import Ops

    reqs, calls = _requests(6), []
    norm, silu_q, silu = fp8_act_quant.rms_norm_quantized, fp8_act_quant.silu_mul_quantized, Ops.linear_fp8_silu_mul
    attend = attention_quant.paged_attention_quantized
    monkeypatch.setattr(fp8_act_quant, "rms_norm_quantized", lambda *a: calls.append("norm") or norm(*a))
    monkeypatch.setattr(fp8_act_quant, "silu_mul_quantized", lambda *a: calls.append("silu") or silu_q(*a))
    monkeypatch.setattr(attention_quant, "paged_attention_quantized",
                        lambda *a, **k: calls.append("attention") or attend(*a, **k))
    fused = _run(model_dir, reqs)
    assert "norm" in calls and ("silu" in calls or "moe" in model_dir.name)  # an MoE layer has no SiLU*mul hand-off
    assert "attention" in calls  # head_dim 128: one head is one activation group
    monkeypatch.setattr(DecoderLayer, "fp8_inputs", lambda self: (False, False))
    monkeypatch.setattr(Attention, "o_proj_fp8", lambda self: False)
    monkeypatch.setattr(Ops, "linear_fp8_silu_mul",
                        lambda self, x, w, s, b=None, quantized=False: silu(self, x, w, s, b))
    calls.clear()
    assert _run(model_dir, reqs) == fused
    assert not calls


def test_fp8_tiled_weights_change_no_bit(model_dir, monkeypatch):
    """A deterministic CUDA engine holds its dense FP8 linears tiled (models/fp8.py; the kernel's decode tiles
    read them faster): the same tokens and logprobs as the [N, K] layout, graphs on."""
    from detinfer.kernels.fp8_quant import is_tiled
    from detinfer.ops import Ops

    reqs = _requests(6)
    engine = LLMEngine(model_dir, EngineConfig(**ENGINE), device="cuda")
    try:
        tiled = [n for n, p in engine.runner.model.named_parameters() if is_tiled(p)]
        tiled_out = drive(engine, reqs, max_steps=5000)
    finally:
        engine.close()
    assert tiled and all(n.split(".")[-2] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") for n in tiled)
    monkeypatch.setattr(Ops, "fp8_weight_layout", lambda self, w: w)
    assert _run(model_dir, reqs) == tiled_out
