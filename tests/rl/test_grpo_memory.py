"""The GRPO loop's memory choices: every score() of the update loop (the PPO micro-batches, the no-grad
pi_old pass, the reference) computes logits only for the completion tokens, under the run's temperature;
the optimizer is detinfer.train.optim's low-temporary AdamW in each weight-decay group, a resumed run
keeps the implementation of the device it resumes on, and a colocated sampler's KV pool is released for
the update."""

import json

import pytest
import torch

from detinfer.rl import GRPOTrainer, RLConfig
from detinfer.rl.checkpoint import load_checkpoint, save_checkpoint
from detinfer.train import TrainableModel

BASE = dict(task="emit-token", steps=1, prompts_per_step=2, n_samples=2, max_tokens=5, lr=1e-3)


def _single_tensor(optimizer) -> bool:
    return all(g["foreach"] is False and not g["fused"] for g in optimizer.param_groups)


@pytest.mark.parametrize("arm,extra", [
    ("deterministic", {}),
    # several updates: the fast arm's no-grad pi_old pass; a reference model; a temperature
    ("fast", dict(ppo_epochs=2, mini_batch_seqs=2, train_batch_seqs=1, kl_coef=0.1, temperature=0.8))])
def test_grpo_scores_only_completion_positions_with_the_low_temporary_adamw(stories_dir, monkeypatch, arm, extra):
    calls = []
    score = TrainableModel.score

    def spy(self, token_ids, cu_seqlens=None, *args, **kwargs):
        calls.append((token_ids.numel(), list(cu_seqlens), kwargs.get("positions"), kwargs.get("temperature"),
                      torch.is_grad_enabled()))
        return score(self, token_ids, cu_seqlens, *args, **kwargs)
    monkeypatch.setattr(TrainableModel, "score", spy)
    config = RLConfig(**BASE, **extra)
    trainer = GRPOTrainer(str(stories_dir), config, arm, device="cpu", max_model_len=64)
    try:
        assert len(trainer.optimizer.param_groups) == 2 and _single_tensor(trainer.optimizer)  # CPU
        record = trainer.step()
        if arm == "deterministic":
            assert record["mismatch_bits_differ"] == 0.0
    finally:
        trainer.close()
    assert calls
    if extra:
        assert {grad for *_, grad in calls} == {True, False}  # with and without autograd both seen
    # the run's temperature for the loss; 1.0 for the mismatch statistics' pass (the engine's untempered kind)
    assert config.temperature in {t for *_, t, _ in calls} <= {config.temperature, 1.0}
    for n, cu, positions, _, _ in calls:
        assert isinstance(positions, torch.Tensor) and 0 < positions.numel() < n
        ends = {b - 1 for b in cu[1:]}
        assert not ends & set(positions.tolist())  # completion tokens have a next token: never an end


def test_resume_keeps_this_devices_adamw_implementation(stories_dir, tmp_path):
    """A checkpoint written on CUDA records fused=True in both groups; resumed on the CPU, the groups keep
    the CPU's single-tensor setting (and the saved hyperparameters)."""
    config = RLConfig(**BASE, weight_decay=0.05)
    trainer = GRPOTrainer(str(stories_dir), config, device="cpu", max_model_len=64)
    try:
        trainer.step()
        save_checkpoint(trainer, tmp_path / "ckpt")
    finally:
        trainer.close()
    state_path = tmp_path / "ckpt" / "state.json"
    state = json.loads(state_path.read_text())
    for group in state["optimizer_param_groups"]:
        group.update(fused=True, foreach=None)  # as torch records a fused CUDA AdamW
    state_path.write_text(json.dumps(state))
    resumed = GRPOTrainer(str(stories_dir), config, device="cpu", max_model_len=64)
    try:
        load_checkpoint(resumed, tmp_path / "ckpt")
        assert _single_tensor(resumed.optimizer)
        assert [g["weight_decay"] for g in resumed.optimizer.param_groups] == [0.05, 0.0]
    finally:
        resumed.close()


@pytest.mark.parametrize("layout", ["colocated", "split"])
def test_the_colocated_sampler_gives_its_kv_pool_to_the_update(stories_dir, monkeypatch, layout):
    """Colocated: the sampler's KV pool is released for the whole update (scoring, backward, AdamW, the push)
    and restored before the next rollout; split (the sampler on its own device): never released."""
    seen = []
    update = GRPOTrainer.update

    def spy(self, rollout):
        seen.append(self.llm.engine.runner.kv_released)
        return update(self, rollout)
    monkeypatch.setattr(GRPOTrainer, "update", spy)
    trainer = GRPOTrainer(str(stories_dir), RLConfig(**BASE, layout=layout), device="cpu", max_model_len=64)
    try:
        for _ in range(2):
            record = trainer.step()
            assert not trainer.llm.engine.runner.kv_released  # restored: the next rollout can run
            assert record["mismatch_bits_differ"] == 0.0
    finally:
        trainer.close()
    assert seen == [layout == "colocated"] * 2
