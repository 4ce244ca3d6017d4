"""TrainableModel API: parameters for a torch optimizer, master weights for 16-bit models, fast mode,
input validation."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from detinfer.models.loader import load_model
from detinfer.train import TrainableModel, pack_padded


def _batch():
    seqs = [[1, 5, 9, 33, 100, 7, 8], [1, 44, 55], [1, 12, 300, 301, 302, 303]]
    ids = torch.tensor([t for s in seqs for t in s])
    return ids, [0, 7, 10, 16]


def test_fp32_optimizer_step_changes_the_engine_weights(stories_dir):
    model, _ = load_model(stories_dir, torch.float32, "cpu", "deterministic")
    trainer = TrainableModel(model)
    assert not trainer.master_weights
    params = list(trainer.parameters())
    assert params[0] is model.embed_tokens  # the engine's own tensors
    opt = torch.optim.SGD(trainer.parameters(), lr=1e-2)
    ids, cu = _batch()
    before = model.layers[0].mlp.down_proj.weight.detach().clone()
    loss = -trainer.score(ids, cu).sum()
    loss.backward()
    opt.step()
    assert not torch.equal(before, model.layers[0].mlp.down_proj.weight)
    with torch.no_grad():
        assert trainer.score(ids, cu).sum() > -loss  # one step up the logprob


def test_bf16_master_weights_get_fp32_grads_and_push_into_the_engine(stories_dir):
    model, _ = load_model(stories_dir, torch.bfloat16, "cpu", "deterministic")
    trainer = TrainableModel(model)
    assert trainer.master_weights
    masters = list(trainer.parameters())
    assert all(m.dtype == torch.float32 for m in masters) and masters[0] is not model.embed_tokens
    opt = torch.optim.AdamW(masters, lr=0.05)  # steps above bf16 resolution
    ids, cu = _batch()
    grads = []
    for _ in range(2):
        trainer.zero_grad()
        (-trainer.score(ids, cu).sum()).backward()
        grads.append([m.grad.clone() for m in masters])
        assert all(p.grad is None for p in model.parameters())  # moved to the masters
    assert all(g.dtype == torch.float32 and torch.equal(g, h) for g, h in zip(*grads))
    before = model.norm.weight.detach().clone()
    opt.step()
    trainer.push_weights()
    assert model.norm.weight.dtype == torch.bfloat16
    assert torch.equal(model.norm.weight, masters[[n for n, _ in trainer.named_parameters()].index("norm.weight")]
                       .detach().to(torch.bfloat16))
    assert not torch.equal(before, model.norm.weight)


def test_fast_mode_is_close_to_deterministic_and_differentiable(stories_dir):
    model, _ = load_model(stories_dir, torch.float32, "cpu", "deterministic")
    ids, cu = _batch()
    det = TrainableModel(model).score(ids, cu)
    fast_trainer = TrainableModel(model, mode="fast")
    fast = fast_trainer.score(ids, cu)
    assert torch.allclose(det.detach(), fast.detach(), atol=1e-4)
    fast.sum().backward()
    assert model.embed_tokens.grad is not None and torch.isfinite(model.embed_tokens.grad).all()
    assert model.ops.mode == "deterministic"  # the swap is undone


def test_bad_inputs_are_rejected_with_clear_errors(stories_dir):
    model, _ = load_model(stories_dir, torch.float32, "cpu", "deterministic")
    trainer = TrainableModel(model)
    ids, cu = _batch()
    with pytest.raises(ValueError, match="mode must be one of"):
        TrainableModel(model, mode="exact")
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        trainer.score(ids, [0, 3, 9])
    with pytest.raises(ValueError, match=r"token_ids: token id 512 at position 1 is outside the vocabulary \[0, 512\)"):
        trainer.score(torch.tensor([1, 512]))
    with pytest.raises(TypeError, match="int32/int64"):
        trainer.score(ids.float(), cu)
    with pytest.raises(ValueError, match="targets must hold"):
        trainer.score(ids, cu, targets=ids[:-1])
    with pytest.raises(ValueError, match="lengths must hold"):
        pack_padded(torch.zeros(2, 3, dtype=torch.int64), [4, 1])
    with pytest.raises(TypeError, match="TrainableModel takes"):
        TrainableModel(object())


def test_explicit_targets_score_those_tokens(stories_dir):
    model, _ = load_model(stories_dir, torch.float32, "cpu", "deterministic")
    trainer = TrainableModel(model)
    ids, cu = _batch()
    with torch.no_grad():
        nxt = trainer.score(ids, cu)
        targets = torch.roll(ids, -1)
        explicit = trainer.score(ids, cu, targets=targets)
    ends = [b - 1 for b in cu[1:]]
    keep = torch.ones(len(ids), dtype=torch.bool)
    keep[ends] = False
    assert torch.equal(nxt[keep], explicit[keep])


def test_a_second_trainer_takes_over_the_gradients(stories_dir):
    model, _ = load_model(stories_dir, torch.bfloat16, "cpu", "deterministic")
    first = TrainableModel(model)
    second = TrainableModel(model, mode="fast")
    ids, cu = _batch()
    second.score(ids, cu).sum().backward()
    assert all(m.grad is not None for m in second.parameters())
    assert all(m.grad is None for m in first.parameters())


@pytest.mark.parametrize("name", ["stories260k", "qwen3-mqa", "llama-bias-tied"])
def test_whole_model_gradients_match_fp64_autograd(model_dirs, name):
    """Every parameter's gradient from the deterministic fp32 backward against stock fp64 autograd of the
    same module (fast mode in float64)."""
    m32, _ = load_model(model_dirs[name], torch.float32, "cpu", "deterministic")
    m64, _ = load_model(model_dirs[name], torch.float64, "cpu", "deterministic")
    ids, cu = _batch()
    w = torch.linspace(-1, 1, ids.shape[0])
    t32, t64 = TrainableModel(m32), TrainableModel(m64, mode="fast")
    (t32.score(ids, cu) * w).sum().backward()
    (t64.score(ids, cu) * w).sum().backward()
    pairs = list(zip(t32.named_parameters(), t64.named_parameters(), strict=True))
    assert len(pairs) > 5
    for (n, a), (_, b) in pairs:
        scale = b.grad.abs().max().item()
        assert scale > 0, n
        assert (a.grad.double() - b.grad).abs().max().item() <= 1e-4 * scale, n


@pytest.fixture(scope="module")
def stories_trainer(stories_dir):
    model, _ = load_model(stories_dir, torch.float32, "cpu", "deterministic")
    return TrainableModel(model)


@given(st.lists(st.lists(st.integers(0, 511), min_size=1, max_size=24), min_size=1, max_size=5),
       st.randoms(use_true_random=False))
def test_packing_never_changes_a_sequences_logprobs(stories_trainer, seqs, rng):
    """score(packed)[sequence s] == score(s alone), bitwise, for random sequences and packing orders."""
    order = list(range(len(seqs)))
    rng.shuffle(order)
    ids = torch.tensor([t for i in order for t in seqs[i]])
    cu = [0]
    for i in order:
        cu.append(cu[-1] + len(seqs[i]))
    with torch.no_grad():
        packed = stories_trainer.score(ids, cu)
        for j, i in enumerate(order):
            assert torch.equal(packed[cu[j]:cu[j + 1]], stories_trainer.score(torch.tensor(seqs[i])))
