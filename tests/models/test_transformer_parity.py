"""Our Transformer vs HF transformers (eager attention) on the same tiny checkpoints, fp32 CPU, in both op
modes; and batch invariance of the model code itself (packing sequences together changes no bits)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from detinfer.models import ReferenceAttention, load_model
from detinfer.models.rope import inverse_frequencies

MODES = ("fast", "deterministic")
RTOL = 1e-4  # relative to the largest |logit|; fp32 with different reduction orders


def _hf(path):
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()


def _ids(n, vocab, seed):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _run(model, config, chunks):
    """chunks: list of steps, each a list of (seq_id, token ids [n]); returns {seq_id: logits [L, V]}."""
    attn = ReferenceAttention(config.num_hidden_layers, config.softmax_scale)
    out = {}
    with torch.no_grad():
        for step in chunks:
            positions = attn.begin([s for s, _ in step], [len(t) for _, t in step])
            logits = model.compute_logits(model(torch.cat([t for _, t in step]), positions, attn))
            for (sid, _), part in zip(step, logits.split([len(t) for _, t in step]), strict=True):
                out.setdefault(sid, []).append(part)
    return {sid: torch.cat(parts) for sid, parts in out.items()}


def _assert_close(ours, ref):
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    err = (ours - ref).abs().max().item()
    assert err <= RTOL * ref.abs().max().item(), f"max |diff| {err} vs max |logit| {ref.abs().max().item()}"


@pytest.mark.parametrize("mode", MODES)
def test_logits_match_hf(tiny_checkpoints, tiny_variant, mode):
    path = tiny_checkpoints[tiny_variant]
    model, config = load_model(path, dtype=torch.float32, mode=mode)
    hf = _hf(path)
    a, b = _ids(19, config.vocab_size, 1), _ids(6, config.vocab_size, 2)
    with torch.no_grad():
        ref_a, ref_b = hf(a[None]).logits[0], hf(b[None]).logits[0]
    # A in chunks (prefill 9, then a 7-token chunk, then single-token decode steps) packed with B.
    steps = [[("a", a[:9]), ("b", b[:5])], [("b", b[5:]), ("a", a[9:16])]] + [[("a", a[i:i + 1])]
                                                                              for i in range(16, 19)]
    got = _run(model, config, steps)
    _assert_close(got["a"], ref_a)
    _assert_close(got["b"], ref_b)


@pytest.mark.parametrize("variant", ["llama-llama3rope-tied", "llama-llama3rope-legacy-bias",
                                     "qwen3-linear-rope", "qwen2-mqa-tied"])
def test_rotary_frequencies_match_hf(tiny_checkpoints, variant):
    path = tiny_checkpoints[variant]
    model, config = load_model(path, mode="fast")
    hf_inv = _hf(path).model.rotary_emb.inv_freq
    assert torch.equal(model.rotary.inv_freq, hf_inv)
    if config.rope_scaling is not None:  # the scaling must actually have changed something
        from dataclasses import replace

        assert not torch.equal(inverse_frequencies(replace(config, rope_scaling=None)), hf_inv)


@pytest.mark.parametrize("variant", ["qwen3-headdim32", "llama-odd-sizes", "qwen3-moe-mlp-only", "mixtral"])
def test_deterministic_packing_is_bitwise_invariant(tiny_checkpoints, variant):
    """A sequence's logits are the same bits whether it runs alone or packed with other sequences."""
    model, config = load_model(tiny_checkpoints[variant], mode="deterministic")
    seqs = {s: _ids(n, config.vocab_size, 10 + i) for i, (s, n) in enumerate([("x", 11), ("y", 5), ("z", 8)])}
    prompt = [(s, t[:-2]) for s, t in seqs.items()]
    decode1 = [(s, t[-2:-1]) for s, t in seqs.items()]
    decode2 = [(s, t[-1:]) for s, t in seqs.items()]
    packed = _run(model, config, [prompt, decode1, decode2])
    for sid in seqs:
        alone = _run(model, config, [[p for p in step if p[0] == sid] for step in (prompt, decode1, decode2)])
        assert torch.equal(alone[sid], packed[sid]), sid


def test_forward_shapes_and_dtypes(tiny_checkpoints):
    model, config = load_model(tiny_checkpoints["llama-gqa"], dtype="bfloat16", mode="fast")
    attn = ReferenceAttention(config.num_hidden_layers, config.softmax_scale)
    ids = _ids(4, config.vocab_size, 0)
    with torch.no_grad():
        hidden = model(ids, attn.begin([0], [4]), attn)
        logits = model.compute_logits(hidden[-1:])
    assert hidden.shape == (4, config.hidden_size) and hidden.dtype == torch.bfloat16
    assert logits.shape == (1, config.vocab_size) and logits.dtype == torch.float32
    # fused qkv / gate_up keep HF's [out, in] layout
    layer = model.layers[0]
    assert layer.self_attn.qkv_proj.weight.shape == (config.q_size + 2 * config.kv_size, config.hidden_size)
    assert layer.mlp.gate_up_proj.weight.shape == (2 * config.intermediate_size, config.hidden_size)
