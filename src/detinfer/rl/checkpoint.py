"""Checkpoints of a GRPO run: everything a resumed run needs to continue bit for bit.

A checkpoint directory holds
  weights.safetensors    the trained weights (fp32 masters for 16-bit engines), by parameter name
  optimizer.safetensors  AdamW's per-parameter state ("<name>::exp_avg", "::exp_avg_sq", "::step")
  state.json             steps done, the run's seed and config, the arm, the optimizer's hyperparameters,
                         the metrics history, the weights' fingerprint and the run's identity (model, engine
                         limits, task data: see `run_identity`), which a resume must match

There is no other random state to save: a step's prompts and every sampling seed are pure functions of
(seed, step, prompt, sample), so (seed, steps done) is the whole RNG state. A checkpoint is written to a
temporary sibling directory and renamed into place, so an interrupted save never leaves a half-written
checkpoint that looks valid.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from detinfer.rl.config import RLConfig, resumable_changes

# /2: AdamW in two param groups (decayed weight matrices; norms, biases and embeddings without decay)
CHECKPOINT_FORMAT = "detinfer-rl-checkpoint/2"


def jsonable(x):
    """Strict JSON: non-finite floats become the strings "inf", "-inf", "nan"."""
    if isinstance(x, float) and x != x or x in (float("inf"), float("-inf")):
        return repr(x)
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def _safetensors():
    try:
        from safetensors.torch import load_file, save_file
    except ImportError:
        raise ImportError("checkpoints need safetensors: pip install safetensors") from None
    return load_file, save_file


# The engine settings that bound or shape what a run samples (EngineConfig fields).
# RLConfig fields added after checkpoint format 2 was defined: a checkpoint without one ran at its default.
NEWER_FIELDS = ("tensor_parallel_size", "tp_invariant_reduction", "layout", "trainer_ranks", "offload_optimizer")
ENGINE_IDENTITY_FIELDS = ("max_model_len", "block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens")


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _model_identity(trainer, model) -> dict:
    """What the run started from: the initial weights' fingerprint (exact bits), and for a model directory
    its config.json's SHA-256 and its weight files' sizes. The path is recorded for messages only (a moved
    directory is the same model)."""
    identity = {"initial_weights": trainer.fingerprint()}
    path = Path(model) if isinstance(model, (str, Path)) else None
    if path is not None and path.is_dir():
        identity["path"] = str(path)
        if (path / "config.json").is_file():
            identity["config_json_sha256"] = _sha256_file(path / "config.json")
        identity["weight_file_sizes"] = {p.name: p.stat().st_size for p in sorted(path.glob("*.safetensors"))}
    else:
        identity["path"] = str(model) if isinstance(model, (str, Path)) else type(model).__name__
    return identity


def _examples_sha256(examples) -> str:
    h = hashlib.sha256()
    for ex in examples:
        h.update(json.dumps([ex.prompt, ex.answer, ex.meta], sort_keys=True, default=repr).encode())
        h.update(b"\n")
    return h.hexdigest()


def _task_identity(trainer) -> dict:
    """The prompts the run trains and evaluates on: the task's name, a SHA-256 of its examples (a dataset's
    rows as loaded, whatever their source: a file's edited rows or another dataset revision change it) or,
    for a generator task, of its first step's examples; a local dataset file's SHA-256; the eval examples."""
    from detinfer.rl.tasks import examples_for_step

    task, c = trainer.task, trainer.config
    examples = task.examples if task.examples is not None else examples_for_step(task, c.seed, 0, c.prompts_per_step)
    identity = {"name": task.name, "examples_sha256": _examples_sha256(examples),
                "eval_examples_sha256": _examples_sha256(trainer.eval_examples)}
    for key in ("dataset", "eval_dataset"):
        source = getattr(c, key)
        if source is not None and Path(source).is_file():
            identity[f"{key}_file_sha256"] = _sha256_file(Path(source))
    return identity


def run_identity(trainer, model, max_model_len: int) -> dict:
    """Everything besides RLConfig that decides a run's trajectory, computed from a freshly built `trainer`
    (before any step or checkpoint load): {"model": ..., "engine": ..., "task": ...}. A checkpoint stores it,
    and a resume refuses to continue under a different one (`check_identity`)."""
    engine = {k: getattr(trainer.engine.config, k) for k in ENGINE_IDENTITY_FIELDS if hasattr(trainer.engine.config, k)}
    engine["max_model_len"] = max_model_len
    engine["weights_dtype"] = str(trainer.engine.runner.dtype).removeprefix("torch.")
    return {"model": _model_identity(trainer, model), "engine": engine, "task": _task_identity(trainer)}


def check_identity(saved: dict | None, now: dict | None) -> None:
    """Refuse a resume whose model, engine limits or task data differ from the checkpoint's, naming each
    difference with its old and new value. Checkpoints written before identities were stored have none
    (nothing to compare); `path` alone may differ (a moved model directory)."""
    if saved is None or now is None:
        return
    diffs = []
    for part in ("model", "engine", "task"):
        old, new = saved.get(part, {}), now.get(part, {})
        for key in sorted(set(old) | set(new)):
            if key != "path" and old.get(key) != new.get(key):
                diffs.append(f"{part} {key}: {old.get(key, '(absent)')!r} -> {new.get(key, '(absent)')!r}")
    if diffs:
        where = f" (checkpoint's model: {saved.get('model', {}).get('path')}, now: {now.get('model', {}).get('path')})"
        raise ValueError("cannot resume: this run differs from the checkpoint's in what decides its trajectory: "
                         + "; ".join(diffs) + where)


def save_checkpoint(trainer, directory: str | Path, identity: dict | None = None) -> Path:
    """Write `trainer`'s (a GRPOTrainer) state into `directory` (replaced if it exists), with the run's
    `identity` (`run_identity`) when given."""
    _, save_file = _safetensors()
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    weights, opt_tensors = trainer.checkpoint_tensors()  # full tensors (data-parallel ranks: gathered)
    save_file(weights, str(tmp / "weights.safetensors"))
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    groups = [{k: v for k, v in g.items() if k != "params"} for g in trainer.optimizer.state_dict()["param_groups"]]
    state = {"format": CHECKPOINT_FORMAT, "step": trainer.step_index, "arm": trainer.arm,
             "task": trainer.task.name, "config": trainer.config.to_dict(), "optimizer_param_groups": groups,
             "weights_hash": trainer.fingerprint(), "history": trainer.history, "identity": identity}
    (tmp / "state.json").write_text(json.dumps(jsonable(state), indent=1, allow_nan=False) + "\n", encoding="utf-8")
    if directory.exists():
        shutil.rmtree(directory)
    tmp.rename(directory)
    return directory


def read_state(directory: str | Path) -> dict:
    path = Path(directory) / "state.json"
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {directory} (state.json missing)")
    state = json.loads(path.read_text(encoding="utf-8"))
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: not a {CHECKPOINT_FORMAT} checkpoint (format {state.get('format')!r})")
    return state


def check_compatible(state: dict, config: RLConfig, arm: str, task_name: str) -> None:
    """Refuse to resume under settings that would change the trajectory: any field of RLConfig except
    steps and checkpoint_every (and steps too under a decaying learning-rate schedule)."""
    if state["arm"] != arm:
        raise ValueError(f"the checkpoint is of arm {state['arm']!r}, not {arm!r}")
    if state["task"] != task_name:
        raise ValueError(f"the checkpoint trained task {state['task']!r}, not {task_name!r}")
    saved, now = state["config"], config.to_dict()
    allowed = resumable_changes(config)
    # a field newer than the checkpoint ran at its default (the behaviour before the field existed)
    saved = {**{k: v for k, v in RLConfig().to_dict().items() if k in NEWER_FIELDS}, **saved}
    changed = sorted(k for k in now if k not in allowed and (k not in saved or saved[k] != now[k]))
    if changed:
        diffs = ", ".join(f"{k}: {saved.get(k, '(absent)')!r} -> {now[k]!r}" for k in changed)
        raise ValueError(f"cannot resume with different settings ({diffs}); only {allowed} may change")


@torch.no_grad()
def load_checkpoint(trainer, directory: str | Path, identity: dict | None = None) -> dict:
    """Restore weights, optimizer state, step and history into a freshly built `trainer`; the engine
    sees the restored weights (and an empty prefix cache). `identity`: this run's `run_identity`, refused
    if it differs from the checkpoint's. Returns the checkpoint's state.json."""
    directory = Path(directory)
    state = read_state(directory)
    check_compatible(state, trainer.config, trainer.arm, trainer.task.name)
    check_identity(state.get("identity"), identity)
    followers = getattr(trainer, "_followers", None)
    if followers is None:
        restore_tensors(trainer, directory, state)
    else:
        with followers.guard():  # the other trainer ranks restore their shards too (a dead one is named)
            followers.send("resume", str(directory))
            restore_tensors(trainer, directory, state)
    trainer.step_index = int(state["step"])
    trainer.history = list(state["history"])
    if trainer.fingerprint() != state["weights_hash"]:
        raise ValueError(f"{directory}: the restored weights' fingerprint {trainer.fingerprint()} differs from the "
                         f"saved {state['weights_hash']}")
    return state


@torch.no_grad()
def restore_tensors(trainer, directory: Path, state: dict) -> None:
    """The checkpoint's weights and AdamW state into `trainer` (data-parallel ranks: each its shards; every
    rank calls this), then pushed into the engine / sampler."""
    from detinfer.rl.trainer_ranks import copy_full_into, in_param_layout

    load_file, _ = _safetensors()
    weights = load_file(str(directory / "weights.safetensors"))
    named = trainer.named_parameters()
    names = [n for n, _ in named]
    if sorted(weights) != sorted(names):
        missing, extra = sorted(set(names) - set(weights))[:5], sorted(set(weights) - set(names))[:5]
        raise ValueError(f"{directory}: the checkpoint's weights do not match this model's parameters "
                         f"(missing {missing}, extra {extra})")
    for name, p in named:
        if weights[name].shape != p.shape or weights[name].dtype != p.dtype:
            raise ValueError(f"{directory}: weight {name} is {tuple(weights[name].shape)} {weights[name].dtype}, "
                             f"the model's is {tuple(p.shape)} {p.dtype}")
        copy_full_into(p, weights[name])
    opt = load_file(str(directory / "optimizer.safetensors"))
    # torch numbers an optimizer's parameters group after group; map each name to that index (OffloadedAdamW's
    # groups hold its host copies: its `params` are the trainer's parameters in that order)
    ordered = getattr(trainer.optimizer, "params", None) or [p for g in trainer.optimizer.param_groups
                                                            for p in g["params"]]
    index = {id(p): i for i, p in enumerate(ordered)}
    per_param = {}
    for name, p in named:
        entries = {k.split("::", 1)[1]: in_param_layout(v, p) for k, v in opt.items() if k.split("::", 1)[0] == name}
        if entries:
            per_param[index[id(p)]] = entries
    saved_groups = state["optimizer_param_groups"]
    current = trainer.optimizer.state_dict()["param_groups"]
    if len(saved_groups) != len(current):
        raise ValueError(f"{directory}: the checkpoint has {len(saved_groups)} optimizer param groups, this "
                         f"optimizer {len(current)}")
    groups = []
    for saved, now in zip(saved_groups, current):
        group = {**saved, "params": now["params"]}
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
        for impl in ("fused", "foreach"):  # keep this device's AdamW implementation (fused needs CUDA tensors)
            if impl in now:
                group[impl] = now[impl]
        groups.append(group)
    trainer.optimizer.load_state_dict({"state": per_param, "param_groups": groups})
    trainer.push_weights()  # engine tensors (and a separate sampler's) <- restored weights; prefix cache dropped
    if trainer.dp_size > 1:
        trainer.refresh_fingerprint()
