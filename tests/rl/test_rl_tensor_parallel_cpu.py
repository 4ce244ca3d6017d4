"""`detinfer rl` with a tensor-parallel sampler (CPU, gloo, 2 ranks; stories260k): the sampler is a TP=2 engine,
the trainer trains a one-process copy and pushes its weights into the sampler after every update. With
tp_invariant_reduction the mismatch is exactly 0 at every step, and the run is the one-process run with the
same flag bit for bit (weights hash per step). Without the push the sampler would sample step 2 from stale
weights (checked: mismatch > 0). Bad flag combinations are refused naming the flag."""

from __future__ import annotations

import json

import pytest
import torch

from detinfer.rl import GRPOTrainer, RLConfig
from detinfer.rl import engines as rl_engines
from detinfer.rl.checkpoint import check_compatible
from detinfer.rl.cli import main as rl_main
from detinfer.rl.engines import check_parallel_config, sampler_device

SMALL = ["--task", "emit-token", "--device", "cpu", "--max-model-len", "64", "--no-progress", "--steps", "2",
         "--prompts-per-step", "2", "--n-samples", "3", "--max-tokens", "8", "--lr", "3e-2"]


def _history(out):
    return [json.loads(line) for line in (out / "deterministic" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_tp2_sampler_mismatch_is_exactly_zero_and_equals_the_one_process_run(stories_dir, tmp_path, capsys):
    tp2, tp1 = tmp_path / "tp2", tmp_path / "tp1"
    assert rl_main([str(stories_dir), *SMALL, "--tensor-parallel-size", "2", "--tp-invariant-reduction",
                    "--layout", "split", "--check", "--out", str(tp2)]) == 0
    assert "check passed: deterministic mismatch exactly 0 at all 2 steps" in capsys.readouterr().out
    assert rl_main([str(stories_dir), *SMALL, "--tp-invariant-reduction", "--out", str(tp1)]) == 0
    a, b = _history(tp2), _history(tp1)
    assert len(a) == 2
    for rec in a:
        assert rec["mismatch_tokens"] > 0
        assert rec["mismatch_bits_differ"] == 0 and rec["mismatch_max_abs_diff"] == 0
    assert [r["weights_hash"] for r in a] == [r["weights_hash"] for r in b]
    assert len({r["weights_hash"] for r in a}) == 2  # the weights moved: step 2 sampled the pushed ones
    assert [r["sample_text"] for r in a] == [r["sample_text"] for r in b]


@pytest.mark.slow
def test_split_layout_at_tp1_is_the_one_engine_run_bit_for_bit(stories_dir, tmp_path):
    """Split at TP=1: a sampler engine of its own (on GPUs: the next GPU), fed by the push after every update."""
    split, one = tmp_path / "split", tmp_path / "one"
    assert rl_main([str(stories_dir), *SMALL, "--layout", "split", "--check", "--out", str(split)]) == 0
    assert rl_main([str(stories_dir), *SMALL, "--out", str(one)]) == 0
    a, b = _history(split), _history(one)
    assert all(r["mismatch_bits_differ"] == 0 and r["mismatch_tokens"] > 0 for r in a)
    assert [r["weights_hash"] for r in a] == [r["weights_hash"] for r in b]
    assert len({r["weights_hash"] for r in a}) == 2


@pytest.mark.slow
def test_bf16_engines_push_the_rounded_masters_mismatch_zero(stories_dir):
    """16-bit engines: the trainer steps fp32 masters, rounds them into its engine, and that engine's bf16
    tensors (the bits its forward uses) are what the TP=2 sampler gets."""
    config = RLConfig(task="emit-token", steps=2, prompts_per_step=2, n_samples=3, max_tokens=8, lr=3e-2,
                      dtype="bfloat16", tensor_parallel_size=2, tp_invariant_reduction=True)
    trainer = GRPOTrainer(stories_dir, config, "deterministic", device="cpu", max_model_len=64)
    try:
        assert trainer.trainer.master_weights and trainer.engine.dtype == torch.bfloat16
        history = [trainer.step(), trainer.step()]
    finally:
        trainer.close()
    assert all(h["mismatch_tokens"] > 0 and h["mismatch_bits_differ"] == 0 for h in history)
    assert history[0]["weights_hash"] != history[1]["weights_hash"]


@pytest.mark.slow
def test_without_the_push_the_tp_sampler_goes_stale(stories_dir, monkeypatch):
    monkeypatch.setattr(rl_engines, "push_to_sampler", lambda sampler, trainer: None)
    monkeypatch.setattr("detinfer.rl.grpo.push_to_sampler", lambda sampler, trainer: None)
    config = RLConfig(task="emit-token", steps=2, prompts_per_step=2, n_samples=3, max_tokens=8, lr=3e-2,
                      tensor_parallel_size=2, tp_invariant_reduction=True)
    trainer = GRPOTrainer(stories_dir, config, "deterministic", device="cpu", max_model_len=64)
    try:
        first, second = trainer.step(), trainer.step()
    finally:
        trainer.close()
    assert first["mismatch_bits_differ"] == 0
    assert second["mismatch_bits_differ"] > 0  # sampled with step 0's weights, scored with step 1's


def test_bad_parallel_flags_name_the_flag(stories_dir, tmp_path, capsys):
    with pytest.raises(ValueError, match="trainer_ranks"):
        RLConfig(trainer_ranks=0)
    with pytest.raises(ValueError, match="layout"):
        RLConfig(layout="sideways")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        RLConfig(tensor_parallel_size=0)
    needs_flag = RLConfig(tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size.*needs tp_invariant_reduction "
                                         r"\(--tp-invariant-reduction\)"):
        check_parallel_config(needs_flag, "deterministic")
    check_parallel_config(needs_flag, "fast")  # fast mode makes no bitwise claim
    assert rl_main([str(stories_dir), *SMALL, "--tensor-parallel-size", "2", "--out", str(tmp_path / "r")]) == 2
    assert "--tp-invariant-reduction" in capsys.readouterr().err
    assert rl_main([str(stories_dir), *SMALL, "--trainer-ranks", "4", "--out", str(tmp_path / "r")]) == 2
    assert "--trainer-ranks" in capsys.readouterr().err  # 2 prompts x 3 samples do not split over 4 ranks
    from detinfer.engine import LLM

    llm = LLM(str(stories_dir), device="cpu", max_model_len=64, num_kv_blocks=16, block_size=16)
    with pytest.raises(ValueError, match="give the model as a directory"):
        GRPOTrainer(llm, RLConfig(task="emit-token", layout="split"), "deterministic")


def test_layouts_place_the_sampler(monkeypatch):
    cpu = torch.device("cpu")
    assert sampler_device(cpu, RLConfig(tensor_parallel_size=2, layout="split")) == cpu
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    gpu0 = torch.device("cuda", 0)
    assert sampler_device(gpu0, RLConfig(tensor_parallel_size=2, layout="colocated")) == gpu0
    assert sampler_device(gpu0, RLConfig(tensor_parallel_size=2, layout="split")) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"layout 'split' \(--layout\).*cuda:1..3, but only 3 GPUs"):
        sampler_device(gpu0, RLConfig(tensor_parallel_size=3, layout="split"))


def test_resume_may_change_the_layout_and_older_checkpoints_count_as_the_defaults():
    config = RLConfig(task="emit-token")
    state = {"arm": "deterministic", "task": "emit-token", "config": config.replace(layout="split").to_dict()}
    check_compatible(state, config, "deterministic", "emit-token")  # the layout moves no bit
    older = {k: v for k, v in config.to_dict().items()
             if k not in ("tensor_parallel_size", "tp_invariant_reduction", "layout", "trainer_ranks")}
    check_compatible({**state, "config": older}, config, "deterministic", "emit-token")
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 1 -> 2"):
        check_compatible({**state, "config": older}, config.replace(tensor_parallel_size=2), "deterministic",
                         "emit-token")


@pytest.mark.slow
def test_a_failure_while_building_the_trainer_closes_the_engines(stories_dir, monkeypatch):
    """The engines (here a TP=2 sampler's worker process) are closed when building the trainer fails after
    they started, e.g. out of memory while sharding: nothing is left running."""
    from detinfer.engine import LLM
    from detinfer.rl import grpo

    closed = []
    close = LLM.close

    def counting_close(self):
        closed.append(self)
        return close(self)

    def failing_optimizer(*_args, **_kwargs):
        raise RuntimeError("out of memory (simulated)")
    monkeypatch.setattr(LLM, "close", counting_close)
    monkeypatch.setattr(grpo, "build_optimizer", failing_optimizer)
    config = RLConfig(task="emit-token", steps=1, prompts_per_step=2, n_samples=2, max_tokens=4,
                      tensor_parallel_size=2, tp_invariant_reduction=True, layout="split")
    with pytest.raises(RuntimeError, match="out of memory"):
        GRPOTrainer(str(stories_dir), config, device="cpu", max_model_len=64)
    assert len(closed) == 2  # the TP=2 sampler (its worker process) and the trainer's engine
    workers = [p for llm in closed for p in getattr(llm.engine.runner, "_procs", [])]
    assert workers and not any(p.is_alive() for p in workers)
