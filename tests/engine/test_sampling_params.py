"""SamplingParams: defaults, normalisation, and validation messages that name the field and its range."""

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from detinfer.engine.sampling_params import SamplingParams


def test_defaults():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p) == (1, 16, 1.0, 0, 1.0, 0.0)
    assert p.stop == () and p.stop_token_ids == () and p.seed is None
    assert not p.is_greedy and not p.top_k_enabled and not p.has_penalties


def test_frozen_and_hashable():
    p = SamplingParams(stop=["a", "b"], stop_token_ids=[3, 4])
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5
    assert hash(p) == hash(SamplingParams(stop=("a", "b"), stop_token_ids=(3, 4)))


def test_stop_normalisation():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["x", "yz"]).stop == ("x", "yz")
    assert SamplingParams(stop_token_ids=[7, 9]).stop_token_ids == (7, 9)


def test_properties():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(top_k=5).top_k_enabled
    assert not SamplingParams(top_k=-1).top_k_enabled
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=-0.5).has_penalties
    assert SamplingParams(frequency_penalty=0.2).has_penalties


@pytest.mark.parametrize("kwargs, match", [
    ({"n": 0}, r"n must be >= 1, got 0"),
    ({"max_tokens": 0}, r"max_tokens must be >= 1, got 0"),
    ({"temperature": -0.1}, r"temperature must be >= 0, got -0.1"),
    ({"temperature": float("inf")}, r"temperature must be finite"),
    ({"top_k": -2}, r"top_k must be >= -1, got -2"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
    ({"top_p": 1.01}, r"top_p must be in \(0, 1\], got 1.01"),
    ({"min_p": -0.5}, r"min_p must be in \[0, 1\]"),
    ({"min_p": 2}, r"min_p must be in \[0, 1\], got 2"),
    ({"repetition_penalty": 0.0}, r"repetition_penalty must be > 0 \(at least the smallest normal float32"),
    ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\], got 2.5"),
    ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\], got -3"),
    ({"seed": -1}, r"seed must be >= 0, got -1"),
    ({"seed": 1 << 63}, r"seed must be <= 9223372036854775807 \(2\*\*63 - 1, the int64 limit\), got"),
    ({"stop": ["ok", ""]}, r"stop must contain non-empty strings only, got ''"),
    ({"stop_token_ids": [1, -4]}, r"stop_token_ids\[1\] must be >= 0, got -4"),
    ({"logprobs": -1}, r"logprobs must be >= 0"),
    ({"prompt_logprobs": -2}, r"prompt_logprobs must be >= 0"),
])
def test_out_of_range_values_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"n": 2.0}, r"n must be an int, got 2.0 \(float\)"),
    ({"max_tokens": True}, r"max_tokens must be an int or None"),
    ({"temperature": "0.7"}, r"temperature must be a number"),
    ({"seed": 1.5}, r"seed must be an int or None"),
    ({"stop": 5}, r"stop must be a string or a sequence of strings"),
    ({"stop": [b"x"]}, r"stop must contain non-empty strings only, got b'x'"),
    ({"stop_token_ids": 5}, r"stop_token_ids must be a sequence of ints"),
    ({"stop_token_ids": ["1"]}, r"stop_token_ids\[0\] must be an int"),
    ({"ignore_eos": "yes"}, r"ignore_eos must be a bool"),
    ({"logprobs": 2.0}, r"logprobs must be an int or None"),
])
def test_wrong_types_are_rejected(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        SamplingParams(**kwargs)


@given(temperature=st.floats(0, 5), top_p=st.floats(1e-6, 1.0), min_p=st.floats(0, 1),
       top_k=st.integers(-1, 1000), rep=st.floats(0.01, 3), pres=st.floats(-2, 2), freq=st.floats(-2, 2),
       seed=st.none() | st.integers(0, (1 << 63) - 1))
def test_every_value_in_range_is_accepted(temperature, top_p, min_p, top_k, rep, pres, freq, seed):
    p = SamplingParams(temperature=temperature, top_p=top_p, min_p=min_p, top_k=top_k,
                       repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq, seed=seed)
    assert p.temperature == temperature and p.seed == seed
