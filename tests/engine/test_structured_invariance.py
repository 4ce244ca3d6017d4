"""Structured output keeps batch invariance, asserted bitwise on the real stories260k model (CPU).

A structured request (JSON schema, JSON object, regex, choice or grammar; greedy or sampled; with logprobs)
gets the same tokens, text, logprobs (float.hex) and finish alone on a fresh engine as inside a batch of
other structured and free requests arriving at random steps, whatever the token budget (chunked prefill) and
with overlapped scheduling on or off. Its grammar mask is a function of its own output only.
"""

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer import LLMEngine, SamplingParams, StructuredOutputs
from detinfer.engine import EngineConfig
from detinfer.engine.testing import drive

pytest.importorskip("llguidance")
PROMPTS = ["Once upon a time", "Lily", "The dog said", "One day, Tom went to the park and saw a big"]
CONSTRAINTS = [
    StructuredOutputs(json_object=True),
    StructuredOutputs(json={"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                                             "ok": {"type": "boolean"}},
                            "required": ["name", "ok"], "additionalProperties": False}),
    StructuredOutputs(regex=r"[A-Z][a-z]{1,6}( [a-z]{1,5}){1,3}\."),
    StructuredOutputs(choice=["happy", "sad", "very happy"]),
    StructuredOutputs(grammar='root ::= "The " ("cat" | "dog") " is " [a-z]+ "."'),
]
ALONE = dict(max_num_batched_tokens=512, max_num_seqs=8, block_size=16, num_kv_blocks=96)


@pytest.fixture(scope="module")
def alone(stories_dir):
    cache = {}

    def get(prompt, params):
        if (prompt, params) not in cache:
            engine = LLMEngine(stories_dir, EngineConfig(**ALONE), device="cpu")
            cache[prompt, params] = drive(engine, [(0, "alone", prompt, params)])["alone"]
        return cache[prompt, params]

    return get


def _params(constraint, temperature, seed, logprobs=3, max_tokens=20):
    so = None if constraint is None else CONSTRAINTS[constraint]
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens, logprobs=logprobs,
                          structured_outputs=so)


request = st.tuples(st.integers(0, 3), st.sampled_from(PROMPTS),
                    st.one_of(st.none(), st.integers(0, len(CONSTRAINTS) - 1)), st.sampled_from([0.0, 0.9]),
                    st.integers(0, 1000))


def _check_matches(constraint: StructuredOutputs, text: str) -> None:
    """A finished-by-grammar output satisfies its constraint."""
    if constraint.kind in ("json", "json_object"):
        assert isinstance(json.loads(text), dict)
    elif constraint.kind == "regex":
        assert re.fullmatch(constraint.regex, text)
    elif constraint.kind == "choice":
        assert text in constraint.choice
    else:
        assert re.fullmatch(r"The (cat|dog) is [a-z]+\.", text)


@settings(max_examples=8)
@given(target=request, others=st.lists(request, max_size=4), budget=st.sampled_from([16, 64, 512]),
       overlap=st.booleans())
def test_structured_request_alone_equals_in_a_batch(stories_dir, alone, target, others, budget, overlap):
    step, prompt, constraint, temperature, seed = target
    constraint = constraint if constraint is not None else 2
    params = _params(constraint, temperature, seed)
    requests = [(step, "target", prompt, params)]
    requests += [(s, f"o{i}", p, _params(c, t, sd, logprobs=None, max_tokens=12))
                 for i, (s, p, c, t, sd) in enumerate(others)]
    engine = LLMEngine(stories_dir, EngineConfig(max_num_batched_tokens=budget, max_num_seqs=8, block_size=16,
                                             num_kv_blocks=96, async_scheduling=overlap), device="cpu")
    batched = drive(engine, requests, after_step=lambda _: engine.scheduler.check_invariants())
    assert batched["target"] == alone(prompt, params)
    for rid, (_, _, _, p) in ((r[1], r) for r in requests):
        (c,) = batched[rid].completions
        if p.structured_outputs is not None and c.finish_reason == "stop":
            _check_matches(p.structured_outputs, c.text)
