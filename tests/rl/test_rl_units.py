"""GRPO building blocks without a model: advantages, mismatch statistics, the weights fingerprint, seeds,
tasks, config validation, the block manager's prefix-cache reset and the CLI's argument errors."""

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from detinfer.engine.block_manager import BlockManager
from detinfer.engine.sampling_params import SamplingParams
from detinfer.engine.sequence import Sequence
from detinfer.rl.config import ARMS, RLConfig
from detinfer.rl.grpo import request_seed
from detinfer.rl.metrics import group_advantages, mismatch_stats, weights_fingerprint
from detinfer.rl.tasks import TASKS, Example, examples_for_step, get_task, last_int


def test_group_advantages_are_relative_to_the_group():
    adv = group_advantages([1.0, 0.0, 0.0, 0.5, 0.5, 0.5], 3)
    assert adv[3:] == [0.0, 0.0, 0.0]  # the second group has equal rewards: no preference, no gradient
    assert abs(sum(adv[:3])) < 1e-12 and adv[0] > 0 > adv[1] == adv[2]
    std = (2 / 9) ** 0.5  # population std of (1, 0, 0)
    assert adv[0] == pytest.approx((2 / 3) / std, rel=1e-5)
    assert group_advantages([1.0, 0.0], 2, scale=False) == [0.5, -0.5]
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages([1.0, 0.0], 3)


