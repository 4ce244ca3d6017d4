"""Analysis of completions on synthetic data whose answers are known by construction."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from detinfer.repro.analysis import (
    CONTEXT_TOKENS,
    Completion,
    first_divergence,
    first_logprob_divergence,
    max_logprob_difference,
    summarize,
)

SHARED = [f"w{i} " for i in range(102)]  # 102 shared tokens, as in the study's Feynman prompt


def _queens(run, variant, lp_shift=0.0):
    """Token-string completions: SHARED, then 'Queens, New York' (variant 0) or 'New York City' (1)."""
    tail = ["Queens", ",", " New", " York", "."] if variant == 0 else ["New", " York", " City", "."]
    tokens = SHARED + tail
    logprobs = [-0.5] * len(SHARED) + [-0.25] * len(tail)
    logprobs[50] += lp_shift  # numerical drift inside the shared prefix
    # the divergence token's alternatives: each run saw the other's token as its runner-up
    top = [((t, lp),) for t, lp in zip(tokens, logprobs)]
    other = "New" if variant == 0 else "Queens"
    top[102] = ((tokens[102], logprobs[102]), (other, -1.75))
    return Completion(run=run, text="".join(tokens), tokens=tokens, logprobs=logprobs, top_logprobs=top)


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([9], [1]) == 0
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # one run stopped earlier
    assert first_divergence([], []) is None
    assert first_divergence([], [4]) == 0


def test_queens_vs_new_york_city():
    runs = [_queens(r, 1 if r in (3, 7) else 0) for r in range(10)]
    s = summarize(runs)
    assert (s.n, s.unit, s.num_unique, s.most_common_count) == (10, "token", 2, 8)
    assert [g.count for g in s.groups] == [8, 2]
    assert s.groups[1].runs == (3, 7)
    assert s.agreed_prefix == 102
    assert s.divergence_from_mode == (None, 102)
    assert s.divergence_positions == [102, 102]
    assert len(s.pairs) == 1 and s.pairs_left_out == 0
    p = s.pairs[0]
    assert (p.a, p.b, p.a_count, p.b_count, p.index) == (0, 1, 8, 2, 102)
    assert p.prefix.endswith("w100 w101 ") and len(p.prefix) == 80
    assert p.a_text == "Queens, New York." and p.b_text == "New York City."
    assert not p.a_ended and not p.b_ended
    assert (p.a_logprob, p.b_logprob) == (-0.25, -0.25)
    assert (p.a_logprob_of_b_token, p.b_logprob_of_a_token) == (-1.75, -1.75)
    # identical logprobs over the shared prefix: the flip is not preceded by drift
    assert p.first_logprob_diff is None and p.max_prefix_logprob_diff == 0.0
    assert [w[0] for w in p.logprob_window] == [98, 99, 100, 101, 102]
    assert s.num_unique_logprobs == 2
    assert [g.logprob_variants for g in s.groups] == [1, 1]


def test_logprob_drift_is_found_without_a_token_flip():
    runs = [_queens(0, 0), _queens(1, 0, lp_shift=2.0 ** -20), _queens(2, 0)]
    s = summarize(runs)
    assert s.num_unique == 1 and s.pairs == ()
    assert s.num_unique_logprobs == 2
    assert s.groups[0].logprob_variants == 2
    assert s.logprob_divergence == (50,)
    assert first_logprob_divergence(runs[0], runs[2]) is None
    assert first_logprob_divergence(runs[0], runs[1]) == 50


def test_reference_is_the_majority_numerics_not_an_outlier():
    """Run 0 alone has different logprob bits from runs 1-3: they are the reference, and run 0 is the
    one reported as departing (at the drifted position)."""
    runs = [_queens(0, 0, lp_shift=0.5)] + [_queens(r, 0) for r in (1, 2, 3)]
    s = summarize(runs)
    assert s.reference_run == 1 and s.groups[0].completion.run == 1
    assert s.groups[0].variant_counts == (3, 1) and s.groups[0].logprob_variants == 2
    assert s.logprob_divergence == (50,)


def test_pair_reports_drift_before_the_flip():
    a, b = _queens(0, 0), _queens(1, 1, lp_shift=-0.125)
    p = summarize([a, b]).pairs[0]
    assert p.first_logprob_diff == 50
    assert p.max_prefix_logprob_diff == 0.125


def test_logprob_bits_distinguish_signed_zero():
    a = Completion(0, "ab", tokens=(1, 2), logprobs=(0.0, -1.0))
    b = Completion(1, "ab", tokens=(1, 2), logprobs=(-0.0, -1.0))
    s = summarize([a, b])
    assert s.num_unique == 1 and s.num_unique_logprobs == 2
    assert s.logprob_divergence == (0,)


def test_prefix_completion_and_end_marker():
    long = Completion(0, "abcd", tokens=("a", "b", "c", "d"))
    short = Completion(1, "ab", tokens=("a", "b"))
    p = summarize([long, short, Completion(2, "abcd", tokens=("a", "b", "c", "d"))]).pairs[0]
    assert p.index == 2 and p.a_text == "cd" and p.b_text == "" and p.b_ended and not p.a_ended


def test_continuation_is_limited_and_multibyte_text_decodes_whole():
    # Byte-level tokens: "é" is two tokens; decoding the tokens alone would cut it in half.
    def decode(ids):
        return bytes(ids).decode("utf-8", errors="replace")

    shared = list(b"caf")
    a = shared + list("é is open".encode()) + [ord("!")] * 40
    b = shared + list(b"e is shut")
    s = summarize([Completion(0, decode(a), tokens=a), Completion(1, decode(b), tokens=b)], decode=decode)
    p = s.pairs[0]
    assert p.index == 3 and p.prefix == "caf"
    assert p.a_text.startswith("é is open") and len(p.a_text.encode()) == CONTEXT_TOKENS
    assert p.b_text == "e is shut"


def test_text_only_completions_compare_characters():
    s = summarize([Completion(0, "hello world"), Completion(1, "hello there"), Completion(2, "hello world")])
    assert s.unit == "char" and s.num_unique == 2 and s.agreed_prefix == 6
    assert s.pairs[0].a_text == "world" and s.pairs[0].b_text == "there"
    assert s.num_unique_logprobs is None and s.logprob_divergence == ()


def test_groups_rank_by_count_then_first_run_and_pairs_are_capped():
    runs = [Completion(r, t, tokens=tuple(t)) for r, t in enumerate("cbaab" "dde" "e")]
    s = summarize(runs, max_pairs=3)
    assert [(g.completion.text, g.count) for g in s.groups] == [("b", 2), ("a", 2), ("d", 2), ("e", 2), ("c", 1)]
    assert s.num_unique == 5 and len(s.pairs) == 3 and s.pairs_left_out == 10 - 3
    assert [(p.a, p.b) for p in s.pairs] == [(0, 1), (0, 2), (0, 3)]


@pytest.mark.parametrize("bad, match", [
    ([], "no completions"),
    ([Completion(0, "a"), Completion(0, "b")], "distinct run"),
    ([Completion(0, "a", tokens=("a",)), Completion(1, "b")], "every completion carries tokens"),
])
def test_summarize_refuses_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        summarize(bad)


def test_completion_validation():
    with pytest.raises(ValueError, match="2 logprobs for 1 tokens"):
        Completion(0, "a", tokens=(1,), logprobs=(-1.0, -2.0))
    with pytest.raises(ValueError, match="top_logprobs"):
        Completion(0, "a", tokens=(1,), logprobs=(-1.0,), top_logprobs=())
    with pytest.raises(TypeError, match="run must be an int"):
        Completion("0", "a")
    with pytest.raises(ValueError, match="max_pairs"):
        summarize([Completion(0, "a")], max_pairs=-1)
    assert math.isinf(Completion(0, "a", tokens=(1,), logprobs=(float("-inf"),)).logprobs[0])


def test_max_logprob_difference_counts_only_positions_where_the_tokens_agree():
    """Reference: the majority (runs 0-2). Run 3 drifts by 2^-20 at token 50; run 4 drifts by 0.125 at
    token 50, then takes another token at 102 and its logprobs there and after (1.5 off) are not
    comparable: the largest difference is 0.125, run 4, token 50."""
    runs = [_queens(r, 0) for r in range(3)] + [_queens(3, 0, lp_shift=2.0 ** -20), _queens(4, 1, lp_shift=0.125)]
    tail = list(runs[4].logprobs)
    tail[102:] = [lp - 1.5 for lp in tail[102:]]
    runs[4] = Completion(4, runs[4].text, tokens=runs[4].tokens, logprobs=tail)
    s = summarize(runs)
    assert s.reference_run == 0
    assert s.max_logprob_diff == 0.125 and s.max_logprob_diff_at == (4, 50)
    assert max_logprob_difference(runs[0], runs[:4]) == (2.0 ** -20, (3, 50))


def test_max_logprob_difference_is_zero_when_the_logprobs_reproduce():
    runs = [_queens(r, r % 2) for r in range(4)]  # two texts, identical logprobs where they agree
    s = summarize(runs)
    assert s.max_logprob_diff == 0.0 and s.max_logprob_diff_at is None
    assert summarize([Completion(0, "ab"), Completion(1, "ab")]).max_logprob_diff is None  # no logprobs
    inf = Completion(0, "ab", tokens=(1, 2), logprobs=(float("-inf"), -1.0))
    assert max_logprob_difference(inf, [Completion(1, "ab", tokens=(1, 2), logprobs=(-3.0, -1.0))]) == (0.0, None)


_runs = st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=6),
                           st.lists(st.floats(-8, 0, width=32), min_size=6, max_size=6)), min_size=1, max_size=6)


@given(_runs)
def test_max_logprob_difference_property(spec):
    """Over random runs: the result is the largest |difference| at a position inside a run's shared token
    prefix with the reference, it names such a position, and it does not depend on the runs' order."""
    comps = [Completion(r, "", tokens=tuple(t), logprobs=tuple(lp[:len(t)])) for r, (t, lp) in enumerate(spec)]
    ref = comps[0]
    diffs = {}
    for c in comps:
        shared = first_divergence(ref.units, c.units)
        shared = min(len(ref.units), len(c.units)) if shared is None else shared
        diffs.update({(c.run, i): abs(c.logprobs[i] - ref.logprobs[i]) for i in range(shared)})
    best, at = max_logprob_difference(ref, comps)
    assert best == max(diffs.values())
    assert (at is None) == (best == 0.0) and (at is None or diffs[at] == best)
    assert max_logprob_difference(ref, comps[::-1])[0] == best
