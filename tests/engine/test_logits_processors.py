"""Per-row logits processors (logit_bias, allowed_token_ids, bad words, min_tokens, token_mask): what each does
to a row, that untouched rows keep every bit, and that a request gets the same bits alone or inside a batch
(sampler level on random logits, and engine level on the real stories260k model), asserted with torch.equal /
exact signatures."""


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detinfer.engine import EngineConfig, LLMEngine, SamplingParams
from detinfer.engine.logits_processors import bad_word_sequences, process_logits
from detinfer.engine.sampler import sample, sampling_scores
from detinfer.engine.testing import drive
from detinfer.models.loader import load_model, load_tokenizer

NEG_INF = float("-inf")


def rows(s, v, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(s, v, generator=g, dtype=torch.float32)


def test_untouched_rows_keep_every_bit_including_negative_zero():
    logits = rows(3, 10)
    logits[0, 4] = -0.0
    params = [SamplingParams(), SamplingParams(logit_bias={1: 2.0}), SamplingParams()]
    out = process_logits(logits, params, [0, 0, 0], None)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert str(out[0, 4].item()) == "-0.0"
    expect = logits[1].clone()
    expect[1] += 2.0
    assert torch.equal(out[1], expect)


def test_allowed_token_ids_mask_everything_else():
    out = process_logits(rows(2, 8), [SamplingParams(allowed_token_ids=[2, 5]), SamplingParams()], [0, 0], None)
    assert torch.isinf(out[0]).tolist() == [i not in (2, 5) for i in range(8)]
    assert not torch.isinf(out[1]).any()


def test_bad_words_mask_the_last_token_only_after_the_prefix():
    p = SamplingParams(bad_words_token_ids=[[3], [4, 5, 6]])
    logits = rows(1, 8)
    for history, banned in [([], {3}), ([1, 4], {3}), ([4, 5], {3, 6}), ([4, 5, 1], {3}), ([9, 4, 5], {3, 6})]:
        out = process_logits(logits, [p], [len(history)], [history])
        assert {i for i in range(8) if out[0, i] == NEG_INF} == banned, history


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    p = SamplingParams(min_tokens=2, stop_token_ids=[6])
    logits = rows(1, 8)
    for pos, banned in [(0, {1, 6}), (1, {1, 6}), (2, set())]:
        out = process_logits(logits, [p], [pos], [[0] * pos], eos_token_ids={1})
        assert {i for i in range(8) if out[0, i] == NEG_INF} == banned
    beyond = SamplingParams(min_tokens=2, stop_token_ids=[6, 1000])  # a stop id outside the vocabulary: no error
    assert torch.isinf(process_logits(logits, [beyond], [0], [[]])[0]).tolist() == [i == 6 for i in range(8)]
    ignoring = SamplingParams(min_tokens=2, ignore_eos=True)
    out = process_logits(logits, [ignoring], [0], [[]], eos_token_ids={1})
    assert not torch.isinf(out).any()


def test_token_mask_hook_gets_the_generated_ids():
    seen = []

    def even_after_two(ids):
        seen.append(ids)
        return None if len(ids) < 2 else [t for t in range(8) if t % 2 == 0]

    p = SamplingParams(token_mask=even_after_two, allowed_token_ids=[0, 1, 2, 3])
    logits = rows(1, 8)
    assert torch.isinf(process_logits(logits, [p], [1], [[7]])[0]).tolist() == [False] * 4 + [True] * 4
    out = process_logits(logits, [p], [2], [[7, 3]])
    assert torch.isinf(out[0]).tolist() == [False, True, False, True, True, True, True, True]
    assert seen == [(7,), (7, 3)]
    with pytest.raises(ValueError, match="token_mask"):
        process_logits(logits, [SamplingParams(token_mask=lambda ids: [9])], [0], [[]])


def test_greedy_draws_the_biased_token():
    logits = rows(1, 16)
    worst = int(torch.argmin(logits[0]))
    drawn = sample(logits, [SamplingParams(temperature=0, logit_bias={worst: 100})], [None], [0])
    assert int(drawn[0]) == worst


def test_sampling_params_validation():
    with pytest.raises(ValueError, match=r"logit_bias\[3\] must be in \[-100, 100\], got 101"):
        SamplingParams(logit_bias={3: 101})
    with pytest.raises(ValueError, match=r"min_tokens \(20\) must be <= max_tokens \(16\)"):
        SamplingParams(min_tokens=20)
    with pytest.raises(ValueError, match="allowed_token_ids must not be empty"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="bad_words must contain non-blank strings"):
        SamplingParams(bad_words=[" "])
    with pytest.raises(TypeError, match="token_mask must be a callable"):
        SamplingParams(token_mask=3)
    p = SamplingParams(logit_bias={7: 1, 2: -1}, allowed_token_ids=[4, 2], bad_words="x")
    assert p.logit_bias == ((2, -1.0), (7, 1.0)) and p.allowed_token_ids == (4, 2) and p.bad_words == ("x",)
    assert hash(p) == hash(SamplingParams(logit_bias={2: -1, 7: 1}, allowed_token_ids=(4, 2), bad_words=["x"]))


@st.composite
def processor_params(draw, vocab):
    ids = st.integers(0, vocab - 1)
    kw = dict(temperature=draw(st.sampled_from([0.0, 0.7, 1.3])), seed=draw(st.integers(0, 2**40)),
              max_tokens=8)
    if draw(st.booleans()):
        kw["logit_bias"] = draw(st.dictionaries(ids, st.floats(-100, 100), max_size=4))
    if draw(st.booleans()):
        kw["allowed_token_ids"] = draw(st.lists(ids, min_size=1, max_size=6))
    if draw(st.booleans()):
        kw["bad_words_token_ids"] = draw(st.lists(st.lists(ids, min_size=1, max_size=3), max_size=3))
    kw["min_tokens"] = draw(st.integers(0, 8))
    kw["stop_token_ids"] = draw(st.lists(ids, max_size=2))
    return SamplingParams(**kw)


@given(st.data())
def test_sampler_row_alone_equals_row_in_batch(data):
    """Every bit of a row's scores is the same computed alone and inside a batch of other rows."""
    vocab, size = 24, data.draw(st.integers(2, 5))
    params = [data.draw(processor_params(vocab)) for _ in range(size)]
    histories = [data.draw(st.lists(st.integers(0, vocab - 1), max_size=6)) for _ in range(size)]
    logits = rows(size, vocab, seed=data.draw(st.integers(0, 1000)))
    seeds, positions = [p.seed for p in params], [len(h) for h in histories]
    batch = sampling_scores(logits, params, seeds, positions, None, histories, histories, {2})
    for r in range(size):
        alone = sampling_scores(logits[r:r + 1].clone(), params[r:r + 1], seeds[r:r + 1], positions[r:r + 1],
                                None, histories[r:r + 1], histories[r:r + 1], {2})
        assert torch.equal(alone[0], batch[r])


# --- engine level, real stories260k weights ------------------------------------------------------------

def stories_engine(path, device="cpu", **config):
    model, model_config = load_model(path, torch.float32, device, "deterministic")
    cfg = EngineConfig(**{"max_model_len": 128, "max_num_seqs": 8, "num_kv_blocks": 64, **config})
    return LLMEngine.from_model(model, model_config, cfg, load_tokenizer(path))


@st.composite
def engine_requests(draw):
    prompts = ["Once upon a time", "The cat sat", "Lily and Ben went to the park", "One day"]
    words = ["Lily", "the", "park", " dog", "happy"]
    reqs = []
    for i in range(draw(st.integers(2, 4))):
        kw = dict(temperature=draw(st.sampled_from([0.0, 0.8])), seed=draw(st.integers(0, 2**31)),
                  max_tokens=draw(st.integers(3, 8)), logprobs=draw(st.sampled_from([None, 2])))
        kw["min_tokens"] = draw(st.integers(0, kw["max_tokens"]))
        if draw(st.booleans()):
            kw["logit_bias"] = draw(st.dictionaries(st.integers(0, 511), st.floats(-100, 100), max_size=3))
        if draw(st.booleans()):
            kw["bad_words"] = draw(st.lists(st.sampled_from(words), min_size=1, max_size=2))
        if draw(st.booleans()):
            kw["allowed_token_ids"] = draw(st.lists(st.integers(0, 511), min_size=2, max_size=40))
        kw["skip_special_tokens"] = draw(st.booleans())
        reqs.append((draw(st.integers(0, 2)), f"r{i}", draw(st.sampled_from(prompts)), SamplingParams(**kw)))
    return reqs, draw(st.sampled_from([16, 64])), draw(st.booleans())


def _alone_equals_batched(path, device, reqs, budget, overlap):
    """The batched run chunks prompts by `budget` and may overlap steps (histories resolved late)."""
    batched = drive(stories_engine(path, device, max_num_batched_tokens=budget, async_scheduling=overlap), reqs)
    for _, rid, prompt, params in reqs:
        alone = drive(stories_engine(path, device), [(0, rid, prompt, params)])
        assert alone[rid] == batched[rid], rid


@settings(max_examples=6)
@given(engine_requests())
def test_engine_request_alone_equals_inside_a_batch(stories_dir, case):
    _alone_equals_batched(stories_dir, "cpu", *case)


@pytest.mark.gpu
@settings(max_examples=10)
@given(engine_requests())
def test_engine_request_alone_equals_inside_a_batch_gpu(stories_dir, case):
    _alone_equals_batched(stories_dir, "cuda", *case)


def run_one(engine, prompt, params):
    return drive(engine, [(0, "x", prompt, params)])["x"].completions[0]


@pytest.fixture(scope="module")
def engine(stories_dir):
    return stories_engine(stories_dir)


def test_engine_bad_words_never_appear(engine):
    greedy = SamplingParams(temperature=0, max_tokens=16)
    plain = run_one(engine, "Once upon a time", greedy)
    assert "Lily" in plain.text
    banned = run_one(engine, "Once upon a time", SamplingParams(temperature=0, max_tokens=16, bad_words=["Lily"]))
    assert "Lily" not in banned.text and banned.token_ids[:5] == plain.token_ids[:5]
    for seq in bad_word_sequences(engine.tokenizer, ["Lily"]):
        ids = banned.token_ids
        assert all(tuple(ids[i:i + len(seq)]) != seq for i in range(len(ids)))


def test_engine_min_tokens_holds_back_stop_tokens_and_strings(engine):
    plain = run_one(engine, "Once upon a time", SamplingParams(temperature=0, max_tokens=20))
    first = plain.token_ids[1]
    stopped = run_one(engine, "Once upon a time", SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[first]))
    assert len(stopped.token_ids) == 2 and stopped.finish_reason == "stop"
    held = run_one(engine, "Once upon a time",
                   SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[first], min_tokens=5))
    assert first not in held.token_ids[:5] and len(held.token_ids) >= 5
    word = plain.text.split()[1]
    by_string = run_one(engine, "Once upon a time", SamplingParams(temperature=0, max_tokens=20, stop=[word]))
    late = run_one(engine, "Once upon a time", SamplingParams(temperature=0, max_tokens=20, stop=[word], min_tokens=8))
    assert len(late.token_ids) > len(by_string.token_ids) >= 1


