"""PPO-style GRPO, datasets, rewards and eval on stories260k (CPU, fp32, a few tokens per run): the
sampler's logprobs are the trainer's bits before the first update, so no recompute pass runs; n samples
of one request differ; several mini-batch epochs with every optimisation option stay bitwise reproducible
and resume bit for bit (two AdamW groups, a cosine schedule); truncated completions can be masked out of
the loss; a raising reward function fails samples, not the run; a JSONL dataset with a held-out eval set
is scored every N steps and logged."""

import json

import pytest
import torch

from detinfer.rl import TASKS, Example, GRPOTrainer, RLConfig, Task, run_arm

TINY = dict(task="emit-token", prompts_per_step=3, n_samples=3, max_tokens=6, lr=3e-3, train_batch_seqs=2)
TIMING = ("rollout_s", "train_s", "step_s")


def _run(model_dir, config, out=None, **kw):
    return run_arm(model_dir, config, "deterministic", out, device="cpu", progress=False, max_model_len=64,
                   log=None, **kw)


def _untimed(history):
    return [{k: v for k, v in h.items() if k not in TIMING} for h in history]


def _fixed_prompt_task() -> Task:
    prompt = tuple([1] + [(5 * i + 11) % 400 + 5 for i in range(7)])
    return Task("fixed-prompt", lambda rng: Example(prompt), lambda ex, text, ids: 0.0, chat=False)


def test_sampler_logprobs_are_the_old_policy_so_no_recompute_pass_runs(stories_dir, monkeypatch):
    config = RLConfig(**{**TINY, "ppo_epochs": 2, "mini_batch_seqs": 4})
    t = GRPOTrainer(stories_dir, config, "deterministic", device="cpu", max_model_len=64)
    try:
        r = t.rollout(0)
        recompute = t._score_no_grad(r, range(len(r.completion_ids)), 1.0)  # what other stacks run first
        for j, lps in enumerate(r.sampler_logprobs):
            assert torch.equal(recompute[j], torch.tensor(lps, dtype=torch.float32)), j
        calls = []
        monkeypatch.setattr(t, "_score_no_grad", lambda *a: calls.append(a))
        stats = t.update(r)
        assert calls == []  # deterministic mode: the sampler's logprobs serve as pi_old
        assert stats["updates"] == 2 * 3 and stats["mismatch_tokens"] == sum(map(len, r.completion_ids[:4]))
        assert (stats["mismatch_bits_differ"], stats["mismatch_max_abs_diff"]) == (0.0, 0.0)
    finally:
        t.close()


def test_n_samples_of_one_request_are_not_all_identical(stories_dir):
    config = RLConfig(task="unused", prompts_per_step=1, n_samples=4, max_tokens=8)
    t = GRPOTrainer(stories_dir, config, "deterministic", task=_fixed_prompt_task(), device="cpu", max_model_len=64)
    try:
        r = t.rollout(0)  # one request, one base seed, n = 4
        assert len({tuple(c) for c in r.completion_ids}) > 1, r.completion_ids
        assert r.completion_ids == t.rollout(0).completion_ids  # and still a pure function of the seed
    finally:
        t.close()


def test_rollout_sampling_options_reach_the_engine(stories_dir, monkeypatch):
    config = RLConfig(task="unused", prompts_per_step=2, n_samples=2, max_tokens=4, temperature=0.6, top_p=0.8,
                      top_k=7)
    t = GRPOTrainer(stories_dir, config, "deterministic", task=_fixed_prompt_task(), device="cpu", max_model_len=64)
    try:
        seen, generate = [], t.llm.generate
        monkeypatch.setattr(t.llm, "generate", lambda prompts, params, **kw: seen.extend(params) or
                            generate(prompts, params, **kw))
        t.rollout(0)
        assert [(p.temperature, p.top_p, p.top_k, p.n, p.max_tokens) for p in seen] == [(0.6, 0.8, 7, 2, 4)] * 2
        assert len({p.seed for p in seen}) == 2
    finally:
        t.close()


