"""Fast mode's batched attention (detinfer.train.fast_attention): every implementation equals causal
attention per sequence against a float64 reference (values and gradients), TrainableModel's fast mode
scores the same logprobs batched as one sequence at a time, "auto" picks the strongest implementation the
device has, the fast RL arms train with it, and bad choices get clear errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.models.loader import load_model
from detinfer.train import TrainableModel
from detinfer.train.fast_attention import (
    PaddedSDPAAttention,
    SDPAAttention,
    _varlen_causal_kwargs,
    build_fast_attention,
    resolve_fast_attention,
)


def _reference(q, k, v, cu, scale):
    """Causal attention per sequence in float64."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    out = torch.zeros_like(q)
    for a, b in zip(cu[:-1], cu[1:]):
        s = torch.einsum("qhd,khd->hqk", q[a:b], k[a:b]) * scale
        s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v[a:b])
    return out


def _inputs(lens, hkv, group, d, seed, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    q, k, v = (torch.randn(n, h, d, generator=g).to(device=device, dtype=dtype).requires_grad_(True)
               for h in (hkv * group, hkv, hkv))
    cu = [0]
    for x in lens:
        cu.append(cu[-1] + x)
    return q, k, v, cu


def _check_against_reference(attn, q, k, v, cu, scale, atol):
    out = attn(0, q, k, v)
    ref = _reference(q.detach(), k.detach(), v.detach(), cu, scale)
    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)
    if q.shape[0] == 0:
        return
    gout = torch.randn_like(ref)
    grads = torch.autograd.grad(out, (q, k, v), gout.to(out.dtype))
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref_grads = torch.autograd.grad(_reference(*leaves, cu, scale), leaves, gout)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, atol=atol * 4, rtol=0)


@settings(deadline=None)
@given(lens=st.lists(st.integers(0, 19), min_size=1, max_size=5), hkv=st.integers(1, 2),
       group=st.sampled_from([1, 2, 3]), d=st.sampled_from([8, 16]), seed=st.integers(0, 2**16),
       impl=st.sampled_from(["padded-sdpa", "per-sequence"]))
def test_fast_attention_matches_causal_attention_per_sequence(lens, hkv, group, d, seed, impl):
    q, k, v, cu = _inputs(lens, hkv, group, d, seed)
    attn = build_fast_attention(impl, cu, d ** -0.5, torch.device("cpu"))
    _check_against_reference(attn, q, k, v, cu, d ** -0.5, atol=1e-5)


def test_build_picks_the_named_implementation():
    assert isinstance(build_fast_attention("padded-sdpa", [0, 3], 1.0, torch.device("cpu")), PaddedSDPAAttention)
    assert isinstance(build_fast_attention("per-sequence", [0, 3], 1.0, torch.device("cpu")), SDPAAttention)


def test_resolve_on_cpu_picks_padded_sdpa_and_rejects_unavailable_or_unknown_names():
    assert resolve_fast_attention("auto", torch.device("cpu"), torch.float32, 16) == "padded-sdpa"
    assert resolve_fast_attention("per-sequence", torch.device("cpu"), torch.float32, 16) == "per-sequence"
    with pytest.raises(ValueError, match="not available"):
        resolve_fast_attention("varlen", torch.device("cpu"), torch.bfloat16, 16)
    with pytest.raises(ValueError, match="not available"):
        resolve_fast_attention("flash-attn", torch.device("cpu"), torch.bfloat16, 16)
    with pytest.raises(ValueError, match="fast_attention must be one of"):
        resolve_fast_attention("flash", torch.device("cpu"), torch.float32, 16)


