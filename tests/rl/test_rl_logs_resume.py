"""Per-step logs (metrics.csv beside metrics.jsonl, optional TensorBoard events) and resume refusals: a
checkpoint refuses to continue under another model, other engine limits or other task data, naming what
changed with the old and the new value."""

import csv
import json
import shutil
import sys

import pytest
from safetensors.torch import load_file, save_file

from detinfer.rl import RLConfig, run_arm
from detinfer.rl.logs import CSV_LEADING_COLUMNS, StepLogs

CFG = RLConfig(task="emit-token", steps=1, prompts_per_step=2, n_samples=2, max_tokens=4, lr=3e-3)


def _run(model_dir, out, config=CFG, max_model_len=64, **kw):
    return run_arm(model_dir, config, "deterministic", out, device="cpu", progress=False,
                   max_model_len=max_model_len, log=None, **kw)


def _read_csv(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


# -- logs ------------------------------------------------------------------------------------------------
def test_csv_has_one_row_per_step_with_stable_columns(tmp_path):
    logs = StepLogs(tmp_path, [{"step": 1, "reward_mean": 0.5, "zeta": 1.0}])
    logs.append({"step": 2, "reward_mean": float("nan"), "zeta": 2.0, "reward_error": None})
    logs.append({"step": 3, "reward_mean": 1.0, "zeta": 3.0, "eval_accuracy": 0.25})  # a new column appears
    logs.close()
    rows = _read_csv(tmp_path / "metrics.csv")
    header = (tmp_path / "metrics.csv").read_text().splitlines()[0].split(",")
    assert header == ["step", "reward_mean", "eval_accuracy", "reward_error", "zeta"]
    assert [r["step"] for r in rows] == ["1", "2", "3"]
    assert [r["eval_accuracy"] for r in rows] == ["", "", "0.25"]
    assert rows[1]["reward_mean"] == "nan" and rows[1]["reward_error"] == ""
    jsonl = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in jsonl] == [1, 2, 3]


def test_rl_run_writes_csv_beside_jsonl_and_tensorboard_events(stories_dir, tmp_path):
    history = _run(stories_dir, tmp_path, CFG.replace(steps=2), tensorboard=True)
    rows = _read_csv(tmp_path / "deterministic" / "metrics.csv")
    assert len(rows) == 2 == len(history)
    header = list(rows[0])
    assert header[:len(CSV_LEADING_COLUMNS)] == [c for c in CSV_LEADING_COLUMNS if c in history[0]]
    assert [r["weights_hash"] for r in rows] == [h["weights_hash"] for h in history]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "deterministic" / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("reward_mean")
    assert [e.step for e in events] == [1, 2]
    assert [e.value for e in events] == pytest.approx([h["reward_mean"] for h in history])


def test_tensorboard_missing_is_refused_naming_the_package(stories_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import raises ImportError
    with pytest.raises(ImportError, match="pip install tensorboard"):
        _run(stories_dir, tmp_path, tensorboard=True)
    assert not (tmp_path / "deterministic").exists()  # refused before anything ran


# -- resume refusals -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def copied_model(stories_dir, tmp_path_factory):
    """A private copy of stories260k (the tests below change it)."""
    path = tmp_path_factory.mktemp("model") / "stories"
    shutil.copytree(stories_dir, path)
    return path


def _checkpointed(model, out, config=CFG, **kw):
    _run(model, out, config, **kw)
    assert (out / "deterministic" / "checkpoint" / "state.json").is_file()
    return out


def test_resume_refuses_other_initial_weights(copied_model, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(copied_model, model)
    out = _checkpointed(model, tmp_path / "out")
    weights = load_file(str(model / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1  # same size and config: other bits
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"cannot resume.*model initial_weights: '[0-9a-f]{12}' -> '[0-9a-f]{12}'"):
        _run(model, out, CFG.replace(steps=2), resume=True)


def test_resume_refuses_another_config_json(copied_model, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(copied_model, model)
    out = _checkpointed(model, tmp_path / "out")
    cfg = json.loads((model / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-6
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model config_json_sha256: '[0-9a-f]{64}' -> '[0-9a-f]{64}'"):
        _run(model, out, CFG.replace(steps=2), resume=True)


def test_resume_refuses_other_engine_limits(copied_model, tmp_path):
    out = _checkpointed(copied_model, tmp_path / "out")
    with pytest.raises(ValueError, match="engine max_model_len: 64 -> 80"):
        _run(copied_model, out, CFG.replace(steps=2), max_model_len=80, resume=True)


def test_resume_refuses_changed_dataset_rows(copied_model, tmp_path):
    data = tmp_path / "d.jsonl"
    rows = [{"prompt": f"Once upon a time {i}", "answer": str(i)} for i in range(6)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = CFG.replace(dataset=str(data))
    out = _checkpointed(copied_model, tmp_path / "out", config)
    rows[3]["answer"] = "changed"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match="task dataset_file_sha256: '[0-9a-f]{64}' -> '[0-9a-f]{64}'; "
                                         "task examples_sha256: '[0-9a-f]{64}' -> '[0-9a-f]{64}'"):
        _run(copied_model, out, config.replace(steps=2), resume=True)


def test_resume_under_the_same_identity_continues(copied_model, tmp_path):
    out = _checkpointed(copied_model, tmp_path / "out")
    moved = tmp_path / "moved"
    shutil.copytree(copied_model, moved)  # a moved model directory is the same model
    history = _run(moved, out, CFG.replace(steps=2), resume=True)
    assert [h["step"] for h in history] == [1, 2]
    state = json.loads((out / "deterministic" / "checkpoint" / "state.json").read_text())
    assert state["identity"]["engine"]["max_model_len"] == 64


def test_cli_tensorboard_and_export_flags(stories_dir, tmp_path, capsys):
    from detinfer.rl.cli import main as rl_main

    argv = [str(stories_dir), "--task", "emit-token", "--device", "cpu", "--max-model-len", "64", "--no-progress",
            "--steps", "1", "--prompts-per-step", "2", "--n-samples", "2", "--max-tokens", "4",
            "--out", str(tmp_path), "--tensorboard", "--export-hf"]
    assert rl_main(argv) == 0
    arm = tmp_path / "deterministic"
    assert (arm / "hf" / "model.safetensors").is_file() and (arm / "hf" / "tokenizer.json").is_file()
    assert list((arm / "tensorboard").glob("events.out.tfevents.*"))
    assert len(_read_csv(arm / "metrics.csv")) == 1
    assert "exported the trained weights" in capsys.readouterr().out


def test_cli_tensorboard_missing_exits_2_naming_the_package(stories_dir, tmp_path, monkeypatch, capsys):
    from detinfer.rl.cli import main as rl_main

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    argv = [str(stories_dir), "--task", "emit-token", "--device", "cpu", "--out", str(tmp_path), "--tensorboard"]
    assert rl_main(argv) == 2
    assert "needs the tensorboard package (pip install tensorboard)" in capsys.readouterr().err
