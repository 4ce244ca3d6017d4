"""SamplingParams.output_kind (vLLM's RequestOutputKind): what `LLMEngine.step()` reports, never what is
generated. The three kinds run side by side in one engine (same batch, same seeds) on the real stories260k
checkpoint (a tokenizer: text, stop strings held back and released), with n = 2, sampled and greedy rows,
logprobs and prompt logprobs. Asserted exactly: "final_only" reports once, at the end, what "cumulative"
reports last; "delta"'s outputs, concatenated per sample, are that too, with the running cumulative_logprob
and the prompt logprobs in its first output only; LLM.generate returns full outputs whatever the kind."""

from __future__ import annotations

import dataclasses

import pytest

from detinfer.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from detinfer.engine.testing import signature

KINDS = ("cumulative", "delta", "final_only")


@pytest.fixture(scope="module")
def engine(stories_dir):
    return LLMEngine(stories_dir, EngineConfig(mode="fast", max_num_seqs=8, max_num_batched_tokens=64), device="cpu")


def _run_side_by_side(engine, prompt, params):
    seen = {kind: [] for kind in KINDS}
    for kind in KINDS:
        engine.add_request(kind, prompt, dataclasses.replace(params, output_kind=kind))
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
        steps += 1
        assert steps < 500
    return seen


def _joined(deltas):
    """The delta outputs of one request folded back into cumulative completions: {sample index: (token ids,
    text, logprobs, the last cumulative_logprob, finish_reason, stop_reason)}."""
    joined = {}
    for out in deltas:
        for c in out.outputs:
            ids, text, lps, _, _, _ = joined.get(c.index, ((), "", (), None, None, None))
            joined[c.index] = (ids + c.token_ids, text + c.text, lps + (c.logprobs or ()), c.cumulative_logprob,
                               c.finish_reason, c.stop_reason)
    return joined


@pytest.mark.parametrize("params", [
    SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=24, logprobs=2, prompt_logprobs=1),
    SamplingParams(temperature=0.0, max_tokens=40, stop=["Lily"], logprobs=0),
], ids=["sampled n=2", "greedy stop string"])
def test_kinds_report_the_same_generation(engine, params):
    seen = _run_side_by_side(engine, "Once upon a time", params)
    cumulative, delta, final = seen["cumulative"], seen["delta"], seen["final_only"]
    assert len(cumulative) > 2 and cumulative[-1].finished and not any(o.finished for o in cumulative[:-1])
    assert len(final) == 1 and final[0].finished
    assert signature(final[0]) == signature(cumulative[-1])
    last = cumulative[-1]
    assert len(delta) == len(cumulative) and delta[-1].finished
    joined = _joined(delta)
    for c in last.outputs:
        ids, text, lps, cum, reason, stop = joined[c.index]
        assert ids == c.token_ids and text == c.text and reason == c.finish_reason and stop == c.stop_reason
        assert [(e.token_id, e.logprob, e.rank) for e in lps] == [(e.token_id, e.logprob, e.rank) for e in c.logprobs]
        assert cum == c.cumulative_logprob
    if params.prompt_logprobs is not None:
        assert delta[0].prompt_logprobs == last.prompt_logprobs and last.prompt_logprobs is not None
        assert all(o.prompt_logprobs is None for o in delta[1:])
    if params.stop:
        assert last.outputs[0].stop_reason == "Lily" and "Lily" not in last.outputs[0].text


def test_an_aborted_final_only_request_reports_once(engine):
    engine.add_request("a", "Once upon a time", SamplingParams(temperature=0.0, max_tokens=30,
                                                               output_kind="final_only"))
    assert engine.step() == [] and engine.step() == []
    engine.abort_request("a")
    outs = engine.step()
    assert [(o.request_id, o.finished, o.outputs[0].finish_reason) for o in outs] == [("a", True, "abort")]
    assert len(outs[0].outputs[0].token_ids) >= 1


def test_an_unknown_kind_is_refused_naming_the_kinds():
    with pytest.raises(ValueError, match="output_kind must be one of 'cumulative', 'delta', 'final_only', got 'x'"):
        SamplingParams(output_kind="x")


def test_generate_returns_whole_outputs_whatever_the_kind(stories_dir):
    llm = LLM(stories_dir, mode="fast", max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=20, logprobs=1)
    outs = [llm.generate("Once upon a time", dataclasses.replace(params, output_kind=kind), use_tqdm=False)[0]
            for kind in KINDS]
    assert len({signature(o)[1:] for o in outs}) == 1 and len(outs[0].outputs[0].token_ids) == 20