def test_varlen_causal_keywords_follow_the_installed_signature():
    def new_style(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        pass

    def old_style(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False, scale=None):
        pass

    def no_causal(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None):
        pass

    def no_scale(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False):
        pass

    assert _varlen_causal_kwargs(new_style) == {"window_size": (-1, 0), "enable_gqa": True}
    assert _varlen_causal_kwargs(old_style) == {"is_causal": True}
    assert _varlen_causal_kwargs(no_causal) is None
    assert _varlen_causal_kwargs(no_scale) is None


def _batch():
    seqs = [[1, 5, 9, 33, 100, 7, 8], [1, 44, 55], [1], [1, 12, 300, 301, 302, 303, 17, 18, 19]]
    return torch.tensor([t for s in seqs for t in s]), [0, 7, 10, 11, 20]


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_fast_mode_batched_scores_equal_per_sequence_scores(stories_dir, dtype, atol):
    model, _ = load_model(stories_dir, dtype, "cpu", "fast")
    ids, cu = _batch()
    results = {}
    for impl in ("auto", "per-sequence"):
        trainer = TrainableModel(model, mode="fast", fast_attention=impl)
        trainer.zero_grad()
        lp = trainer.score(ids, cu, positions=[2, 3, 4, 8, 12, 15, 18])
        (lp * torch.linspace(-1, 1, lp.shape[0])).sum().backward()
        results[trainer.fast_attention] = (lp.detach(), [p.grad.clone() for p in trainer.parameters()])
        trainer.close()
    assert set(results) == {"padded-sdpa", "per-sequence"}
    (lp_b, grads_b), (lp_s, grads_s) = results["padded-sdpa"], results["per-sequence"]
    torch.testing.assert_close(lp_b, lp_s, atol=atol, rtol=0)
    assert all(g.abs().sum() > 0 for g in grads_b[1:3])  # gradients reach the weights
    for gb, gs in zip(grads_b, grads_s):
        torch.testing.assert_close(gb, gs, atol=atol * 10, rtol=atol * 10)


def test_deterministic_mode_rejects_a_fast_attention_choice(stories_dir):
    model, _ = load_model(stories_dir, torch.float32, "cpu", "deterministic")
    with pytest.raises(ValueError, match="deterministic mode always runs the engine's paged attention"):
        TrainableModel(model, fast_attention="padded-sdpa")
    assert TrainableModel(model).fast_attention is None


@pytest.mark.parametrize("arm", ["fast", "fast-tis"])
def test_fast_rl_arms_train_with_batched_attention(stories_dir, arm):
    from detinfer.rl import GRPOTrainer, RLConfig

    config = RLConfig(task="emit-token", prompts_per_step=2, n_samples=2, max_tokens=4)
    t = GRPOTrainer(stories_dir, config, arm, device="cpu", max_model_len=64)
    try:
        assert t.trainer.fast_attention == "padded-sdpa"  # the strongest the CPU has: one call per batch
    finally:
        t.close()


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["varlen", "padded-sdpa"])
@pytest.mark.parametrize("lens, hkv, group, d", [([1, 200, 37, 512], 2, 4, 128), ([64] * 8, 4, 1, 64),
                                                  ([0, 5, 300], 1, 3, 128)])
def test_gpu_fast_attention_matches_reference_in_bf16(impl, lens, hkv, group, d):
    dev = torch.device("cuda")
    from detinfer.train.fast_attention import _torch_varlen
    varlen = _torch_varlen()
    if impl == "varlen" and (varlen is None or varlen[1] is None):
        pytest.skip("this torch has no usable torch.nn.attention.varlen.varlen_attn")
    name = resolve_fast_attention(impl, dev, torch.bfloat16, d)
    q, k, v, cu = _inputs(lens, hkv, group, d, seed=0, dtype=torch.bfloat16, device=dev)
    _check_against_reference(build_fast_attention(name, cu, d ** -0.5, dev), q, k, v, cu, d ** -0.5,
                             atol=2e-2)


@pytest.mark.gpu
def test_gpu_fast_mode_batched_scores_equal_per_sequence_scores():
    from detinfer.train.testing import random_model

    model, cfg = random_model("smollm2-135m", layers=2, mode="fast", device="cuda", dtype=torch.bfloat16)
    lens = [3, 40, 17, 64, 1, 33]
    ids = torch.randint(0, cfg.vocab_size, (sum(lens),), generator=torch.Generator().manual_seed(0))
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    scores = {}
    for impl in ("auto", "per-sequence"):
        trainer = TrainableModel(model, mode="fast", fast_attention=impl)
        with torch.no_grad():
            scores[impl] = (trainer.fast_attention, trainer.score(ids, cu))
        trainer.close()
    print(f"auto -> {scores['auto'][0]}; max |batched - per-sequence| "
          f"{(scores['auto'][1] - scores['per-sequence'][1]).abs().max().item():.3g}")
    assert scores["auto"][0] != "per-sequence"
    torch.testing.assert_close(scores["auto"][1], scores["per-sequence"][1], atol=5e-2, rtol=0)
