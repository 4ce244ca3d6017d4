"""Ctrl-C in `detinfer repro`, `detinfer audit` and `detinfer rl`: the finished work is kept (a report marked
partial, a checkpoint, or a summary of the finished scenarios), one line says so, the exit status is 130, a
second Ctrl-C exits at once. (More of `detinfer rl`'s, in process: tests/rl/test_rl_cli.py.)

The subprocess tests send SIGINT only after the output shows finished work, and size the run so that it
cannot end first on any machine (20000 runs, 100000 steps); the in-process tests raise KeyboardInterrupt at
a chosen point."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from detinfer.cli_util import Interrupted

REPO = Path(__file__).resolve().parents[2]
PROMPT = "Tell me about Richard Feynman"


class Watched:
    """A subprocess whose stderr is collected by a thread, so a test can wait for a line, then signal it."""

    def __init__(self, argv: list[str]):
        env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
        self.proc = subprocess.Popen([sys.executable, "-m", "detinfer", *argv], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=env, cwd=REPO)
        self.err, self.out = bytearray(), bytearray()
        self._threads = [threading.Thread(target=self._read, args=(s, buf)) for s, buf in
                         ((self.proc.stderr, self.err), (self.proc.stdout, self.out))]
        for t in self._threads:
            t.start()

    @staticmethod
    def _read(stream, buf: bytearray) -> None:
        while chunk := stream.read1(4096):
            buf.extend(chunk)

    def wait_for(self, predicate, timeout: float = 300.0) -> None:
        """Wait until predicate(stdout + stderr text) holds (the timeout only guards against a hang)."""
        deadline = time.monotonic() + timeout
        while not predicate(self.text()):
            assert self.proc.poll() is None, f"exited early ({self.proc.returncode}):\n{self.text()[-3000:]}"
            assert time.monotonic() < deadline, self.text()[-3000:]
            time.sleep(0.05)

    def text(self) -> str:
        return self.out.decode(errors="replace") + self.err.decode(errors="replace")

    def finish(self, timeout: float = 120.0) -> int:
        code = self.proc.wait(timeout)
        for t in self._threads:
            t.join()
        return code


def _runs_done(text: str) -> bool:
    import re

    return re.search(r"runs done=[1-9]", text) is not None


def _only_line(err: str, needle: str) -> str:
    lines = [line for line in err.replace("\r", "\n").splitlines() if needle in line]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def test_sigint_writes_a_partial_report_and_exits_130(tiny_chat_model, repro_flags, tmp_path):
    out = tmp_path / "report"
    run = Watched(["repro", str(tiny_chat_model), "--prompt", PROMPT, "--mode", "both", "--n", "20000",
                   "--max-tokens", "8", "--out", str(out), "--device", "cpu", *repro_flags])
    run.wait_for(_runs_done)  # the progress bar shows finished runs of the first (fast) mode
    run.proc.send_signal(signal.SIGINT)
    assert run.finish() == 130, run.text()[-3000:]
    err = run.err.decode(errors="replace")
    line = _only_line(err, "interrupted (Ctrl-C)")
    assert "in fast mode after" in line and "not run: deterministic mode" in line and "partial report" in line
    assert "Traceback" not in err
    data = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert data["partial"] is True and "interrupted (Ctrl-C) in fast mode" in data["experiment"]["partial"]
    (fast,) = data["sections"]
    assert fast["label"] == "fast" and 1 <= len(fast["completions"]) < 20000
    assert "after" in fast["extra"]["partial"]
    assert "Partial report:" in (out / "report.html").read_text(encoding="utf-8")


def test_interrupt_after_the_first_mode_keeps_its_section(tiny_chat_model, repro_flags, tmp_path, monkeypatch,
                                                          capsys):
    """In process: KeyboardInterrupt as the second mode starts its runs; the first mode's section is saved."""
    from detinfer.repro import api
    from detinfer.repro.cli import main

    real = api.run_offline

    def run_offline(engine, ids, cfg, **kw):
        if kw["label"] == "deterministic":
            raise KeyboardInterrupt
        return real(engine, ids, cfg, **kw)

    monkeypatch.setattr(api, "run_offline", run_offline)
    out = tmp_path / "report"
    rc = main([str(tiny_chat_model), "--prompt", PROMPT, "--mode", "both", "--n", "3", "--max-tokens", "4",
               "--out", str(out), "--device", "cpu", "--no-progress", *repro_flags])
    assert rc == 130
    line = _only_line(capsys.readouterr().err, "interrupted (Ctrl-C)")
    assert "while loading deterministic mode" in line or "in deterministic mode" in line, line
    data = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert data["partial"] is True
    assert [s["label"] for s in data["sections"]] == ["fast"]
    assert [c["run"] for c in data["sections"][0]["completions"]] == [0, 1, 2]
    assert "partial" not in data["sections"][0]["extra"]  # the fast mode itself had finished


