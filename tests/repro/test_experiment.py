"""The load plan, the config, and `detinfer repro` end to end on the offline engine (tiny model, small N)."""

import json

import pytest
import torch

from detinfer.repro.experiment import ReproConfig, make_plan

PROMPT = "Tell me about Richard Feynman"


def test_plan_is_a_pure_function_of_the_config():
    cfg = ReproConfig(n=50, load_seed=7, max_background=5, run_gap=3, arrival_window=4)
    plan = make_plan(cfg)
    assert plan == make_plan(cfg)
    assert plan != make_plan(ReproConfig(n=50, load_seed=8, max_background=5, run_gap=3, arrival_window=4))
    runs = [e for e in plan if e.run is not None]
    assert [e.run for e in runs] == list(range(50))  # every run once, in order
    assert [e.step for e in plan] == sorted(e.step for e in plan)
    assert all(0 <= b.step - a.step <= 3 for a, b in zip(runs, runs[1:]))
    background = [e for e in plan if e.run is None]
    assert len(background) == sum(e.load for e in runs)
    assert all(0 <= e.load <= 5 for e in runs)
    assert all(1 <= e.max_tokens <= cfg.background_max_tokens and e.prompt for e in background)
    assert all(1 <= len(e.prompt.split()) <= cfg.background_prompt_words for e in background)
    assert {e.temperature for e in background} == {0.0, 0.8}
    # every background request arrives within the window of some run
    assert all(any(abs(e.step - r.step) <= 4 or e.step == 0 for r in runs) for e in background)
    assert all(e.run is not None for e in make_plan(ReproConfig(n=5, max_background=0)))


@pytest.mark.parametrize("kwargs, err", [
    ({"n": 0}, ValueError), ({"temperature": -1.0}, ValueError), ({"logprobs": 21}, ValueError),
    ({"chat": "yes"}, TypeError), ({"step_seconds": float("nan")}, ValueError), ({"n": 2.5}, TypeError),
])
def test_config_validation(kwargs, err):
    with pytest.raises(err):
        ReproConfig(**kwargs)


def _run_cli(args):
    from detinfer.repro.cli import main

    return main(args)


def _alone(model_dir, mode, prompt_ids, max_tokens):
    """The prompt's completion with nothing else in the engine."""
    from detinfer.engine.config import EngineConfig
    from detinfer.engine.llm_engine import LLMEngine
    from detinfer.engine.sampling_params import SamplingParams

    engine = LLMEngine(model_dir, EngineConfig(mode=mode, max_num_seqs=16, max_num_batched_tokens=256,
                                               num_kv_blocks=128, max_model_len=256), "cpu")
    engine.add_request("alone", list(prompt_ids), SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                 logprobs=2))
    final = None
    while engine.has_unfinished_requests():
        final = [o for o in engine.step() if o.finished] or final
    return final[0].outputs[0]


def test_repro_cli_both_modes(tiny_chat_model, repro_flags, tmp_path, capsys):
    out = tmp_path / "report"
    n, max_tokens = 6, 8
    rc = _run_cli(["--model", str(tiny_chat_model), "--prompt", PROMPT, "--chat", "--mode", "both", "--n", str(n),
                   "--max-tokens", str(max_tokens), "--out", str(out), "--no-progress", "--check", "--device",
                   "cpu", *repro_flags])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "check passed: deterministic" in printed
    for name in ("report.html", "report.json", "summary.png", "fast_histogram.png", "deterministic_divergence.png"):
        assert (out / name).is_file(), name
    data = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert data["experiment"]["n"] == n and data["experiment"]["prompt"] == PROMPT
    fast, det = data["sections"]
    assert (fast["label"], det["label"]) == ("fast", "deterministic")
    for section in (fast, det):
        assert [c["run"] for c in section["completions"]] == list(range(n))
        assert all(len(c["tokens"]) == len(c["logprobs"]) == len(c["top_logprobs"]) for c in section["completions"])
        assert section["extra"]["background requests"] > 0  # the runs really had company
    assert det["summary"]["num_unique"] == 1
    assert det["summary"]["num_unique_with_logprobs"] == 1
    assert det["summary"]["agreed_prefix"] is None and det["summary"]["pairs"] == []
    # ... and the one completion is bit for bit what the prompt gives with nothing else running.
    from detinfer.models.tokenizer import Tokenizer
    from detinfer.repro.api import prompt_ids_for

    ids = prompt_ids_for(Tokenizer.from_dir(tiny_chat_model), PROMPT, chat=True)
    alone = _alone(tiny_chat_model, "deterministic", ids, max_tokens)
    for c in det["completions"]:
        assert c["tokens"] == list(alone.token_ids)
        assert c["logprobs"] == [e.logprob for e in alone.logprobs]
        assert c["text"] == alone.text
    assert det["prompt"].endswith("<|im_start|>assistant\n") and PROMPT in det["prompt"]


