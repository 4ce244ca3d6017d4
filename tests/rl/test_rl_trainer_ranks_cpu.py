"""`detinfer rl --trainer-ranks 2` on CPU (gloo; stories260k): two data-parallel trainer ranks (FSDP2 shards,
fixed-order gradient sum) beside a TP=2 sampler. Mismatch exactly 0 at every step; with one micro-batch per rank
per update and no clipping (whose global norm FSDP reduces in its own order) the run is the one-trainer run bit
for bit: weights hash per step, and the checkpoint's weights and AdamW state, gathered from the shards; a
resumed run (each rank restoring its shards) continues it bit for bit, and --export-hf writes its weights. Bad
combinations are refused naming the flags; a dead trainer rank is an error naming it."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
from safetensors.torch import load_file

from detinfer.rl import GRPOTrainer, RLConfig, run_arm
from detinfer.rl.cli import main as rl_main

SMALL = ["--task", "emit-token", "--device", "cpu", "--max-model-len", "64", "--no-progress", "--steps", "2",
         "--prompts-per-step", "2", "--n-samples", "3", "--max-tokens", "8", "--lr", "3e-2",
         "--tensor-parallel-size", "2", "--tp-invariant-reduction", "--max-grad-norm", "none",
         "--train-batch-seqs", "3"]


def _history(out):
    return [json.loads(line) for line in (out / "deterministic" / "metrics.jsonl").read_text().splitlines()]


def _checkpoint(out):
    ckpt = out / "deterministic" / "checkpoint"
    return load_file(str(ckpt / "weights.safetensors")), load_file(str(ckpt / "optimizer.safetensors"))


@pytest.fixture(scope="module")
def one_trainer_run(stories_dir, tmp_path_factory):
    """The one-trainer run of SMALL (with --export-hf) that the two-trainer runs below must equal bit for bit:
    made once, only read by the tests."""
    one = tmp_path_factory.mktemp("one_trainer") / "one"
    assert rl_main([str(stories_dir), *SMALL, "--export-hf", "--out", str(one)]) == 0
    return one


@pytest.mark.slow
def test_two_trainer_ranks_mismatch_zero_and_the_one_trainer_runs_bits(stories_dir, one_trainer_run, tmp_path,
                                                                         capsys):
    two, one = tmp_path / "two", one_trainer_run
    assert rl_main([str(stories_dir), *SMALL, "--trainer-ranks", "2", "--check", "--out", str(two)]) == 0
    assert "check passed: deterministic mismatch exactly 0 at all 2 steps" in capsys.readouterr().out
    a, b = _history(two), _history(one)
    assert all(r["mismatch_tokens"] > 0 and r["mismatch_bits_differ"] == 0 for r in a)
    assert [r["weights_hash"] for r in a] == [r["weights_hash"] for r in b]
    assert len({r["weights_hash"] for r in a}) == 2  # the weights moved, and step 2 sampled the pushed ones
    for got, want in zip(_checkpoint(two), _checkpoint(one)):
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
def test_two_trainer_ranks_resume_and_export_as_one_trainer_does(stories_dir, one_trainer_run, tmp_path):
    """A checkpoint of the gathered shards, read back into shards by both ranks: the resumed run continues the
    one-trainer run's bits; --export-hf writes the gathered weights."""
    two, one = tmp_path / "two", one_trainer_run
    first = list(SMALL)
    first[SMALL.index("--steps") + 1] = "1"
    assert rl_main([str(stories_dir), *first, "--trainer-ranks", "2", "--out", str(two)]) == 0
    assert rl_main([str(stories_dir), *SMALL, "--trainer-ranks", "2", "--resume", "--export-hf", "--out",
                    str(two)]) == 0
    a, b = _history(two), _history(one)
    assert [r["weights_hash"] for r in a] == [r["weights_hash"] for r in b] and len(a) == 2
    for got, want in zip(_checkpoint(two), _checkpoint(one)):
        assert all(torch.equal(got[k], want[k]) for k in want)
    hf_two = load_file(str(two / "deterministic" / "hf" / "model.safetensors"))
    hf_one = load_file(str(one / "deterministic" / "hf" / "model.safetensors"))
    assert sorted(hf_two) == sorted(hf_one) and all(torch.equal(hf_two[k], hf_one[k]) for k in hf_one)