def test_run_offline_hands_back_the_finished_runs(tiny_chat_model):
    """KeyboardInterrupt at a chosen engine step: Interrupted carries exactly the runs finished by then."""
    from detinfer.engine.config import EngineConfig
    from detinfer.engine.llm_engine import LLMEngine
    from detinfer.repro.experiment import ReproConfig, run_offline

    engine = LLMEngine(tiny_chat_model, EngineConfig(max_model_len=256, num_kv_blocks=128), "cpu")
    real_step, finished = engine.step, []

    def step():
        if len(finished) >= 2:  # Ctrl-C at the step after the one that finished the second run
            raise KeyboardInterrupt
        outs = real_step()
        finished.extend(o.request_id for o in outs if o.finished and o.request_id.startswith("run-"))
        return outs

    engine.step = step
    cfg = ReproConfig(n=50, max_tokens=4, max_background=2)
    with pytest.raises(Interrupted) as info:
        run_offline(engine, [1, 2, 3, 4], cfg, encode=engine.tokenizer.encode, progress=False)
    completions, extra = info.value.partial
    assert sorted(f"run-{c.run}" for c in completions) == sorted(finished)  # exactly the finished runs
    assert [c.run for c in completions] == sorted(c.run for c in completions)
    assert info.value.where == f"after {len(finished)} of 50 runs"
    assert extra["engine steps"] > 0


def test_audit_sigint_summarises_the_finished_scenarios(tmp_path):
    run = Watched(["audit", "--random-model", "tiny", "--device", "cpu", "--dtype", "float32", "--prompts",
                   "100000", "--max-len", "8"])
    run.wait_for(lambda text: "[deterministic] prompt 0" in text)  # a scenario finished and was printed
    run.proc.send_signal(signal.SIGINT)
    assert run.finish() == 130, run.text()[-3000:]
    err = run.err.decode(errors="replace")
    line = _only_line(err, "interrupted (Ctrl-C)")
    assert "partial result (deterministic mode)" in line and "finished scenarios bit-identical" in line, line
    assert "Traceback" not in err


def test_rl_sigint_checkpoints_and_reports_the_finished_steps(stories_dir, tmp_path):
    out = tmp_path / "rl"
    run = Watched(["rl", str(stories_dir), "--task", "emit-token", "--steps", "100000", "--prompts-per-step", "2",
                   "--n-samples", "2", "--max-tokens", "4", "--max-model-len", "64", "--device", "cpu",
                   "--no-progress", "--out", str(out)])
    run.wait_for(lambda text: "[deterministic] step 1  reward" in text)  # step 1 finished
    run.proc.send_signal(signal.SIGINT)
    assert run.finish() == 130, run.text()[-3000:]
    err = run.err.decode(errors="replace")
    line = _only_line(err, "interrupted (Ctrl-C)")
    assert "partial report:" in line and "checkpoint of step" in line and "of 100000" in line, line
    assert "Traceback" not in err
    doc = json.loads((out / "report.json").read_text())
    steps = [s["step"] for s in doc["arms"]["deterministic"]["steps"]]
    assert doc["partial"] is True and steps == list(range(1, len(steps) + 1)) and steps
    state = json.loads((out / "deterministic" / "checkpoint" / "state.json").read_text())
    assert state["step"] == steps[-1]  # the checkpoint holds exactly the reported steps


SLOW_SAVE = """
import sys, time
from detinfer.cli_util import interrupt_handling
with interrupt_handling():
    try:
        print("working", flush=True)
        time.sleep(600)
    except KeyboardInterrupt:
        print("saving", flush=True)
        time.sleep(600)  # a save that takes long: a second Ctrl-C must not wait for it
"""


def test_a_second_ctrl_c_exits_at_once():
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SAVE], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env, text=True)
    assert proc.stdout.readline() == "working\n"
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.readline() == "saving\n"  # the first Ctrl-C reached the work as KeyboardInterrupt
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 130  # not the 600 s the save would take
    assert "interrupted again: exiting now" in proc.stderr.read()
