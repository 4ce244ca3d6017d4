"""HF `generate()` with padded batches under the drop-in mode: every row == that prompt alone (issue 8).

Greedy token ids must be identical and the per-step logits bitwise equal, for left-padded batches (what
generate() needs for decoder-only models), SDPA and eager attention, tiny random Llama / Qwen3 models and the
real stories260k weights. Right padding is not a generate() layout: HF takes the first new token from the
last (pad) position and warns; right-padded forward passes are covered in test_mode_hf.py.
"""

from pathlib import Path

import pytest
import torch

import detinfer

transformers = pytest.importorskip("transformers")

STORIES = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "stories260k"
PAD = 0


def _tiny(arch, attn, dtype=torch.float32, device="cpu", seed=0):
    common = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=arch == "qwen3", pad_token_id=PAD,
                  bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=16))
    model.config._attn_implementation = attn
    return model.to(device=device, dtype=dtype).eval()


def _pad(prompts, side, device):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        sl = slice(width - len(p), width) if side == "left" else slice(0, len(p))
        ids[i, sl], mask[i, sl] = torch.tensor(p), 1
    return ids.to(device), mask.to(device)


def _generate(model, prompts, side, new_tokens, device):
    ids, mask = _pad(prompts, side, device)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=PAD, eos_token_id=None, output_logits=True,
                         return_dict_in_generate=True)
    seqs = out.sequences[:, ids.shape[1]:]
    logits = torch.stack(out.logits, dim=1)                     # [B, new_tokens, V]
    return seqs, logits


def _check_rows_equal_alone(model, prompts, side, new_tokens, device="cpu"):
    with torch.no_grad(), detinfer.batch_invariant():
        seqs, logits = _generate(model, prompts, side, new_tokens, device)
        for i, p in enumerate(prompts):
            s1, l1 = _generate(model, [p], side, new_tokens, device)
            assert torch.equal(seqs[i], s1[0]), f"row {i} tokens differ from the prompt alone"
            assert torch.equal(logits[i], l1[0]), f"row {i} logits differ from the prompt alone"
    return seqs


def _random_prompts(seed, n, vocab=101, lo=1, hi=20):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_generate_left_padded_batches_cpu(arch, attn):
    model = _tiny(arch, attn)
    for k in range(2):  # K random batches
        prompts = _random_prompts(100 * k + len(arch), n=3 + 2 * k)
        _check_rows_equal_alone(model, prompts, "left", new_tokens=6)


def test_eager_patch_is_restored():
    import transformers.models.llama.modeling_llama as ml

    orig = ml.eager_attention_forward
    _tiny("llama", "eager")
    with detinfer.batch_invariant():
        assert ml.eager_attention_forward is not orig
    assert ml.eager_attention_forward is orig


def test_stock_generate_left_padding_negative_control_cpu():
    """Documents what stock CPU kernels do with the same batches (no assertion on variance: CPU kernels
    may happen to be invariant for these tiny shapes; the GPU test below is the real negative control)."""
    model = _tiny("llama", "eager")
    prompts = _random_prompts(7, n=4)
    with torch.no_grad():
        seqs, _ = _generate(model, prompts, "left", 4, "cpu")
    assert seqs.shape == (4, 4)


@pytest.mark.skipif(not STORIES.exists(), reason=f"real model not found at {STORIES}")
def test_generate_stories260k_left_padded():
    model = transformers.AutoModelForCausalLM.from_pretrained(STORIES, attn_implementation="sdpa").eval()
    tok = transformers.AutoTokenizer.from_pretrained(STORIES)
    texts = ["Once upon a time", "The little dog", "One day, Lily went to the park and"]
    prompts = [tok(t).input_ids for t in texts]
    seqs = _check_rows_equal_alone(model, prompts, "left", new_tokens=12)
    assert "girl" in tok.decode(seqs[0]) or len(tok.decode(seqs[0])) > 10


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_generate_padded_batches_gpu(arch, attn, dtype):
    model = _tiny(arch, attn, dtype=dtype, device="cuda")
    for k in range(3):
        prompts = _random_prompts(1000 + k, n=[1, 8, 33][k], hi=60)
        _check_rows_equal_alone(model, prompts[: [1, 8, 33][k]], "left", new_tokens=10, device="cuda")