@given(st.integers(2, 6).flatmap(lambda n: st.tuples(
    st.just(n), st.lists(st.floats(-10, 10, allow_nan=False), min_size=n, max_size=3 * n).map(
        lambda xs: xs[:len(xs) // n * n]), st.randoms(use_true_random=False))))
def test_group_advantages_properties(case):
    n, rewards, rng = case
    adv = group_advantages(rewards, n)
    assert len(adv) == len(rewards)
    for g in range(0, len(rewards), n):
        assert abs(sum(adv[g:g + n])) < 1e-6 * n
        order = list(range(n))
        rng.shuffle(order)
        shuffled = group_advantages([rewards[g + i] for i in order], n)
        assert shuffled == [adv[g + i] for i in order]  # bitwise: sample order within a group is irrelevant


def test_mismatch_stats_zero_only_for_identical_bits():
    lp = torch.tensor([-1.0, -2.5, -0.125, -7.0])
    same = mismatch_stats(lp, lp.clone())
    assert same == {"tokens": 4, "bits_differ": 0.0, "max_abs_diff": 0.0, "mean_abs_diff": 0.0, "kl_k3": 0.0}
    other = lp.clone()
    other[1] = torch.nextafter(other[1], torch.tensor(0.0))  # one ulp
    m = mismatch_stats(lp, other)
    assert m["bits_differ"] == 0.25 and 0 < m["max_abs_diff"] < 1e-6 and m["kl_k3"] >= 0.0
    big = mismatch_stats(torch.tensor([-1.0, -1.0]), torch.tensor([-2.0, -0.5]))
    r = torch.tensor([1.0, -0.5], dtype=torch.float64)  # log(pi_trainer / pi_sampler)
    assert big["kl_k3"] == pytest.approx(float((r.exp() - 1 - r).mean()))
    assert big["max_abs_diff"] == 1.0 and big["mean_abs_diff"] == 0.75
    with pytest.raises(ValueError, match="1-D"):
        mismatch_stats(torch.zeros(2), torch.zeros(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_fingerprint_sees_every_bit(dtype):
    gen = torch.Generator().manual_seed(0)
    w = {"a": torch.randn(7, 5, generator=gen).to(dtype), "b": torch.randn(300, generator=gen).to(dtype)}
    h = weights_fingerprint(w.items())
    assert h == weights_fingerprint({k: v.clone() for k, v in w.items()}.items())
    for name, idx in (("a", (3, 2)), ("b", (299,)), ("b", (0,))):
        changed = {k: v.clone() for k, v in w.items()}
        bits = changed[name].view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
        bits[idx] ^= 1  # flip the lowest mantissa bit
        assert weights_fingerprint(changed.items()) != h
    swapped = {"a": w["a"], "b": w["b"].flip(0)}
    assert weights_fingerprint(swapped.items()) != h  # positions count, not only the multiset of values


def test_seeds_and_prompts_are_pure_functions_of_seed_and_step():
    assert request_seed(0, 5, 2) == request_seed(0, 5, 2)
    seeds = {request_seed(s, t, i) for s in range(2) for t in range(3) for i in range(4)}
    assert len(seeds) == 24 and all(0 <= x < 2 ** 63 for x in seeds)
    task = get_task("addition")
    assert examples_for_step(task, 1, 7, 5) == examples_for_step(task, 1, 7, 5)
    assert examples_for_step(task, 1, 7, 5) != examples_for_step(task, 1, 8, 5)


def test_builtin_rewards():
    add = Example("What is 12 + 30?", 42)
    assert TASKS["addition"].reward(add, "42", ()) == 1.0
    assert TASKS["addition"].reward(add, "The answer is 42.", ()) == 1.0
    assert TASKS["addition"].reward(add, "12 + 30 = 42", ()) == 1.0
    assert TASKS["addition"].reward(add, "41", ()) == 0.0
    assert TASKS["addition-partial"].reward(add, "41", ()) == 0.2
    assert TASKS["addition-partial"].reward(add, "I think 41", ()) == 0.0
    assert TASKS["addition-partial"].reward(add, " 42", ()) == 1.0
    rev = Example("Reverse: A B C", ("C", "B", "A"))
    assert TASKS["reverse"].reward(rev, "C B A", ()) == 1.0
    assert TASKS["reverse"].reward(rev, "C, A, B", ()) == pytest.approx(1 / 3)
    srt = TASKS["sort"].make_example(random.Random(0))
    assert TASKS["sort"].reward(srt, " ".join(srt.answer), ()) == 1.0
    emit = Example("Once upon a time", " the")
    assert TASKS["emit-token"].reward(emit, " the the the", (5, 5, 5)) == 1.0
    assert TASKS["emit-token"].reward(emit, " then there", (5, 6)) == 0.0
    assert TASKS["emit-token"].reward(emit, "", ()) == 0.0
    assert last_int("7 + 1,227 = 1,234") == 1234 and last_int("none") is None
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        get_task("nope")


def test_config_validation():
    assert RLConfig().n_samples >= 2 and ARMS == ("deterministic", "fast", "fast-tis")
    for bad, match in ((dict(n_samples=1), "n_samples"), (dict(tis_cap=0.0), "tis_cap"),
                       (dict(dtype="int8"), "dtype"), (dict(lr=float("nan")), "lr"),
                       (dict(max_grad_norm=0.0), "max_grad_norm"), (dict(steps=-1), "steps")):
        with pytest.raises(ValueError, match=match):
            RLConfig(**bad)
    with pytest.raises(TypeError, match="scale_rewards"):
        RLConfig(scale_rewards=1)


def test_block_manager_reset_prefix_cache():
    bm = BlockManager(8, 4)
    seq = Sequence(0, "r0", list(range(10)), SamplingParams(), seed=None)
    bm.allocate(seq)
    seq.num_computed_tokens = 10
    bm.commit_computed(seq)
    bm.free(seq)
    assert bm.num_cached_free_blocks == 2
    again = Sequence(1, "r1", list(range(10)), SamplingParams(), seed=None)
    assert bm.cached_prefix_tokens(again) == 8
    assert bm.reset_prefix_cache() == 2
    assert bm.num_cached_free_blocks == 0 and bm.num_free_blocks == 8
    assert bm.cached_prefix_tokens(again) == 0
    bm.check_invariants([])
    # a block still owned keeps its hash (only free cached blocks are dropped)
    bm.allocate(again)
    again.num_computed_tokens = 10
    bm.commit_computed(again)
    assert bm.reset_prefix_cache() == 0
    bm.check_invariants([again])


def _exit_status(main, argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's own errors exit
        return e.code


def test_cli_errors_are_one_line(capsys):
    from detinfer.rl.cli import main

    for argv, needle in ((["--model", "x", "--task", "nope", "--steps", "1"], "unknown task 'nope'"),
                         (["--model", "x", "--step", "3"], "unrecognized arguments: --step"),  # no abbreviations
                         (["--model", "x", "--n-samples", "1"], "n_samples must be >= 2"),
                         (["--model", "x", "--mode", "slow"], "invalid choice"),
                         (["--task", "addition"], "--model")):
        assert _exit_status(main, argv) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1 and err.startswith("detinfer rl: error:"), err


def test_rl_is_a_detinfer_command(capsys):
    from detinfer.cli import main

    assert main(["--help"]) == 0
    assert "  rl " in capsys.readouterr().out
