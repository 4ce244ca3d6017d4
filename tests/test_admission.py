"""The one admission check (detinfer/admission.py): server, engine and trainer accept and refuse the same
prompts (token ids, length) with the same text, and each of them calls the one function."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer import admission
from detinfer.engine.config import EngineConfig
from detinfer.engine.logits_processors import prepare_processors
from detinfer.engine.sampling_params import SamplingParams
from detinfer.engine.scheduler import Scheduler
from detinfer.models.loader import load_model
from detinfer.server import protocol as P
from detinfer.server.prompts import PromptChecker
from detinfer.server.protocol import APIError
from detinfer.server.sampling import RequestLimits, sampling_params
from detinfer.train import TrainableModel

VOCAB = 512  # stories260k's


@pytest.fixture(scope="module")
def trainer(stories_dir):
    model, _ = load_model(stories_dir, torch.float32, "cpu", "deterministic")
    return TrainableModel(model)


def _shared(message: str) -> str:
    """A refusal's text without the site's own prefix (the request, the field's name)."""
    return re.sub(r"^(request '\w+': )?((prompt_token_ids|prompt|token_ids): )?", "", message)


def _engine(ids, max_model_len):
    cfg = EngineConfig(max_num_batched_tokens=64, max_num_seqs=4, block_size=4, num_kv_blocks=64,
                       max_model_len=max_model_len)
    try:
        Scheduler(cfg, vocab_size=VOCAB).add_request("r", ids)
    except ValueError as e:
        return _shared(str(e))
    return None


def _server(ids, max_model_len, max_tokens=None):
    checker = PromptChecker(None, VOCAB, max_model_len, longest_token_bytes=8, executor=None)
    try:
        assert checker.check_prompt(list(ids), max_tokens, "prompt") == list(ids)
    except APIError as e:
        assert e.status == 400 and e.param in ("prompt", "max_tokens"), (e.status, e.param)
        return _shared(e.message)
    return None


def _trainer(trainer, ids):
    try:
        trainer.score(torch.tensor(ids, dtype=torch.int64))
    except ValueError as e:
        return _shared(str(e))
    return None


token = st.one_of(st.integers(0, VOCAB - 1), st.integers(-3, VOCAB + 3))


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(token, max_size=12), max_model_len=st.integers(1, 14))
def test_server_engine_and_trainer_admit_the_same_prompts(trainer, ids, max_model_len):
    engine = _engine(ids, max_model_len)
    assert _server(ids, max_model_len) == engine  # same verdict, same text
    if ids and (engine is None or "token id" in engine):  # the trainer has no context length: ids only
        assert _trainer(trainer, ids) == engine
    expected_bad = next(((i, t) for i, t in enumerate(ids) if not 0 <= t < VOCAB), None)
    if expected_bad is not None:
        assert engine == f"token id {expected_bad[1]} at position {expected_bad[0]} is outside the vocabulary [0, 512)"
    elif not ids:
        assert engine == "the prompt is empty; at least one token is needed"
    elif len(ids) > max_model_len - 1:  # room for one output token
        assert engine.startswith(f"the prompt has {len(ids)} tokens; max_model_len={max_model_len}")
    else:
        assert engine is None


def test_server_also_refuses_a_max_tokens_that_cannot_fit():
    assert _server([1, 2, 3], 8, max_tokens=5) is None
    assert _server([1, 2, 3], 8, max_tokens=6) == ("the prompt has 3 tokens and max_tokens is 6, more than "
                                                   "max_model_len=8 together")
    checker = PromptChecker(None, VOCAB, 8, longest_token_bytes=8, executor=None)
    with pytest.raises(APIError) as info:
        checker.check_prompt([1, 2, 3], 6, "messages")
    assert info.value.param == "max_tokens" and info.value.code == "context_length_exceeded"
    with pytest.raises(APIError) as info:
        checker.check_prompt([], 6, "messages")
    assert info.value.param == "messages" and "the prompt is empty" in info.value.message


def test_token_id_check_names_the_field_and_the_first_bad_position():
    assert admission.check_token_ids("f", (3, 4), 5) == [3, 4]
    assert admission.check_token_ids("f", [], 5) == []
    with pytest.raises(ValueError, match=r"^f: token id 7 at position 1 is outside the vocabulary \[0, 5\)$"):
        admission.check_token_ids("f", [4, 7, -1], 5)
    with pytest.raises(TypeError, match=r"^f: the token id at position 1 must be an int, got True$"):
        admission.check_token_ids("f", [1, True], 5)
    with pytest.raises(TypeError, match="position 0 must be an int, got 1.0"):
        admission.check_token_ids("f", [1.0], None)
    assert admission.check_token_ids("f", [(1 << 63) - 1], None) == [(1 << 63) - 1]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        admission.check_token_ids("f", [1 << 63], None)  # an id must fit int64 even with no vocabulary


@pytest.fixture
def spy(monkeypatch):
    """Records the field names the one id check and the calls the one length rule see."""
    seen = []
    real_ids, real_length = admission.check_token_ids, admission.check_prompt_length

    def check_token_ids(field, ids, vocab_size=None):
        seen.append(field)
        return real_ids(field, ids, vocab_size)

    def check_prompt_length(*args):
        seen.append("length")
        return real_length(*args)

    monkeypatch.setattr(admission, "check_token_ids", check_token_ids)
    monkeypatch.setattr(admission, "check_prompt_length", check_prompt_length)
    return seen


def test_every_site_calls_the_one_check(spy, trainer):
    Scheduler(EngineConfig(max_model_len=16), num_kv_blocks=8, vocab_size=VOCAB).add_request("r", [1, 2])
    assert spy == ["prompt_token_ids", "length"]
    spy.clear()
    PromptChecker(None, VOCAB, 16, longest_token_bytes=8, executor=None).check_prompt([1, 2], 4, "messages")
    assert spy == ["messages", "length"]
    spy.clear()
    req = P.CompletionRequest(model="m", prompt="x", logit_bias={"5": 1}, allowed_token_ids=[4])
    sampling_params(req, RequestLimits(), max_tokens=2, logprobs=None, vocab_size=VOCAB)
    assert spy == ["logit_bias", "allowed_token_ids"]
    spy.clear()
    prepare_processors(SamplingParams(logit_bias={5: 1}), None, VOCAB)
    assert spy == ["logit_bias", "allowed_token_ids", "bad_words_token_ids"]
    spy.clear()
    trainer.score(torch.tensor([1, 2, 3]), targets=torch.tensor([2, 3, 4]))
    assert spy == ["token_ids", "targets"]
