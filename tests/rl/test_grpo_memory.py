"""The GRPO loop's memory choices: it scores only the completion tokens (logits for those rows only) and
steps the low-temporary AdamW of detinfer.train.optim."""

import torch

from detinfer.rl import GRPOTrainer, RLConfig
from detinfer.train import TrainableModel


def test_grpo_scores_only_completion_positions_with_the_low_temporary_adamw(stories_dir, monkeypatch):
    calls = []
    score = TrainableModel.score

    def spy(self, token_ids, cu_seqlens=None, *args, **kwargs):
        calls.append((token_ids.numel(), list(cu_seqlens), kwargs.get("positions")))
        return score(self, token_ids, cu_seqlens, *args, **kwargs)
    monkeypatch.setattr(TrainableModel, "score", spy)
    config = RLConfig(task="emit-token", steps=1, prompts_per_step=2, n_samples=2, max_tokens=5, lr=1e-3)
    trainer = GRPOTrainer(str(stories_dir), config, device="cpu", max_model_len=64)
    try:
        group = trainer.optimizer.param_groups[0]
        assert group["foreach"] is False and not group["fused"]  # CPU: the single-tensor AdamW
        record = trainer.step()
        assert record["mismatch_bits_differ"] == 0.0
    finally:
        trainer.close()
    assert calls
    for n, cu, positions in calls:
        assert isinstance(positions, torch.Tensor) and 0 < positions.numel() < n
        ends = {b - 1 for b in cu[1:]}
        assert not ends & set(positions.tolist())  # completion tokens have a next token: never an end
