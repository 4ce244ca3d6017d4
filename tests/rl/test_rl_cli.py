"""`detinfer rl` from the command line on a CPU (stories260k): MODEL_DIR positional, CPU-sized defaults with a
one-line notice, progress before the first step ends, and Ctrl-C (checkpoint + partial report, exit 130)."""

from __future__ import annotations

import json
import signal

import pytest

from detinfer.rl import GRPOTrainer
from detinfer.rl.cli import CPU_DEFAULTS
from detinfer.rl.cli import main as rl_main

SMALL = ["--task", "emit-token", "--device", "cpu", "--max-model-len", "64", "--no-progress"]


def test_positional_model_dir_cpu_defaults_and_early_progress(stories_dir, tmp_path, monkeypatch, capsys):
    seen_at_first_step: list[str] = []
    real_step = GRPOTrainer.step

    def step(self):
        if not seen_at_first_step:  # what the user had seen when the first step began
            captured = capsys.readouterr()
            seen_at_first_step.append(captured.out + captured.err)
            print(captured.out, end="")
        return real_step(self)

    monkeypatch.setattr(GRPOTrainer, "step", step)
    out = tmp_path / "r"
    assert rl_main([str(stories_dir), "--steps", "1", "--out", str(out), *SMALL]) == 0
    rest = capsys.readouterr()
    early = seen_at_first_step[0]
    notice = [line for line in early.splitlines() if "CPU-sized defaults" in line]
    assert len(notice) == 1, early
    # the flags not given get the CPU sizes and are named; --steps was given, so it is not
    assert "--prompts-per-step 4 --n-samples 4 --max-tokens 16" in notice[0] and "--steps" not in notice[0]
    assert "give a flag to override" in notice[0]
    assert "[deterministic] loading" in early and "[deterministic] loaded in" in early
    assert "[deterministic] step 1/1: sampling 4 x 4" in early  # printed before the step ran
    assert "[deterministic] step 1  reward" in rest.out
    doc = json.loads((out / "report.json").read_text())
    assert doc["partial"] is False
    assert {k: doc["experiment"][k] for k in CPU_DEFAULTS} == {**CPU_DEFAULTS, "steps": 1}


def test_model_given_twice_or_not_at_all_is_a_one_line_error(stories_dir, capsys):
    for argv, needle in (([], "give the model directory (MODEL_DIR or --model DIR)"),
                         ([str(stories_dir), "--model", "/elsewhere"], "the model was given twice")):
        with pytest.raises(SystemExit) as e:
            rl_main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err


def test_gpu_runs_keep_the_gpu_defaults(monkeypatch, capsys):
    import argparse

    from detinfer.rl import cli
    from detinfer.rl.config import RLConfig

    ns = argparse.Namespace(device="cuda", **{k: None for k in CPU_DEFAULTS})
    assert cli._size_defaults(ns) is None  # no notice off the CPU
    assert {k: getattr(ns, k) for k in CPU_DEFAULTS} == {k: getattr(RLConfig, k) for k in CPU_DEFAULTS}


def test_ctrl_c_saves_the_finished_steps_and_resume_continues(stories_dir, tmp_path, monkeypatch, capsys):
    """In process: Ctrl-C during step 3 (a real SIGINT, through the command's handler): steps 1-2 are
    checkpointed and reported as partial; --resume then ends where an uninterrupted run ends, bit for bit."""
    real_step = GRPOTrainer.step

    def step(self):
        if self.step_index == 2:
            # raise(3): delivered to this (the main) thread before it returns. os.kill(getpid()) may be taken by
            # any thread of the process, and the handler then runs whenever the main thread next checks.
            signal.raise_signal(signal.SIGINT)
        return real_step(self)

    monkeypatch.setattr(GRPOTrainer, "step", step)
    argv = [str(stories_dir), "--steps", "4", "--prompts-per-step", "2", "--n-samples", "2", "--max-tokens", "4",
            "--lr", "3e-3", *SMALL]
    out = tmp_path / "cut"
    assert rl_main([*argv, "--out", str(out)]) == 130
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "interrupted (Ctrl-C)" in line]
    assert len(lines) == 1 and "during step 3 of 4" in lines[0] and "checkpoint of step 2" in lines[0], err
    assert "partial report:" in lines[0] and "Traceback" not in err
    doc = json.loads((out / "report.json").read_text())
    assert doc["partial"] is True and "during step 3 of 4" in doc["experiment"]["partial"]
    assert [s["step"] for s in doc["arms"]["deterministic"]["steps"]] == [1, 2]
    state = json.loads((out / "deterministic" / "checkpoint" / "state.json").read_text())
    assert state["step"] == 2
    assert "Partial report:" in (out / "report.html").read_text()

    monkeypatch.setattr(GRPOTrainer, "step", real_step)
    assert rl_main([*argv, "--out", str(out), "--resume"]) == 0
    full = tmp_path / "full"
    assert rl_main([*argv, "--out", str(full)]) == 0
    resumed = json.loads((out / "report.json").read_text())["arms"]["deterministic"]["steps"]
    straight = json.loads((full / "report.json").read_text())["arms"]["deterministic"]["steps"]
    assert [s["weights_hash"] for s in resumed] == [s["weights_hash"] for s in straight]
    assert json.loads((out / "report.json").read_text())["partial"] is False


def test_ctrl_c_during_the_update_waits_for_the_step_to_finish():
    from detinfer.rl.grpo import ctrl_c_deferred

    done = []
    # Python's own Ctrl-C handler for the test's duration: a process started in the background by a
    # non-interactive shell (how CI may start this suite) inherits SIGINT ignored, and then the deferred
    # Ctrl-C rightly stays ignored.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with ctrl_c_deferred():
                signal.raise_signal(signal.SIGINT)  # synchronous, in this thread (see the test above)
                done.append("the rest of the block ran")
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert done == ["the rest of the block ran"]


def test_ctrl_c_deferral_keeps_an_ignored_sigint_ignored():
    from detinfer.rl.grpo import ctrl_c_deferred

    inherited = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with ctrl_c_deferred():
            signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # no KeyboardInterrupt, disposition restored
    finally:
        signal.signal(signal.SIGINT, inherited)
