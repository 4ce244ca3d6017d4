"""`detinfer rl --offload-optimizer` on CPU (stories260k): AdamW's state in host memory (OffloadedAdamW over the
same two param groups), stepped by torch's fused CPU AdamW. An offloaded run is its own trajectory: its first
step's rollout, loss and gradient are the non-offloaded run's and its weights stay within rounding of them;
a resumed offloaded run continues it bit for bit; with two trainer ranks (FSDP2 shards, gloo) the host copies
are of each rank's local shard, and the run, its checkpoint and its resume are the one offloaded trainer's
bits."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from detinfer.rl import GRPOTrainer, RLConfig, run_arm
from detinfer.rl.cli import main as rl_main
from detinfer.rl.loss import decays
from detinfer.train.optim import OffloadedAdamW

# 9 sequences in micro-batches of 4, 4, 1; weight decay on, so both param groups' settings matter
CFG = RLConfig(task="emit-token", steps=3, prompts_per_step=3, n_samples=3, max_tokens=8, lr=3e-3,
               weight_decay=0.1, train_batch_seqs=4)
TIMING = ("rollout_s", "train_s", "step_s")


def _run(model_dir, out, config, **kw):
    return run_arm(model_dir, config, "deterministic", out, device="cpu", progress=False, max_model_len=64,
                   log=None, **kw)


def _untimed(history):
    return [{k: v for k, v in h.items() if k not in TIMING} for h in history]


def _checkpoint(out):
    ckpt = out / "deterministic" / "checkpoint"
    return load_file(str(ckpt / "weights.safetensors")), load_file(str(ckpt / "optimizer.safetensors"))


def _assert_same_checkpoints(a, b):
    for got, want in zip(_checkpoint(a), _checkpoint(b)):
        assert sorted(got) == sorted(want) and len(want) > 0
        assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]


@pytest.fixture(scope="module")
def on_device_run(stories_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("rl-on-device")
    return out, _run(stories_dir, out, CFG)


@pytest.fixture(scope="module")
def offloaded_run(stories_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("rl-offloaded")
    return out, _run(stories_dir, out, CFG.replace(offload_optimizer=True))


def test_offloaded_run_moves_the_weights_within_rounding_of_the_on_device_run(on_device_run, offloaded_run):
    (out_a, history_a), (out_b, history_b) = on_device_run, offloaded_run
    first = {k: v for k, v in _untimed(history_b)[0].items() if k != "weights_hash"}
    assert first == {k: v for k, v in _untimed(history_a)[0].items() if k != "weights_hash"}  # before the update
    assert len({h["weights_hash"] for h in history_b}) == 3  # the weights do move
    (got, _), (want, _) = _checkpoint(out_b), _checkpoint(out_a)
    assert sorted(got) == sorted(want)
    for name in want:  # another AdamW kernel, the same arithmetic: the weights differ by rounding only
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_kept_logits_run_equals_the_chunked_run_bitwise(stories_dir, on_device_run, tmp_path):
    """--keep-logits: the trainer keeps [tokens, vocab] logits for backward instead of recomputing chunks;
    deterministic mode gives the same metrics, weights hashes and checkpoint."""
    out_a, history_a = on_device_run
    history_b = _run(stories_dir, tmp_path, CFG.replace(keep_logits=True))
    assert _untimed(history_b) == _untimed(history_a)
    _assert_same_checkpoints(tmp_path, out_a)
    with pytest.raises(TypeError, match="keep_logits must be a bool"):
        CFG.replace(keep_logits="yes")


def test_offloaded_resume_equals_the_uninterrupted_run(stories_dir, offloaded_run, tmp_path):
    out_a, history_a = offloaded_run
    offload = CFG.replace(offload_optimizer=True)
    assert _untimed(_run(stories_dir, tmp_path, offload.replace(steps=2))) == _untimed(history_a[:2])
    resumed = _run(stories_dir, tmp_path, offload, resume=True)  # a fresh optimizer, its state from the checkpoint
    assert _untimed(resumed) == _untimed(history_a)
    _assert_same_checkpoints(tmp_path, out_a)
    with pytest.raises(ValueError, match="cannot resume with different settings .*offload_optimizer"):
        _run(stories_dir, tmp_path, CFG.replace(steps=4), resume=True)


def test_build_optimizer_offloads_the_two_groups(stories_dir):
    trainer = GRPOTrainer(stories_dir, CFG.replace(offload_optimizer=True), "deterministic", device="cpu",
                          max_model_len=64)
    try:
        opt = trainer.optimizer
        assert isinstance(opt, OffloadedAdamW)
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
        assert all(h.device.type == "cpu" and h is not p for h, p in zip(opt.host, opt.params))
        named = list(trainer.trainer.named_parameters())
        decayed = [id(p) for n, p in named if decays(n, p)]
        assert 0 < len(decayed) < len(named)
        assert [id(p) for p in opt.params] == decayed + [id(p) for n, p in named if not decays(n, p)]
    finally:
        trainer.close()


SMALL = ["--task", "emit-token", "--device", "cpu", "--max-model-len", "64", "--no-progress", "--steps", "2",
         "--prompts-per-step", "2", "--n-samples", "3", "--max-tokens", "8", "--lr", "3e-2", "--weight-decay", "0.1",
         "--tensor-parallel-size", "2", "--tp-invariant-reduction", "--max-grad-norm", "none",
         "--train-batch-seqs", "3"]


def _history(out):
    return [json.loads(line) for line in (out / "deterministic" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_trainer_ranks_offload_their_shards_and_resume_as_one_trainer_does(stories_dir, tmp_path, monkeypatch):
    """Each FSDP rank steps its local shard on the host; the checkpoint gathers the moments from the shards and a
    resume puts each rank's slice back: the one offloaded trainer's bits throughout. Rank 0 steps with half of
    torch's threads (the ranks share the host) and gives them back when the run ends."""
    threads, calls = torch.get_num_threads(), []
    set_threads = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append(n), set_threads(n)))
    one, two = tmp_path / "one", tmp_path / "two"
    assert rl_main([str(stories_dir), *SMALL, "--offload-optimizer", "--out", str(one)]) == 0
    first = list(SMALL)
    first[SMALL.index("--steps") + 1] = "1"
    assert rl_main([str(stories_dir), *first, "--trainer-ranks", "2", "--offload-optimizer", "--out", str(two)]) == 0
    assert _history(two)[0]["weights_hash"] == _history(one)[0]["weights_hash"]
    assert rl_main([str(stories_dir), *SMALL, "--trainer-ranks", "2", "--offload-optimizer", "--resume", "--out",
                    str(two)]) == 0
    a, b = _history(two), _history(one)
    assert [r["weights_hash"] for r in a] == [r["weights_hash"] for r in b] and len(a) == 2
    assert all(r["mismatch_tokens"] > 0 and r["mismatch_bits_differ"] == 0 for r in a)
    _assert_same_checkpoints(two, one)
    assert calls == [max(1, threads // 2), threads] * 2 and torch.get_num_threads() == threads  # two 2-rank runs
