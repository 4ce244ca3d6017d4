"""Structured output: `StructuredOutputs` validation, grammar compilation errors naming the field, the bitmask
unpacking, random walks through grammars ending in valid JSON, and the engine on the real stories260k model
(grammar completion, logprobs of the masked distribution, n > 1, a missing llguidance, errors).
Batch invariance is in test_structured_invariance.py."""

import json
import pickle
import random
import re
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer import LLMEngine, SamplingParams, StructuredOutputs
from detinfer.engine import EngineConfig
from detinfer.engine.grammar import GrammarMasks, unpack_bitmask
from detinfer.engine.structured import (
    INSTALL_HINT,
    StructuredOutputError,
    check_structured_outputs,
    compile_grammar,
)
from detinfer.engine.testing import drive
from detinfer.models.tokenizer import Tokenizer

pytest.importorskip("llguidance")
EOS = 2
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "pet": {"enum": ["cat", "dog"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(stories_dir):
    return LLMEngine(stories_dir, EngineConfig(max_num_seqs=8, num_kv_blocks=96, block_size=16), device="cpu")


def run(engine, requests):
    return {rid: sig.completions for rid, sig in drive(engine, requests, max_steps=2000).items()}


# -- StructuredOutputs ---------------------------------------------------------------------------------

def test_structured_outputs_takes_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one .* got none"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="got json, regex"):
        StructuredOutputs(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="choice must hold at least one"):
        StructuredOutputs(choice=[])
    with pytest.raises(ValueError, match=r"choice\[1\] must be a non-empty string"):
        StructuredOutputs(choice=["a", 3])
    with pytest.raises(TypeError, match="choice must be a list of strings"):
        StructuredOutputs(choice="ab")
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputs(json="{bad")
    with pytest.raises(ValueError, match="a JSON object"):
        StructuredOutputs(json="[1]")
    with pytest.raises(ValueError, match="regex must be a non-empty string"):
        StructuredOutputs(regex="")
    with pytest.raises(TypeError, match="structured_outputs must be a StructuredOutputs"):
        SamplingParams(structured_outputs={"json": {}})


def test_structured_outputs_text_keeps_key_order_and_crosses_processes():
    so = StructuredOutputs(json={"properties": {"b": {}, "a": {}}, "type": "object"})
    assert so.kind == "json" and so.text == '{"properties": {"b": {}, "a": {}}, "type": "object"}'
    assert StructuredOutputs(choice=["x", "y"]).text == '["x", "y"]'
    assert StructuredOutputs(json_object=True).kind == "json_object"
    params = SamplingParams(structured_outputs=so)
    assert pickle.loads(pickle.dumps(params)) == params and hash(params) == hash(pickle.loads(pickle.dumps(params)))


@pytest.mark.parametrize("so,field,what", [
    (StructuredOutputs(regex="(abc"), "regex", "unclosed group"),
    (StructuredOutputs(json={"type": "foo"}), "json", "foo"),
    (StructuredOutputs(grammar='start: "a" | undefined_rule'), "grammar", "undefined_rule"),
    (StructuredOutputs(grammar="root ::= (("), "grammar", "GBNF"),
])
def test_invalid_constraints_name_their_field(so, field, what):
    with pytest.raises(StructuredOutputError, match=re.escape(what)) as e:
        check_structured_outputs(so)
    assert e.value.field == field and str(e.value).startswith(f"{field}: ")


def test_gbnf_and_lark_grammars_compile():
    check_structured_outputs(StructuredOutputs(grammar='root ::= "yes" | "no"'))
    check_structured_outputs(StructuredOutputs(grammar='start: "yes" | "no"'))


def test_missing_llguidance_is_a_clear_error(stories_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance now raises ImportError
    with pytest.raises(ValueError, match=re.escape(INSTALL_HINT)):
        compile_grammar("regex", "never-compiled-before-[0-9]")
    fresh = LLMEngine(stories_dir, EngineConfig(max_num_seqs=2, num_kv_blocks=16, block_size=16), device="cpu")
    with pytest.raises(ValueError, match=re.escape("pip install 'detinfer[structured]'")):
        fresh.add_request("r", "Once", SamplingParams(structured_outputs=StructuredOutputs(regex="a")))
    fresh.add_request("free", "Once", SamplingParams(temperature=0, max_tokens=3))  # others are unaffected
    assert len(run(fresh, [])["free"][0].token_ids) == 3


# -- masks -----------------------------------------------------------------------------------------

@settings(max_examples=30)
@given(st.lists(st.lists(st.integers(-(1 << 31), (1 << 31) - 1), min_size=3, max_size=3), min_size=1, max_size=4),
       st.integers(65, 96))
def test_unpack_bitmask_reads_bit_j_of_word_w_as_token_32w_plus_j(words, vocab):
    want = [[bool((row[t // 32] >> (t % 32)) & 1) for t in range(vocab)] for row in words]
    assert unpack_bitmask(torch.tensor(words, dtype=torch.int32), vocab).tolist() == want
    if torch.cuda.is_available():  # the device path (elementwise shifts)
        assert unpack_bitmask(torch.tensor(words, dtype=torch.int32, device="cuda"), vocab).tolist() == want


class _Seq:
    """The parts of an engine Sequence that GrammarMasks reads."""

    def __init__(self, seq_id):
        self.seq_id, self.num_pending_tokens, self.output_token_ids = seq_id, 0, []


def _walk(masks, tok, so, seed, max_steps=600):
    """A random walk through the grammar (punctuation-heavy, so JSON closes): the tokens, and whether the
    grammar completed."""
    masks.add([seed], so)
    seq, rng = _Seq(seed), random.Random(seed)
    try:
        for step in range(max_steps):
            allowed = unpack_bitmask(masks.allowed([seq]), 512)[0].nonzero().flatten().tolist()
            assert allowed, "a grammar that is not complete allows some token"
            punct = [t for t in allowed if any(c in tok.decode([t]) for c in '"{}[],:0123456789')]
            t = rng.choice(punct if punct and rng.random() < 0.7 else allowed)
            seq.output_token_ids.append(t)
            if masks.consume(seed, step, t):
                return seq.output_token_ids, True
        return seq.output_token_ids, False
    finally:
        masks.release(seed)


@pytest.fixture(scope="module")
def masks_tokenizer(stories_dir):
    return Tokenizer.from_dir(stories_dir)


@settings(max_examples=20)
@given(st.integers(0, 10_000))
def test_random_walks_through_json_grammars_end_in_valid_json(masks_tokenizer, seed):
    masks = GrammarMasks(masks_tokenizer, 512, [EOS])
    ids, done = _walk(masks, masks_tokenizer, StructuredOutputs(json_object=True), seed)
    assert done and EOS not in ids
    assert isinstance(json.loads(masks_tokenizer.decode(ids)), dict)
    ids, done = _walk(masks, masks_tokenizer, StructuredOutputs(json=PERSON), seed)
    person = json.loads(masks_tokenizer.decode(ids))
    assert done and set(person) == {"name", "age", "pet"} and person["pet"] in ("cat", "dog")
    assert 0 <= person["age"] <= 99 and len(person["name"]) <= 6


def test_masks_leave_other_rows_and_the_input_alone(masks_tokenizer):
    masks = GrammarMasks(masks_tokenizer, 512, [EOS])
    masks.add([7], StructuredOutputs(choice=["happy", "sad"]))
    logits = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    out = masks.mask_logits(logits, [2, 0], [_Seq(7), _Seq(8)])  # seq 8 has no grammar
    assert torch.equal(logits, before)
    assert torch.equal(out[0], before[0]) and torch.equal(out[1], before[1])
    allowed = torch.isfinite(out[2]).nonzero().flatten().tolist()
    assert allowed and all("happy".startswith(masks_tokenizer.decode([t]).strip() or "\0")
                           or "sad".startswith(masks_tokenizer.decode([t]).strip() or "\0") for t in allowed)
    assert torch.equal(out[2][allowed], before[2][allowed])


# -- the engine ------------------------------------------------------------------------------------

def test_grammar_completion_stops_without_eos(engine):
    regex = StructuredOutputs(regex=r"(yes|no), [a-z]{2,5}")
    res = run(engine, [
        (0, "choice", "Lily", SamplingParams(temperature=0, max_tokens=30,
                                             structured_outputs=StructuredOutputs(choice=["happy", "sad"]))),
        (0, "regex", "Lily", SamplingParams(temperature=1.0, seed=4, max_tokens=30, structured_outputs=regex)),
        (0, "ignore_eos", "Lily", SamplingParams(temperature=1.0, seed=4, max_tokens=30, ignore_eos=True,
                                                 structured_outputs=regex)),
        (0, "person", "Once upon a time", SamplingParams(temperature=0.9, seed=1, max_tokens=80,
                                                         structured_outputs=StructuredOutputs(json=PERSON))),
    ])
    assert res["choice"][0].text in ("happy", "sad")
    assert re.fullmatch(r"(yes|no), [a-z]{2,5}", res["regex"][0].text)
    assert res["ignore_eos"][0] == res["regex"][0]
    person = json.loads(res["person"][0].text)
    assert set(person) == {"name", "age", "pet"}
    for (c,) in res.values():
        assert c.finish_reason == "stop" and c.stop_reason is None and EOS not in c.token_ids


def test_logprobs_are_those_of_the_masked_distribution(engine):
    so = StructuredOutputs(choice=["happy", "sad"])
    (c,) = run(engine, [(0, "r", "Lily", SamplingParams(temperature=0, max_tokens=10, logprobs=20,
                                                         structured_outputs=so))])["r"]
    (free,) = run(engine, [(0, "f", "Lily", SamplingParams(temperature=0, max_tokens=1, logprobs=20))])["f"]
    first = c.logprobs[0]
    finite = {t: float.fromhex(v) for t, v in first[3] if float.fromhex(v) != float("-inf")}
    assert first[0] in finite and 1 <= len(finite) < 20  # only tokens the grammar allows keep probability
    assert abs(sum(torch.tensor(list(finite.values()), dtype=torch.float64).exp().tolist()) - 1) < 1e-5
    assert len({t for t, v in free.logprobs[0][3] if float.fromhex(v) != float("-inf")}) == 20


def test_each_sample_has_its_own_grammar_state(engine):
    so = StructuredOutputs(regex=r"[a-z]{1,4}( [a-z]{1,4}){2}")
    (out,) = run(engine, [(0, "n", "Once", SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=40,
                                                           structured_outputs=so))]).values()
    assert len({c.text for c in out}) > 1
    for c in out:
        assert re.fullmatch(r"[a-z]{1,4}( [a-z]{1,4}){2}", c.text) and c.finish_reason == "stop"


def test_bad_constraints_and_a_missing_tokenizer_are_refused(engine, stories_dir):
    with pytest.raises(ValueError, match="(?s)regex: .*unclosed group"):
        engine.add_request("bad", "Once", SamplingParams(structured_outputs=StructuredOutputs(regex="(abc")))
    assert engine.get_num_unfinished_requests() == 0
    from detinfer.models.loader import load_model

    model, cfg = load_model(stories_dir, torch.float32, torch.device("cpu"), "deterministic")
    bare = LLMEngine.from_model(model, cfg, EngineConfig(max_num_seqs=2, num_kv_blocks=16, block_size=16))
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        bare.add_request("r", [1, 2, 3], SamplingParams(structured_outputs=StructuredOutputs(regex="a")))


def test_ids_past_the_tokenizer_are_never_allowed(masks_tokenizer):
    """A model vocab padded past the tokenizer's (600 > 512): the padding ids are never allowed."""
    masks = GrammarMasks(masks_tokenizer, 600, [EOS])
    masks.add([1], StructuredOutputs(json_object=True))
    seq = _Seq(1)
    for _ in range(4):
        allowed = unpack_bitmask(masks.allowed([seq]), 600)[0]
        assert allowed[:512].any() and not allowed[512:].any()
        seq.output_token_ids.append(int(allowed.nonzero()[-1]))


def test_offline_llm_generate_with_structured_outputs(stories_dir):
    from detinfer import LLM

    llm = LLM(stories_dir, max_num_seqs=4, num_kv_blocks=32, block_size=16, device="cpu")
    choice = SamplingParams(temperature=0, max_tokens=10, structured_outputs=StructuredOutputs(choice=["x", "yz"]))
    free = SamplingParams(temperature=0, max_tokens=5)
    a, b = llm.generate(["Lily", "Lily"], [choice, free], use_tqdm=False)
    assert a.outputs[0].text in ("x", "yz") and a.outputs[0].finish_reason == "stop"
    assert len(b.outputs[0].token_ids) == 5


def test_a_grammar_failure_ends_that_request_alone(stories_dir):
    """A matcher in error (at mask time) and a refused token (when read back) each abort their own request
    with the error; the free request next to them gets exactly what it gets alone."""
    free = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    so = StructuredOutputs(regex="x+")
    config = EngineConfig(max_num_seqs=4, num_kv_blocks=32, block_size=16)
    alone = drive(LLMEngine(stories_dir, config, device="cpu"), [(0, "free", "Once", free)])["free"]
    engine = LLMEngine(stories_dir, config, device="cpu")
    engine.add_request("broken", "Lily", SamplingParams(temperature=0, max_tokens=8, structured_outputs=so))
    engine.add_request("refused", "Lily", SamplingParams(temperature=0, max_tokens=8, structured_outputs=so))
    engine.add_request("free", "Once", free)
    broken_seq, refused_seq = (r.seqs[0].seq_id for r in (engine._requests["broken"], engine._requests["refused"]))
    engine._grammars._matchers[broken_seq].consume_token(EOS)  # "x+" refuses EOS first: the matcher errs
    inner = engine._grammars.mask_logits

    def skip_refused(logits, rows, seqs):  # "refused" gets no mask: its greedy token leaves the grammar
        kept = [(r, s) for r, s in zip(rows, seqs) if s.seq_id != refused_seq]
        return inner(logits, *zip(*kept)) if kept else logits

    engine._grammars.mask_logits = skip_refused
    got = drive(engine, [])
    assert got["free"] == alone
    for rid, what in (("broken", "grammar failed"), ("refused", "refused token")):
        assert got[rid].completions[0].finish_reason == "abort" and what in got[rid].error, got[rid]


def test_an_llguidance_older_than_1_7_is_refused_with_the_fix(monkeypatch):
    """llguidance 1.6 takes one EOS id where the grammar masks pass all of the model's: named, not a confusing
    tokenizer error at the first request."""
    import importlib.metadata

    from detinfer.engine import structured

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.6.1")
    with pytest.raises(ValueError, match=r"needs llguidance >= 1\.7, found 1\.6\.1"):
        structured.llguidance()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.7.0")
    assert structured.llguidance() is not None