def test_engine_include_stop_str_and_skip_special_tokens(engine):
    plain = run_one(engine, "Once upon a time", SamplingParams(temperature=0, max_tokens=20))
    cut = run_one(engine, "Once upon a time", SamplingParams(temperature=0, max_tokens=20, stop=["Lily"]))
    kept = run_one(engine, "Once upon a time", SamplingParams(temperature=0, max_tokens=20, stop=["Lily"],
                                                              include_stop_str_in_output=True))
    assert kept.text == cut.text + "Lily" and plain.text.startswith(kept.text)
    bos = engine.tokenizer.bos_token_id
    forced = dict(temperature=0, max_tokens=3, logit_bias={bos: 100}, ignore_eos=True)
    shown = run_one(engine, "Once upon a time", SamplingParams(**forced, skip_special_tokens=False))
    hidden = run_one(engine, "Once upon a time", SamplingParams(**forced))
    assert shown.token_ids == hidden.token_ids == (bos,) * 3
    assert hidden.text == "" and shown.text.count(engine.tokenizer.id_to_token(bos)) == 3


def test_engine_logprobs_are_raw(engine):
    """Logprobs report the model's raw distribution (vLLM's default), not the processed one."""
    plain = run_one(engine, "Once upon a time", SamplingParams(temperature=0, max_tokens=1, logprobs=3))
    top = plain.token_ids[0]
    biased = run_one(engine, "Once upon a time", SamplingParams(temperature=0, max_tokens=1, logprobs=3,
                                                                logit_bias={top: -100}))
    assert biased.token_ids[0] != top
    (_, _, _, plain_top), (token, _, rank, biased_top) = plain.logprobs[0], biased.logprobs[0]
    assert biased_top == plain_top and rank == 2 and token == plain_top[1][0]


