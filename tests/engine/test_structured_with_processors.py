"""Structured output together with the sampler's logits processors (logit_bias, allowed_token_ids, bad words,
min_tokens, token_mask) on the real stories260k model (CPU).

Both constraints hold at once: the grammar masks the logits in `launch_step` (so logprobs are those of the
grammar-masked distribution), the processors work on the sampler's own copy (so they leave logprobs raw).
A request whose two constraints together allow no token fails alone.
"""


import pytest

from detinfer import LLMEngine, SamplingParams, StructuredOutputs
from detinfer.engine import EngineConfig
from detinfer.engine.testing import drive

pytest.importorskip("llguidance")
EOS = 2
CHOICE = StructuredOutputs(choice=["happy", "sad"])
CONFIG = dict(max_num_seqs=4, num_kv_blocks=48, block_size=16)


def _run(stories_dir, requests, overlap=True):
    engine = LLMEngine(stories_dir, EngineConfig(**CONFIG, async_scheduling=overlap), device="cpu")
    return drive(engine, requests, max_steps=500)


@pytest.mark.parametrize("overlap", [True, False])
def test_grammar_and_bad_words_both_hold_and_logprobs_are_grammar_masked_only(stories_dir, overlap):
    plain = SamplingParams(temperature=0, max_tokens=10, logprobs=5, structured_outputs=CHOICE)
    (a,) = _run(stories_dir, [(0, "a", "Lily", plain)], overlap)["a"].completions
    first = a.token_ids[0]
    banned = SamplingParams(temperature=0, max_tokens=10, logprobs=5, structured_outputs=CHOICE,
                            bad_words_token_ids=((first,),))
    (b,) = _run(stories_dir, [(0, "b", "Lily", banned)], overlap)["b"].completions
    assert a.text in ("happy", "sad") and b.text in ("happy", "sad") and b.finish_reason == "stop"
    assert first not in b.token_ids  # the bad word is never drawn ...
    assert b.logprobs[0][3] == a.logprobs[0][3]  # ... yet its logprob is reported as before: raw for bad words
    top = {t: float.fromhex(v) for t, v in a.logprobs[0][3]}
    assert top[first] != float("-inf") and float("-inf") in top.values()  # masked by the grammar only


def test_grammar_with_logit_bias_and_min_tokens_stays_in_the_grammar(stories_dir):
    biased = SamplingParams(temperature=0.8, seed=3, max_tokens=10, structured_outputs=CHOICE, min_tokens=1,
                            logit_bias={EOS: 100.0})  # EOS is masked by the grammar and by min_tokens anyway
    (c,) = _run(stories_dir, [(0, "r", "Lily", biased)])["r"].completions
    assert c.text in ("happy", "sad") and c.finish_reason == "stop" and EOS not in c.token_ids


def test_grammar_and_allowed_token_ids_that_exclude_each_other_fail_that_request_alone(stories_dir):
    free = SamplingParams(temperature=0, max_tokens=6, logprobs=2)
    alone = _run(stories_dir, [(0, "free", "Once", free)])["free"]
    clash = SamplingParams(temperature=0, max_tokens=6, structured_outputs=CHOICE, allowed_token_ids=(EOS,))
    got = _run(stories_dir, [(0, "clash", "Lily", clash), (0, "free", "Once", free)])
    assert got["free"] == alone
    (c,) = got["clash"].completions
    assert c.finish_reason == "abort" and "refused token" in got["clash"].error, got["clash"]
