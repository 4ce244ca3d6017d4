"""The loss and optimizer pieces without a model: PPO clipping (symmetric and clip-higher), loss
normalisations, the k3 KL, the learning-rate schedule, weight-decay groups; the new RLConfig fields'
validation, their CLI flags, and that a checkpoint refuses to resume when any of them changes."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from detinfer.engine.config import from_args
from detinfer.rl.checkpoint import check_compatible
from detinfer.rl.cli import _size_defaults, build_parser
from detinfer.rl.config import RESUMABLE_CHANGES, RLConfig
from detinfer.rl.loss import build_optimizer, clipped_objective, decays, k3_kl, lr_at, token_norms


def test_clipped_objective_at_ratio_one_is_the_policy_gradient():
    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    adv = torch.tensor([1.5, -0.5, 0.0])
    obj, active = clipped_objective(lp, lp.detach().clone(), adv, 0.2, 0.28)
    obj.sum().backward()
    assert torch.equal(lp.grad, adv) and not active.any()  # d(ratio)/d(lp) = ratio = 1 exactly


def test_clipped_objective_clips_asymmetrically():
    old = torch.zeros(4)
    # ratios 1.25 (A>0: inside 1.28, outside 1.2), 0.75 (A<0: clipped below 0.8), 1.3 (A<0: not clipped)
    lp = torch.log(torch.tensor([1.25, 1.25, 0.75, 1.3])).requires_grad_(True)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    obj_sym, act_sym = clipped_objective(lp, old, adv, 0.2, 0.2)
    obj_high, act_high = clipped_objective(lp, old, adv, 0.2, 0.28)
    assert act_sym.tolist() == [True, True, True, False]
    assert act_high.tolist() == [False, False, True, False]
    assert obj_sym[0].item() == pytest.approx(1.2) and obj_high[0].item() == pytest.approx(1.25)
    obj_high.sum().backward()
    assert lp.grad[2] == 0 and lp.grad[0] != 0  # a clipped token has no gradient


@given(st.lists(st.integers(0, 9), min_size=1, max_size=6).flatmap(
    lambda ls: st.tuples(st.just(ls), st.lists(st.booleans(), min_size=len(ls), max_size=len(ls)))))
def test_token_norms(case):
    lengths, keep = case
    for mode in ("token", "sequence", "constant"):
        norms = token_norms(lengths, keep, mode, max_tokens=9)
        assert len(norms) == sum(lengths)
        at = 0
        for n, k in zip(lengths, keep):
            assert all(v == 0.0 for v in norms[at:at + n]) or k
            at += n
        if any(n and k for n, k in zip(lengths, keep)) and mode != "constant":
            assert math.fsum(norms) == pytest.approx(1.0)  # a mean over the kept tokens / sequences
    kept_tokens = sum(n for n, k in zip(lengths, keep) if k)
    assert math.fsum(token_norms(lengths, keep, "constant", 9)) == pytest.approx(kept_tokens / (9 * len(lengths)))


def test_k3_kl_is_zero_at_equal_policies_and_positive_elsewhere():
    lp = torch.tensor([-1.0, -2.0])
    assert torch.equal(k3_kl(lp, lp), torch.zeros(2))
    assert (k3_kl(lp, lp + torch.tensor([0.3, -0.4])) > 0).all()


def test_lr_schedules():
    cfg = RLConfig(lr=1.0, warmup_steps=3, lr_schedule="linear")
    lrs = [lr_at(u, 13, cfg) for u in range(13)]
    assert lrs[:3] == [0.25, 0.5, 0.75] and lrs[3] == 1.0 and lrs[12] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(lrs[3:], lrs[4:]))
    cos = [lr_at(u, 10, cfg.replace(lr_schedule="cosine", warmup_steps=0)) for u in range(10)]
    assert cos[0] == 1.0 and cos[5] == pytest.approx(0.5) and 0 < cos[-1] < 0.03
    assert {lr_at(u, 10, cfg.replace(lr_schedule="constant", warmup_steps=0)) for u in range(10)} == {1.0}


def test_weight_decay_skips_norms_biases_and_embeddings():
    named = [("embed_tokens.weight", torch.nn.Parameter(torch.zeros(8, 4))),
             ("layers.0.attn.q_proj.weight", torch.nn.Parameter(torch.zeros(4, 4))),
             ("layers.0.attn.q_proj.bias", torch.nn.Parameter(torch.zeros(4))),
             ("layers.0.input_norm.weight", torch.nn.Parameter(torch.zeros(4))),
             ("lm_head.weight", torch.nn.Parameter(torch.zeros(8, 4)))]
    assert [decays(n, p) for n, p in named] == [False, True, False, False, True]
    opt = build_optimizer(named, RLConfig(weight_decay=0.1, lr=2e-3))
    (dec, no) = opt.param_groups
    assert dec["weight_decay"] == 0.1 and no["weight_decay"] == 0.0 and dec["lr"] == no["lr"] == 2e-3
    assert [id(p) for p in dec["params"]] == [id(named[1][1]), id(named[4][1])]
    # the implementation is train/optim.py's adamw choice in every group: single-tensor on CPU
    assert all(g["foreach"] is False and not g["fused"] for g in opt.param_groups)


@pytest.mark.parametrize("bad,match", [
    (dict(temperature=0.0), r"temperature must be in \(0, 100\]"), (dict(top_p=1.5), r"top_p must be in"),
    (dict(top_k=-1), "top_k must be >= 0"), (dict(ppo_epochs=0), "ppo_epochs must be >= 1"),
    (dict(mini_batch_seqs=0), "mini_batch_seqs"), (dict(clip_eps=0.0), r"clip_eps must be in \(0, 1\]"),
    (dict(clip_eps_high=-1.0), "clip_eps_high"), (dict(loss_norm="mean"), "loss_norm must be one of"),
    (dict(lr_schedule="step"), "lr_schedule must be one of"), (dict(warmup_steps=-2), "warmup_steps"),
    (dict(overlong_buffer=32), r"overlong_buffer must be in \[0, 31\]"), (dict(eval_every=5), "eval_every > 0 needs"),
    (dict(eval_size=-1), "eval_size"), (dict(prompt_column=""), "prompt_column must be a non-empty string"),
    (dict(reward_weights="1,2"), "one weight per reward function")])
def test_new_config_fields_are_validated(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        RLConfig(**bad)


def test_new_flags_reach_the_config():
    ns = build_parser().parse_args([
        "--model", "m", "--dataset", "d.jsonl", "--prompt-column", "question", "--system-prompt", "Be brief.",
        "--reward-funcs", "math,format", "--reward-weights", "1,0.1", "--temperature", "0.7", "--top-p", "0.9",
        "--top-k", "50", "--ppo-epochs", "2", "--mini-batch-seqs", "8", "--clip-eps-high", "0.28",
        "--loss-norm", "constant", "--mask-truncated", "--lr-schedule", "cosine", "--warmup-steps", "5",
        "--eval-size", "4", "--eval-every", "10", "--no-shuffle", "--device", "cuda"])
    _size_defaults(ns)  # what the CLI does before building the config (GPU-sized: --device cuda)
    c = from_args(RLConfig, ns)
    assert (c.dataset, c.prompt_column, c.reward_weights, c.top_k, c.mini_batch_seqs, c.loss_norm) == (
        "d.jsonl", "question", "1,0.1", 50, 8, "constant")
    assert c.mask_truncated and not c.shuffle and c.clip_eps_high == 0.28 and c.updates_per_step == 2 * 16


NEW_FIELD_CHANGES = dict(dataset="x.jsonl", dataset_config="main", dataset_split="train[:9]", prompt_column="q",
                         answer_column="a", system_prompt="s", shuffle=False, eval_dataset="e.jsonl",
                         eval_split="dev", eval_size=3, eval_every=2, reward_funcs="math", reward_weights="2",
                         temperature=0.5, top_p=0.5, top_k=5, ppo_epochs=2, mini_batch_seqs=4, clip_eps=0.1,
                         clip_eps_high=0.3, loss_norm="sequence", mask_truncated=True, overlong_buffer=4,
                         overlong_penalty=0.5, lr_schedule="linear", warmup_steps=2, weight_decay=0.01)


@pytest.mark.parametrize("name", sorted(NEW_FIELD_CHANGES))
def test_resume_refuses_a_change_of_each_new_field(name):
    base = RLConfig(task="emit-token")
    state = {"arm": "deterministic", "task": "emit-token", "config": base.to_dict()}
    extra = {"eval_size": 3} if name == "eval_every" else {}  # eval_every needs an eval set
    changed = dataclasses.replace(base, **{name: NEW_FIELD_CHANGES[name], **extra})
    with pytest.raises(ValueError, match=f"cannot resume with different settings .*{name}"):
        check_compatible(state, changed, "deterministic", "emit-token")


def test_resume_may_extend_steps_only_under_a_constant_lr():
    assert set(NEW_FIELD_CHANGES) | set(RESUMABLE_CHANGES) | {"task"} <= {f.name for f in dataclasses.fields(RLConfig)}
    const = RLConfig(task="emit-token", steps=4)
    check_compatible({"arm": "deterministic", "task": "emit-token", "config": const.to_dict()},
                     const.replace(steps=8, checkpoint_every=2), "deterministic", "emit-token")
    cos = const.replace(lr_schedule="cosine")
    with pytest.raises(ValueError, match="steps: 4 -> 8"):
        check_compatible({"arm": "deterministic", "task": "emit-token", "config": cos.to_dict()},
                         cos.replace(steps=8), "deterministic", "emit-token")


def test_cli_reports_a_missing_dataset_in_one_line(tmp_path, capsys):
    from detinfer.rl.cli import main

    argv = ["--model", "unused", "--dataset", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o"),
            "--no-progress", "--device", "cpu"]
    assert main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    # the CPU-sized-defaults notice may come first; the error itself is one line, the last
    assert lines[-1].startswith("detinfer rl: error: dataset file") and "nope.jsonl not found" in lines[-1]
    assert all(line.startswith("detinfer rl: ") for line in lines) and len(lines) <= 2