@pytest.mark.slow
def test_two_trainer_ranks_with_clipping_keep_mismatch_zero(stories_dir, tmp_path):
    config = RLConfig(task="emit-token", steps=2, prompts_per_step=2, n_samples=3, max_tokens=8, lr=3e-2,
                      trainer_ranks=2, train_batch_seqs=2, max_grad_norm=0.5)  # TP=1 sampler of its own
    history = run_arm(stories_dir, config, "deterministic", tmp_path / "r", device="cpu", progress=False,
                      max_model_len=64, log=None)
    assert all(h["mismatch_tokens"] > 0 and h["mismatch_bits_differ"] == 0 for h in history)
    assert history[0]["weights_hash"] != history[1]["weights_hash"] and history[0]["grad_norm"] > 0


def test_bad_trainer_rank_combinations_name_the_flags(stories_dir, tmp_path):
    with pytest.raises(ValueError, match=r"--trainer-ranks.*prompts_per_step \* n_samples = 9"):
        RLConfig(trainer_ranks=2, prompts_per_step=3, n_samples=3)
    with pytest.raises(ValueError, match=r"--trainer-ranks.*mini_batch_seqs = 3"):
        RLConfig(trainer_ranks=2, prompts_per_step=2, n_samples=2, mini_batch_seqs=3)
    with pytest.raises(ValueError, match=r"--kl-coef.*--trainer-ranks"):
        RLConfig(trainer_ranks=2, kl_coef=0.1)
    config = RLConfig(task="emit-token", trainer_ranks=2, prompts_per_step=2, n_samples=2)
    from detinfer.engine import LLM

    llm = LLM(str(stories_dir), device="cpu", max_model_len=64, num_kv_blocks=16, block_size=16)
    with pytest.raises(ValueError, match="give the model as a directory"):
        GRPOTrainer(llm, config, "deterministic")


@pytest.mark.slow
@pytest.mark.parametrize("next_section", ["step", "checkpoint"])
def test_a_dead_trainer_rank_is_an_error_naming_it_not_a_hang(stories_dir, next_section):
    """A follower killed between two collective sections: the next one (an update, or the gathered checkpoint
    a run writes at its end) fails naming the rank and its exit code."""
    config = RLConfig(task="emit-token", steps=3, prompts_per_step=2, n_samples=3, max_tokens=8, lr=3e-2,
                      trainer_ranks=2, train_batch_seqs=3)
    trainer = GRPOTrainer(stories_dir, config, "deterministic", device="cpu", max_model_len=64)
    try:
        trainer.step()
        follower = trainer._followers.procs[0]
        os.kill(follower.pid, signal.SIGKILL)
        follower.join(timeout=30)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"trainer rank 1 of 2 failed \(exit code -9"):
            trainer.step() if next_section == "step" else trainer.checkpoint_tensors()
        assert time.monotonic() - start < 60
    finally:
        trainer.close()


@pytest.mark.slow
def test_rank_zero_failing_to_build_its_sampler_ends_the_other_ranks(stories_dir):
    config = RLConfig(task="emit-token", prompts_per_step=2, n_samples=2, trainer_ranks=2, tensor_parallel_size=3,
                      tp_invariant_reduction=True)  # 3 does not divide stories260k's 8 heads
    start = time.monotonic()
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not fit"):
        GRPOTrainer(stories_dir, config, "deterministic", device="cpu", max_model_len=64)
    assert time.monotonic() - start < 60
    import multiprocessing

    assert not [p for p in multiprocessing.active_children() if p.name.startswith("detinfer-rl-trainer")]