def test_random_model_sampled_with_fixed_seed(tmp_path):
    """temperature > 0 with one seed for every run: deterministic mode still gives one completion. The
    tokenizer-less random model shows outputs as token ids."""
    from detinfer.engine.config import EngineConfig
    from detinfer.repro.api import repro_offline

    cfg = ReproConfig(n=5, max_tokens=6, temperature=0.9, sampling_seed=11, max_background=3,
                      background_max_tokens=6, background_prompt_words=8, run_gap=1)
    ec = EngineConfig(max_num_seqs=16, max_num_batched_tokens=256, num_kv_blocks=64, max_model_len=256)
    (section,) = repro_offline(None, PROMPT, cfg, modes=("deterministic",), engine_config=ec, device="cpu",
                               random_model="tiny", progress=False)
    s = section.summary
    assert s.n == 5 and s.num_unique == 1 and s.num_unique_logprobs == 1
    c = section.completions[0]
    assert len(c.tokens) == 6 and c.text == "".join(f"⟨{t}⟩" for t in c.tokens)
    assert section.prompt == "".join(f"⟨{b}⟩" for b in PROMPT.encode())


def test_random_model_weights_are_seeded():
    from detinfer.repro.random_model import build_random_model

    a, _ = build_random_model("tiny", mode="fast", seed=1)
    b, _ = build_random_model("tiny", mode="deterministic", seed=1)
    c, _ = build_random_model("tiny", seed=2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(sa[k].dtype == sb[k].dtype == torch.bfloat16 for k in sa)
    assert all(sa[k].view(torch.int16).equal(sb[k].view(torch.int16)) for k in sa)  # same bits
    assert not sa["embed_tokens"].equal(sc["embed_tokens"])
    with pytest.raises(ValueError, match="unknown random model"):
        build_random_model("gpt-5")


def test_check_fails_when_deterministic_mode_is_not_reproducible(monkeypatch, tmp_path, capsys):
    """--check exits 1 when a deterministic run set has two completions (a synthetic regression)."""
    from detinfer.repro import api
    from detinfer.repro.analysis import Completion, summarize
    from detinfer.repro.report import Section

    def fake(model_dir, prompt, cfg, *, modes, **kwargs):
        comps = (Completion(0, "a", tokens=(1,)), Completion(1, "b", tokens=(2,)))
        return [Section(m, "fake", prompt, summarize(comps), comps, 0.0) for m in modes]

    monkeypatch.setattr(api, "repro_offline", fake)
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    args = ["--model", str(model_dir), "--prompt", "x", "--out", str(tmp_path / "o"), "--no-progress", "--check"]
    assert _run_cli(args + ["--mode", "fast"]) == 0  # fast mode is allowed to vary
    assert _run_cli(args + ["--mode", "both"]) == 1
    assert "not reproducible: deterministic" in capsys.readouterr().err


def test_cli_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        _run_cli(["--prompt", "x"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        _run_cli(["--url", "http://127.0.0.1:9", "--mode", "both", "--prompt", "x"])
    assert "a server runs in its own mode" in capsys.readouterr().err
    assert _run_cli(["--model", str(tmp_path / "missing"), "--prompt", "x", "--out", str(tmp_path)]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert _run_cli(["--model", str(tmp_path), "--prompt-file", str(tmp_path / "nope.txt")]) == 2
    assert "prompt file" in capsys.readouterr().err
    assert _run_cli(["--model", str(tmp_path), "--prompt", "x", "--prompt-file", "y"]) == 2
    assert _run_cli(["--model", str(tmp_path), "--prompt", "x", "--n", "0"]) == 2
    err = capsys.readouterr().err
    assert "n must be >= 1, got 0" in err
    assert "--n 0" not in err  # the user's own value is never called a default
