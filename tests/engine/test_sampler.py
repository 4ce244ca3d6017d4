"""Sampler: bitwise batch invariance, counter-based randomness, distribution sanity, masks, penalties,
logprobs."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from detinfer.engine.sampler import (
    _inclusive_scan,
    apply_penalties,
    compute_logprobs,
    gumbel_noise,
    sample,
    sampling_mask,
    sampling_scores,
    splitmix64,
)
from detinfer.engine.sampling_params import SamplingParams
from detinfer.kernels._fold import fold_sum

U64 = (1 << 64) - 1


def splitmix64_reference(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & U64
    return z ^ (z >> 31)


def fold_log_softmax(x, dim=-1, dtype=torch.float32):
    """Batch-invariant log_softmax from elementwise ops and fold_sum (what the engine's Ops provides)."""
    x = x.to(dtype)
    shifted = x - x.max(dim=dim, keepdim=True).values
    return shifted - torch.log(fold_sum(torch.exp(shifted), dim=dim, keepdim=True))


def probs_logits(probs):
    return torch.tensor([[math.log(p) for p in probs]], dtype=torch.float32)


def draw_many(logits_row, params, n, vary="position"):
    """n draws for one logits row: over output positions 0..n-1 (seed 1), or over seeds 0..n-1."""
    logits = logits_row.expand(n, -1).contiguous()
    idx = list(range(n))
    seeds, positions = (idx, [0] * n) if vary == "seed" else ([1] * n, idx)
    return sample(logits, [params] * n, seeds, positions)


@given(st.lists(st.integers(-(1 << 63), (1 << 63) - 1), min_size=1, max_size=20))
def test_splitmix64_matches_the_unsigned_reference(values):
    out = splitmix64(torch.tensor(values, dtype=torch.int64))
    assert [v & U64 for v in out.tolist()] == [splitmix64_reference(v & U64) for v in values]


def test_gumbel_noise_rows_are_pure_functions_of_their_key():
    seeds, pos, idx = torch.tensor([3, 3, 3, 4]), torch.tensor([0, 1, 0, 0]), torch.tensor([0, 0, 1, 0])
    noise = gumbel_noise(seeds, pos, idx, 257)
    for r in range(4):
        assert torch.equal(noise[r], gumbel_noise(seeds[r:r + 1], pos[r:r + 1], idx[r:r + 1], 257)[0])
    assert all(not torch.equal(noise[a], noise[b]) for a in range(4) for b in range(a))
    big = gumbel_noise(torch.tensor([11]), torch.tensor([0]), torch.tensor([0]), 200_000)[0]
    assert torch.isfinite(big).all()
    assert abs(big.mean().item() - 0.5772156649) < 0.01  # Euler-Mascheroni: the Gumbel mean
    assert abs(big.var().item() - math.pi ** 2 / 6) < 0.03


PARAMS = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]),
    top_k=st.sampled_from([0, -1, 1, 3, 50]),
    top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1]),
    min_p=st.sampled_from([0.0, 0.05, 0.5]),
    repetition_penalty=st.sampled_from([1.0, 1.3, 0.8]),
    presence_penalty=st.sampled_from([0.0, 0.5, -1.0]),
    frequency_penalty=st.sampled_from([0.0, 0.25]),
)