def test_engine_refuses_token_ids_outside_the_vocabulary(engine):
    for params, name in [(SamplingParams(logit_bias={512: 1}), "logit_bias"),
                         (SamplingParams(allowed_token_ids=[1, 600]), "allowed_token_ids"),
                         (SamplingParams(bad_words_token_ids=[[3, 999]]), "bad_words_token_ids")]:
        bad = rf"{name}: token id \d+ at position \d is outside the vocabulary \[0, 512\)"
        with pytest.raises(ValueError, match=bad):
            engine.add_request("bad", "Hi", params)
        assert not engine.has_unfinished_requests()


def test_engine_process_gets_the_same_bits(stories_dir):
    """The processors' fields cross to the engine process (pickled SamplingParams) and give the same tokens."""
    from detinfer.engine import LLM

    params = SamplingParams(temperature=0.7, seed=5, max_tokens=8, logit_bias={432: -100}, bad_words=["Lily"],
                            min_tokens=3, allowed_token_ids=list(range(250, 512)))
    kw = dict(device="cpu", mode="deterministic", max_model_len=128, max_num_seqs=4)
    with LLM(str(stories_dir), engine_process=True, **kw) as remote:
        there = remote.generate({"prompt": "Once upon a time"}, params, use_tqdm=False)[0].outputs[0]
    here = LLM(str(stories_dir), **kw).generate("Once upon a time", params, use_tqdm=False)[0].outputs[0]
    assert there.token_ids == here.token_ids and all(t >= 250 for t in here.token_ids)