OPTIONS = RLConfig(**{**TINY, "steps": 2, "ppo_epochs": 2, "mini_batch_seqs": 4, "clip_eps_high": 0.28,
                      "loss_norm": "sequence", "lr_schedule": "cosine", "warmup_steps": 1, "weight_decay": 0.1,
                      "temperature": 0.8, "top_p": 0.95, "top_k": 40, "overlong_buffer": 2, "max_grad_norm": 0.5})


@pytest.fixture(scope="module")
def options_run(stories_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("rl-options")
    return out, _run(stories_dir, OPTIONS, out)


def test_ppo_options_run_is_reproducible_and_resumes_bitwise(options_run, stories_dir, tmp_path):
    out, history = options_run
    assert [h["updates"] for h in history] == [6, 6]
    assert history[0]["lr"] > history[1]["lr"] > 0  # cosine decay after warmup
    assert all(h["mismatch_bits_differ"] == 0.0 and h["mismatch_tokens"] > 0 for h in history)
    assert len({h["weights_hash"] for h in history}) == 2
    again = _run(stories_dir, OPTIONS, tmp_path)
    assert _untimed(again) == _untimed(history)  # every number and weights hash, bit for bit
    with pytest.raises(ValueError, match="steps: 2 -> 3"):  # a cosine horizon cannot move on resume
        _run(stories_dir, OPTIONS.replace(steps=3), tmp_path, resume=True)
    state = json.loads((tmp_path / "deterministic" / "checkpoint" / "state.json").read_text())
    assert [g["weight_decay"] for g in state["optimizer_param_groups"]] == [0.1, 0.0]
    with pytest.raises(ValueError, match="cannot resume with different settings .*ppo_epochs"):
        _run(stories_dir, OPTIONS.replace(ppo_epochs=3), tmp_path, resume=True)


def test_ppo_run_resumes_bitwise_under_a_constant_lr(stories_dir, tmp_path):
    config = OPTIONS.replace(lr_schedule="constant", steps=2)
    whole = _run(stories_dir, config)
    _run(stories_dir, config.replace(steps=1), tmp_path)
    resumed = _run(stories_dir, config, tmp_path, resume=True)  # fresh engine and optimizer (two groups)
    assert _untimed(resumed) == _untimed(whole)


def test_masking_truncated_completions_removes_their_loss(stories_dir):
    # stories260k rarely ends a story within 3 tokens: every completion is truncated, so nothing is trained
    config = RLConfig(**{**TINY, "steps": 1, "max_tokens": 3, "mask_truncated": True})
    odd = Task("odd-tokens", TASKS["emit-token"].make_example, lambda ex, text, ids: sum(t % 2 for t in ids) / 3,
               chat=False)  # rewards that differ within a group: a nonzero gradient unless masked
    t = GRPOTrainer(stories_dir, config, "deterministic", task=odd, device="cpu", max_model_len=64)
    try:
        before = t.fingerprint()
        rec = t.step()
        assert rec["truncated_frac"] == 1.0 and rec["loss"] == 0.0 and rec["grad_norm"] == 0.0
        assert t.fingerprint() == before
    finally:
        t.close()
    unmasked = _run(stories_dir, config.replace(mask_truncated=False), task=odd)
    assert unmasked[0]["grad_norm"] > 0


def test_a_raising_reward_function_fails_samples_not_the_run(stories_dir, tmp_path, monkeypatch):
    (tmp_path / "flaky_reward.py").write_text(
        "def reward(completions, **kw):\n"
        "    if any(' the' in c for c in completions):\n"
        "        raise RuntimeError('verifier crashed')\n"
        "    return [0.5 for _ in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = RLConfig(**{**TINY, "steps": 2, "max_tokens": 8, "reward_funcs": "task,flaky_reward:reward",
                         "reward_weights": "1,1"})
    history = _run(stories_dir, config, tmp_path / "out")
    assert len(history) == 2
    fails = [h["reward_failures/flaky_reward:reward"] for h in history]
    assert sum(fails) > 0 and all(h["reward_failures"] == f for h, f in zip(history, fails))
    assert "verifier crashed" in next(h["reward_error"] for h in history if h["reward_failures"])
    lines = [json.loads(x) for x in (tmp_path / "out" / "deterministic" / "metrics.jsonl").read_text().splitlines()]
    assert [x["reward_failures"] for x in lines] == fails


