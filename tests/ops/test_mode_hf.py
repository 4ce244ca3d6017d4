"""Unmodified Hugging Face models under the drop-in mode: a prompt's logits alone == inside a padded batch.

Right padding here (issue 3). Left padding and generate() are covered by the HF-generate tests.
"""

import pytest
import torch

import detinfer

transformers = pytest.importorskip("transformers")


def _tiny(arch: str, attn: str, dtype=torch.float32, device="cpu"):
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(**common, head_dim=16)
        model = transformers.Qwen3ForCausalLM(cfg)
    model.config._attn_implementation = attn
    return model.to(device=device, dtype=dtype).eval()


def _right_padded(prompts, pad_id=0, device="cpu"):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
        mask[i, : len(p)] = 1
    return ids.to(device), mask.to(device)


def _last_logits_alone_vs_batch(model, prompts, device="cpu"):
    alone = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        alone.append(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1])
    ids, mask = _right_padded(prompts, device=device)
    out = model(input_ids=ids, attention_mask=mask).logits
    batched = [out[i, len(p) - 1] for i, p in enumerate(prompts)]
    return alone, batched


def _prompts(seed, n, vocab=97, max_len=23):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len, (n,), generator=g).tolist()
    return [torch.randint(1, vocab, (L,), generator=g).tolist() for L in lens]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_hf_right_padded_logits_bitwise_equal_cpu(arch, attn):
    model = _tiny(arch, attn)
    prompts = _prompts(1, 5)
    with torch.no_grad(), detinfer.batch_invariant():
        alone, batched = _last_logits_alone_vs_batch(model, prompts)
    for a, b in zip(alone, batched):
        assert torch.equal(a, b)
    # and the mode computes the same function as stock HF (accuracy, not bits)
    with torch.no_grad():
        stock_alone, _ = _last_logits_alone_vs_batch(model, prompts)
    for a, s in zip(alone, stock_alone):
        assert torch.allclose(a, s, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hf_right_padded_logits_bitwise_equal_gpu(arch, attn, dtype):
    model = _tiny(arch, attn, dtype=dtype, device="cuda")
    prompts = _prompts(2, 9)
    with torch.no_grad(), detinfer.batch_invariant():
        alone, batched = _last_logits_alone_vs_batch(model, prompts, device="cuda")
    for a, b in zip(alone, batched):
        assert torch.equal(a, b)