@st.composite
def sampling_rows(draw):
    vocab = draw(st.sampled_from([5, 37, 1000, 4099]))
    n = draw(st.integers(1, 6))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    logits = torch.randn(n, vocab, generator=gen) * draw(st.sampled_from([0.5, 3.0]))
    if draw(st.booleans()):  # exact ties and masked vocabulary entries
        logits[:, : vocab // 2] = logits[:, : vocab // 2].round()
        logits[:, -1] = float("-inf")
    tokens = st.lists(st.integers(0, vocab - 1), max_size=12)
    rows = [dict(params=draw(PARAMS), seed=draw(st.integers(0, (1 << 63) - 1)), position=draw(st.integers(0, 10**6)),
                 index=draw(st.integers(0, 3)), prompt=draw(tokens), output=draw(tokens)) for _ in range(n)]
    return logits, rows


def row_args(rows):
    return [[r[key] for r in rows] for key in ("params", "seed", "position", "index", "prompt", "output")]


def run_rows(logits, rows):
    return sampling_scores(logits, *row_args(rows))


@given(sampling_rows(), st.randoms(use_true_random=False))
def test_each_row_gets_the_same_scores_and_token_in_any_batch(case, rnd):
    # Every bit of a row's scores (penalised logits / T + noise, masks) must not depend on the batch;
    # the token is their argmax.
    logits, rows = case
    full = run_rows(logits, rows)
    for r in range(len(rows)):  # alone
        assert torch.equal(run_rows(logits[r:r + 1], rows[r:r + 1]), full[r:r + 1])
    order = list(range(len(rows))) * 2  # shuffled, with every row twice
    rnd.shuffle(order)
    mixed = run_rows(logits[order], [rows[i] for i in order])
    assert torch.equal(mixed, full[order])
    tokens = sample(logits, *row_args(rows))
    assert torch.equal(tokens, full.argmax(-1))


def greedy_batch_agrees_with_the_fp64_scores(logits, rows):
    # An all-greedy batch takes the argmax of the fp32 rows (no fp64 copy): the same token as the
    # argmax of the fp64 scores, ties, -inf and NaN rows included.
    rows = [dict(r, params=SamplingParams(temperature=0.0, repetition_penalty=r["params"].repetition_penalty))
            for r in rows]
    logits = logits.clone()
    logits[0, 1] = float("nan")  # a NaN is the maximum for argmax on both paths
    if logits.shape[0] > 1:
        logits[1] = float("-inf")
    tokens = sample(logits, *row_args(rows))
    assert torch.equal(tokens, run_rows(logits, rows).argmax(-1))


@given(sampling_rows())
def test_all_greedy_batches_match_the_fp64_argmax(case):
    greedy_batch_agrees_with_the_fp64_scores(*case)


def test_greedy_is_argmax_with_ties_to_the_lowest_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    greedy = SamplingParams(temperature=0, top_k=1, seed=5)
    assert sample(logits, [greedy] * 2, [None, 7], [0, 9]).tolist() == [1, 0]


def test_draws_differ_across_seeds_positions_and_sample_indices():
    flat = torch.zeros(1, 1000)
    p = SamplingParams()
    by_seed = draw_many(flat, p, 64, vary="seed")
    by_position = draw_many(flat, p, 64, vary="position")
    by_index = sample(flat.expand(64, -1), [p] * 64, [1] * 64, [0] * 64, list(range(64)))
    for draws in (by_seed, by_position, by_index):
        assert len(set(draws.tolist())) > 50  # ~62 expected for 64 uniform draws from 1000
    again = sample(flat.expand(64, -1), [p] * 64, [1] * 64, list(range(64)))
    assert torch.equal(again, by_position)  # a pure function: the same keys give the same draws


def chi_square(draws, probs):
    n = draws.numel()
    counts = torch.bincount(draws, minlength=len(probs)).tolist()
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True))


@pytest.mark.parametrize("vary", ["position", "seed"])
def test_empirical_distribution_matches_softmax(vary):
    probs = [0.4, 0.25, 0.15, 0.1, 0.07, 0.03]
    draws = draw_many(probs_logits(probs), SamplingParams(), 4000, vary)
    assert chi_square(draws, probs) < 20.5  # chi-square 0.999 quantile, 5 degrees of freedom
    squared = [p * p for p in probs]  # temperature 0.5 squares the probabilities (renormalised)
    squared = [q / sum(squared) for q in squared]
    draws = draw_many(probs_logits(probs), SamplingParams(temperature=0.5), 4000, vary)
    assert chi_square(draws, squared) < 20.5


def mask_of(probs, top_k=0, top_p=1.0, min_p=0.0):
    return sampling_mask(probs_logits(probs), torch.tensor([top_k]), torch.tensor([top_p]),
                         torch.tensor([min_p]))[0].tolist()


def test_top_k_mask_keeps_ties():
    logits = torch.tensor([[5.0, 4.0, 4.0, 4.0, 1.0]])
    keep = sampling_mask(logits, torch.tensor([2]), torch.tensor([1.0]), torch.tensor([0.0]))
    assert keep[0].tolist() == [True, True, True, True, False]
    probs = [0.1, 0.3, 0.2, 0.25, 0.15]
    assert mask_of(probs, top_k=2) == [False, True, False, True, False]
    assert mask_of(probs, top_k=-1) == [True] * 5 and mask_of(probs, top_k=99) == [True] * 5


