"""Unmodified Hugging Face mixture-of-experts models (Qwen3-MoE, Mixtral) under the drop-in mode: a prompt's
logits alone == inside a right-padded batch, bitwise, for each of transformers' expert implementations
("grouped_mm", its default, through the mode's `_grouped_mm`; "eager", its per-expert loop with index_add_;
"batched_mm", through bmm). Without the mode the default implementation is batch-variant."""

import pytest
import torch
from test_mode_hf import _last_logits_alone_vs_batch, _prompts

import detinfer

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)


def _tiny_moe(arch: str, experts: str, dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    if arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**COMMON, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                          moe_intermediate_size=32, norm_topk_prob=True)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(cfg)
    model.config._attn_implementation = "eager"
    model.set_experts_implementation(experts)
    return model.to(device=device, dtype=dtype).eval()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("experts", ["grouped_mm", "eager", "batched_mm"])
def test_hf_moe_right_padded_logits_bitwise_equal_cpu(arch, experts):
    model = _tiny_moe(arch, experts)
    prompts = _prompts(1, 5)
    with torch.no_grad(), detinfer.batch_invariant():
        alone, batched = _last_logits_alone_vs_batch(model, prompts)
    for a, b in zip(alone, batched, strict=True):
        assert torch.equal(a, b)
    with torch.no_grad():
        stock_alone, stock_batched = _last_logits_alone_vs_batch(model, prompts)
    for a, s in zip(alone, stock_alone, strict=True):
        assert torch.allclose(a, s, atol=1e-4, rtol=1e-4)
    if experts == "grouped_mm":  # negative control: the default experts are batch-variant without the mode
        assert any(not torch.equal(a, b) for a, b in zip(stock_alone, stock_batched, strict=True))


def test_grouped_mm_layouts_without_an_invariant_implementation_are_refused():
    a, b = torch.randn(6, 8), torch.randn(8, 5)
    with detinfer.batch_invariant(), pytest.raises(detinfer.NotBatchInvariantError, match="_grouped_mm"):
        torch._grouped_mm(a, b, offs=torch.tensor([4, 8], dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("experts", ["grouped_mm", "eager"])
def test_hf_moe_right_padded_logits_bitwise_equal_gpu_bf16(arch, experts):
    model = _tiny_moe(arch, experts, dtype=torch.bfloat16, device="cuda")
    prompts = _prompts(2, 8)
    with torch.no_grad(), detinfer.batch_invariant():
        alone, batched = _last_logits_alone_vs_batch(model, prompts, device="cuda")
    for a, b in zip(alone, batched, strict=True):
        assert torch.equal(a, b)