def test_jsonl_dataset_with_a_held_out_eval_set(stories_dir, tmp_path):
    rows = [{"prompt": p, "answer": "the", "src": i} for i, p in enumerate(
        ("Once upon a time", "One day", "The little dog", "Lily and Tom", "A small bird", "The sun was"))]
    data = tmp_path / "stories.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "count_the.py").write_text(
        "def reward(completions, answers, src, **kw):\n"
        "    assert len(src) == len(completions)\n"
        "    return [float(c.count(a)) / 4 for c, a in zip(completions, answers)]\n")
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        config = RLConfig(**{**TINY, "steps": 2, "prompts_per_step": 2, "dataset": str(data), "eval_size": 2,
                             "eval_every": 1, "reward_funcs": "count_the:reward"})
        history = _run(stories_dir, config, tmp_path / "out")
    finally:
        sys.path.remove(str(tmp_path))
    assert [h["epoch"] for h in history] == [0.5, 1.0]  # 4 training examples, 2 per step
    for h in history:
        assert h["eval_examples"] == 2 and 0.0 <= h["eval_accuracy"] <= 1.0
        assert h["eval_reward_mean"] == h["eval_reward/count_the:reward"]
    lines = [json.loads(x) for x in (tmp_path / "out" / "deterministic" / "metrics.jsonl").read_text().splitlines()]
    assert [x["eval_reward_mean"] for x in lines] == [h["eval_reward_mean"] for h in history]


@pytest.mark.parametrize("arm", ["fast", "fast-tis"])
def test_fast_arms_with_several_updates_recompute_the_old_policy(stories_dir, arm):
    config = RLConfig(**{**TINY, "steps": 1, "ppo_epochs": 2, "mini_batch_seqs": 4, "kl_coef": 0.1})
    t = GRPOTrainer(stories_dir, config, arm, device="cpu", max_model_len=64)
    try:
        calls, score = [], t._score_no_grad
        t._score_no_grad = lambda *a: calls.append(a) or score(*a)
        r = t.rollout(0)
        stats = t.update(r)
        assert len(calls) == 1  # the sampler's logprobs are not the trainer's: one no-grad pass for pi_old
        assert stats["updates"] == 6 and (stats["tis_clipped_frac"] is not None) == (arm == "fast-tis")
        assert stats["mismatch_tokens"] == sum(map(len, r.completion_ids))  # every token, from that pass
    finally:
        t.close()
    if arm == "fast-tis":
        with pytest.raises(ValueError, match="fast-tis arm needs temperature 1"):
            GRPOTrainer(stories_dir, config.replace(temperature=0.7), arm, device="cpu", max_model_len=64)


def test_trainer_scores_under_a_temperature(stories_dir):
    from detinfer.engine import LLM
    from detinfer.train import TrainableModel

    llm = LLM(str(stories_dir), device="cpu", max_model_len=64)
    trainer = TrainableModel(llm)
    try:
        ids = torch.tensor([1, 45, 300, 7, 99, 12], dtype=torch.int64)
        assert torch.equal(trainer.score(ids, temperature=1.0), trainer.score(ids))
        full = trainer.distributions(ids).double()  # log_softmax(z): z up to a per-row shift
        want = torch.log_softmax(full / 0.7, dim=-1).gather(1, ids[1:, None].long())[:, 0]
        got = trainer.score(ids, temperature=0.7).detach().double()[:-1]
        assert torch.allclose(got, want, rtol=0, atol=1e-5)
        with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
            trainer.score(ids, temperature=0.0)
    finally:
        trainer.close()