def test_top_p_mask_is_the_smallest_set_reaching_p():
    probs = [0.125, 0.5, 0.125, 0.25]
    assert mask_of(probs, top_p=0.3) == [False, True, False, False]
    assert mask_of(probs, top_p=0.7) == [False, True, False, True]
    assert mask_of(probs, top_p=0.8) == [True, True, True, True]  # the two 0.125 tie: both kept
    # top-p applies to the top-k survivors, renormalised: {0.5, 0.25} -> {2/3, 1/3}.
    assert mask_of(probs, top_k=2, top_p=0.6) == [False, True, False, False]
    assert mask_of(probs, top_p=0.6) == [False, True, False, True]


def test_min_p_mask_is_relative_to_the_top_probability():
    probs = [0.125, 0.5, 0.125, 0.25]
    assert mask_of(probs, min_p=0.3) == [False, True, False, True]
    assert mask_of(probs, min_p=0.2) == [True, True, True, True]
    assert mask_of(probs, min_p=1.0) == [False, True, False, False]


def test_masked_tokens_are_never_drawn_and_the_rest_keep_their_ratios():
    probs = [0.1, 0.3, 0.2, 0.25, 0.15]
    draws = draw_many(probs_logits(probs), SamplingParams(top_k=2), 3000)
    assert set(draws.tolist()) == {1, 3}
    # Token 1 vs token 3 (as 0 / 1) keep their renormalised ratio 0.3 : 0.25.
    assert chi_square((draws == 3).long(), [0.3 / 0.55, 0.25 / 0.55]) < 10.8  # 0.999 quantile, 1 d.o.f.
    # min_p 0.7 keeps p >= 0.21: tokens 1 (0.3) and 3 (0.25).
    assert set(draw_many(probs_logits(probs), SamplingParams(min_p=0.7), 500).tolist()) == {1, 3}
    nucleus = draw_many(probs_logits(probs), SamplingParams(top_p=0.7), 500)  # 0.3 + 0.25 + 0.2 >= 0.7
    assert set(nucleus.tolist()) == {1, 2, 3}


def test_penalties_follow_the_documented_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    prompt, output = [[0]], [[1, 1, 2]]
    rep = apply_penalties(logits, [SamplingParams(repetition_penalty=2.0)], prompt, output)
    assert rep.tolist() == [[1.0, -2.0, 0.25, 3.0]]
    add = apply_penalties(logits, [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)], prompt, output)
    assert add.tolist() == [[2.0, -2.0, -0.25, 3.0]]  # prompt tokens are not counted
    same = apply_penalties(logits, [SamplingParams()], prompt, output)
    assert same is logits
    both = apply_penalties(logits.repeat(2, 1), [SamplingParams(repetition_penalty=2.0), SamplingParams()],
                           prompt * 2, output * 2)
    assert torch.equal(both[1], logits[0])  # a row without penalties is untouched in a mixed batch
    greedy = SamplingParams(temperature=0, repetition_penalty=4.0)
    assert sample(torch.tensor([[2.0, 1.0]]), [greedy], [None], [1], None, [[0]], [[]]).item() == 1


def test_invalid_inputs_are_rejected():
    logits = torch.zeros(2, 5)
    p = SamplingParams()
    with pytest.raises(ValueError, match="2-D float32 tensor"):
        sample(logits.double(), [p] * 2, [1, 1], [0, 0])
    with pytest.raises(ValueError, match=r"seeds must have one entry per logits row \(2\), got 1"):
        sample(logits, [p] * 2, [1], [0, 0])
    with pytest.raises(ValueError, match="row 1: temperature 1.0 > 0 needs a seed"):
        sample(logits, [p] * 2, [1, None], [0, 0])
    with pytest.raises(ValueError, match=r"row 0: position \(-1\)"):
        sample(logits, [p] * 2, [1, 1], [-1, 0])
    pen = SamplingParams(repetition_penalty=1.5)
    with pytest.raises(ValueError, match="penalties need prompt_token_ids and output_token_ids"):
        sample(logits, [pen] * 2, [1, 1], [0, 0])
    with pytest.raises(ValueError, match=r"outside \[0, 5\)"):
        sample(logits, [pen] * 2, [1, 1], [0, 0], None, [[1], [9]], [[], []])
    with pytest.raises(TypeError, match="params\\[0\\] must be a SamplingParams"):
        sample(logits, [{}, p], [1, 1], [0, 0])


def test_inclusive_scan_is_a_cumsum():
    x = torch.arange(1, 12, dtype=torch.float32).repeat(3, 1)
    assert torch.equal(_inclusive_scan(x), torch.cumsum(x, dim=-1))
    y = torch.rand(4, 1001, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(_inclusive_scan(y), torch.cumsum(y, dim=-1), rtol=1e-5)
    assert torch.equal(_inclusive_scan(y)[2], _inclusive_scan(y[2:3])[0])


def test_compute_logprobs_values_ranks_and_top_k():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    out = compute_logprobs(logits, [2, 3], 3, fold_log_softmax)
    ref = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(out.token_logprobs, ref[[0, 1], [2, 3]], atol=1e-6)
    assert out.token_ranks.tolist() == [1, 2]  # ties share the best rank
    assert out.top_token_ids.tolist() == [[1, 2, 0], [2, 3, 0]]  # ties: lowest id first
    assert torch.allclose(out.top_logprobs, ref.gather(1, out.top_token_ids), atol=1e-6)
    none = compute_logprobs(logits, torch.tensor([0, 0]), 0, fold_log_softmax)
    assert none.top_token_ids.shape == (2, 0) and none.top_logprobs.shape == (2, 0)


def test_compute_logprobs_validation():
    logits = torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"top_k must be an int in \[0, 4\]"):
        compute_logprobs(logits, [0, 0], 5, fold_log_softmax)
    with pytest.raises(ValueError, match=r"token_ids must be in \[0, 4\)"):
        compute_logprobs(logits, [0, 4], 1, fold_log_softmax)
    with pytest.raises(ValueError, match=r"one id per logits row \(2\), got 3"):
        compute_logprobs(logits, [0, 1, 2], 1, fold_log_softmax)


@given(rows=st.integers(1, 8), vocab=st.sampled_from([3, 50, 1001]), k=st.integers(0, 3),
       seed=st.integers(0, 2**31), data=st.data())
def test_compute_logprobs_is_batch_invariant(rows, vocab, k, seed, data):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 4
    ids = torch.randint(0, vocab, (rows,), generator=gen)
    full = compute_logprobs(logits, ids, k, fold_log_softmax)
    r = data.draw(st.integers(0, rows - 1))
    lo = data.draw(st.integers(0, r))
    part = compute_logprobs(logits[lo:r + 1], ids[lo:r + 1], k, fold_log_softmax)
    for a, b in zip(full, part, strict=True):
        assert torch.equal(a[lo:r + 1], b)


def test_compute_logprobs_with_the_engine_log_softmax():
    from detinfer.ops import Ops

    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(3))
    log_softmax = Ops("deterministic").log_softmax
    full = compute_logprobs(logits, [1, 2, 3, 4, 5], 4, log_softmax)
    one = compute_logprobs(logits[3:4], [4], 4, log_softmax)
    assert all(torch.equal(a[3:4], b) for a, b in zip(full, one, strict=True))
    assert torch.allclose(full.token_logprobs, torch.log_softmax(logits, -1)[range(5), [1, 2, 3, 4, 5]],
                          atol=1e-5)


@pytest.mark.gpu
def test_cuda_hash_bits_match_cpu():
    keys = torch.tensor([0, 1, -5, 123456789, (1 << 63) - 1, -(1 << 63)], dtype=torch.int64)
    assert torch.equal(splitmix64(keys.cuda()).cpu(), splitmix64(keys))
    args = torch.tensor([3, 2**40]), torch.tensor([0, 77]), torch.tensor([0, 2])
    cpu = gumbel_noise(*args, 1000)
    cuda = gumbel_noise(*(a.cuda() for a in args), 1000).cpu()
    assert torch.allclose(cpu, cuda, rtol=1e-12)  # same hash bits; log may differ in the last ulp


@pytest.mark.gpu
@given(sampling_rows(), st.randoms(use_true_random=False))
def test_cuda_rows_get_the_same_scores_in_any_batch(case, rnd):
    logits, rows = case
    logits = logits.cuda()
    full = run_rows(logits, rows)
    for r in range(len(rows)):
        assert torch.equal(run_rows(logits[r:r + 1], rows[r:r + 1]), full[r:r + 1])
    order = list(range(len(rows))) * 2
    rnd.shuffle(order)
    assert torch.equal(run_rows(logits[order], [rows[i] for i in order]), full[order])


@pytest.mark.gpu
@given(sampling_rows())
def test_cuda_all_greedy_batches_match_the_fp64_argmax(case):
    logits, rows = case
    greedy_batch_agrees_with_the_fp64_scores(logits.cuda(), rows)
