"""Run GRPO arms end to end: per arm, build the colocated trainer, step it (progress bar, one log line per
step with the weights' hash), save checkpoints and metrics; then one report comparing the arms.

    from detinfer.rl import RLConfig, run
    result = run("path/to/model", RLConfig(task="addition", steps=60), arms=("deterministic", "fast"),
                 out="rl-out")

Output layout: <out>/<arm>/metrics.jsonl (one JSON line per step), metrics.csv (the same, one row per step),
<out>/<arm>/checkpoint/ (latest), <out>/<arm>/tensorboard/ (with tensorboard=True), <out>/<arm>/hf/ (with
export_hf=True: the trained weights as a Hugging Face checkpoint), <out>/report.html, report.json, summary.png.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from detinfer.cli_util import Interrupted
from detinfer.rl.checkpoint import load_checkpoint, run_identity, save_checkpoint
from detinfer.rl.config import ARMS, RLConfig, arm_engine_mode
from detinfer.rl.logs import StepLogs
from detinfer.rl.tasks import Task


def format_step(arm: str, rec: dict) -> str:
    """One log line: the numbers a user watches, and the weights' hash (equal lines = equal runs)."""
    parts = [f"[{arm}] step {rec['step']}", f"reward {rec['reward_mean']:.3f}", f"len {rec['response_len_mean']:.1f}",
             f"mismatch {rec['mismatch_bits_differ']:.3g} of {rec['mismatch_tokens']} tokens",
             f"max|d| {rec['mismatch_max_abs_diff']:.3g}", f"kl {rec['mismatch_kl_k3']:.3g}",
             f"{rec['step_s']:.2f}s", f"weights {rec['weights_hash']}"]
    return "  ".join(parts + _extra_parts(rec))


def _extra_parts(rec: dict) -> list[str]:
    """Reward-function failures and eval results, on the steps that have them."""
    parts = []
    if rec.get("reward_failures"):
        parts.append(f"reward failures {rec['reward_failures']} ({rec.get('reward_error')})")
    if "eval_reward_mean" in rec:
        parts.append(f"eval reward {rec['eval_reward_mean']:.3f} acc {rec['eval_accuracy']:.3f}")
    return parts


def run_arm(model, config: RLConfig, arm: str, out: str | Path | None = None, *, task: Task | None = None,
            device=None, resume: bool = False, progress: bool = True, max_model_len: int = 512,
            log: Callable[[str], None] | None = print, tensorboard: bool = False,
            export_hf: bool = False) -> list[dict]:
    """Train one arm for config.steps steps (in total, counting a resumed checkpoint's); returns its
    per-step metrics. With `out`: metrics.jsonl, metrics.csv and checkpoints under <out>/<arm>/; `resume`
    continues from <out>/<arm>/checkpoint when one exists (refused if the model, the engine's limits or the
    task's data differ from the checkpoint's run: see checkpoint.run_identity). `tensorboard`: also write
    TensorBoard events to <out>/<arm>/tensorboard; `export_hf`: at the end, write the trained weights as a
    Hugging Face checkpoint to <out>/<arm>/hf (model given as a directory). Ctrl-C: the finished steps are
    checkpointed (with `out`) and `Interrupted` is raised with their metrics as `partial`."""
    from detinfer.rl.grpo import GRPOTrainer

    _check_output_options(model, out, tensorboard, export_hf)
    started = time.perf_counter()
    if log:
        log(f"[{arm}] loading {model if isinstance(model, (str, Path)) else type(model).__name__} "
            f"({arm_engine_mode(arm)} mode) ...")
    try:
        trainer = GRPOTrainer(model, config, arm, task=task, device=device, max_model_len=max_model_len)
    except KeyboardInterrupt:
        raise Interrupted([], f"[{arm}] while loading the model") from None
    try:  # (a Ctrl-C here, before the steps: a plain KeyboardInterrupt, nothing of this arm to keep)
        if log:
            c = config
            log(f"[{arm}] loaded in {time.perf_counter() - started:.1f} s on {trainer.device}; {c.steps} steps of "
                f"{c.prompts_per_step} prompts x {c.n_samples} samples, up to {c.max_tokens} tokens each")
        arm_dir = None if out is None else Path(out) / arm
        ckpt = None if arm_dir is None else arm_dir / "checkpoint"
        if arm_dir is not None:
            arm_dir.mkdir(parents=True, exist_ok=True)
        identity = run_identity(trainer, model, max_model_len)  # before any step or load: the initial weights
        if resume:
            if ckpt is None:
                raise ValueError("resume needs an output directory holding a checkpoint")
            if (ckpt / "state.json").is_file():
                load_checkpoint(trainer, ckpt, identity)
                if log:
                    log(f"[{arm}] resumed from {ckpt} at step {trainer.step_index} "
                        f"(weights {trainer.fingerprint()})")
            elif log:
                log(f"[{arm}] no checkpoint in {ckpt}; starting from step 0")
        if trainer.step_index > config.steps:
            raise ValueError(f"the checkpoint is at step {trainer.step_index}, past steps={config.steps}")
        try:
            _loop(trainer, config, arm, arm_dir, ckpt, identity, progress, log, tensorboard)
        except KeyboardInterrupt:
            where = f"[{arm}] during step {trainer.step_index + 1} of {config.steps}"
            if ckpt is not None and trainer.step_index > 0:
                save_checkpoint(trainer, ckpt, identity)  # the finished steps (a step is never half-applied)
                where += f"; checkpoint of step {trainer.step_index} in {ckpt}"
            raise Interrupted(list(trainer.history), where) from None
        if export_hf:
            from detinfer.rl.export import export_hf as export

            weights = trainer if trainer.dp_size == 1 else trainer.checkpoint_tensors()[0]  # (gathered)
            hf_dir = export(weights, arm_dir / "hf", _local_model_dir(model), overwrite=True)
            if log:
                log(f"[{arm}] exported the trained weights (weights {trainer.fingerprint()}) to {hf_dir}")
        return trainer.history
    finally:
        trainer.close()
        del trainer
        gc.collect()
        _empty_cuda_cache()


def _check_output_options(model, out, tensorboard: bool, export_hf: bool) -> None:
    """Refuse output options that cannot work before the model loads (not after a run of many minutes)."""
    if (tensorboard or export_hf) and out is None:
        raise ValueError("tensorboard and export_hf write under the output directory: give `out`")
    if export_hf and not isinstance(model, (str, Path)):
        raise ValueError("export_hf needs the model as a directory (its config.json and tokenizer are copied); "
                         "for a built LLM call detinfer.rl.export.export_hf yourself")
    if tensorboard:
        from detinfer.rl.logs import tensorboard_writer_class

        tensorboard_writer_class()  # raises ImportError naming the package


def _local_model_dir(model) -> Path:
    """The model's directory on disk (a hub id resolves to its downloaded snapshot)."""
    from detinfer.models.hub import resolve_model_path

    return Path(resolve_model_path(model))


def _loop(trainer, config: RLConfig, arm: str, arm_dir, ckpt, identity: dict, progress: bool, log,
          tensorboard: bool) -> None:
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=config.steps, initial=trainer.step_index, desc=arm, unit="step", dynamic_ncols=True)
    write = (lambda s: bar.write(s)) if bar is not None else log
    logs = None if arm_dir is None else StepLogs(arm_dir, trainer.history, tensorboard=tensorboard)
    try:
        while trainer.step_index < config.steps:
            if log:  # before the step: a step can take minutes, and the bar alone says nothing until it ends
                write(f"[{arm}] step {trainer.step_index + 1}/{config.steps}: sampling "
                      f"{config.prompts_per_step} x {config.n_samples}, then training ...")
            rec = trainer.step()
            if logs is not None:
                logs.append(rec)
            if log:
                write(format_step(arm, rec))
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{rec['reward_mean']:.3f}", mismatch=f"{rec['mismatch_bits_differ']:.3g}")
            every = config.checkpoint_every
            if ckpt is not None and (trainer.step_index == config.steps or (every and trainer.step_index % every == 0)):
                save_checkpoint(trainer, ckpt, identity)
    finally:
        if bar is not None:
            bar.close()
        if logs is not None:
            logs.close()


def _empty_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(model, config: RLConfig, arms: Sequence[str] = ARMS, out: str | Path = "rl-report", *,
        task: Task | None = None, device=None, resume: bool = False, progress: bool = True,
        max_model_len: int = 512, log: Callable[[str], None] | None = print,
        experiment: dict | None = None, tensorboard: bool = False, export_hf: bool = False) -> dict:
    """Train each arm in turn (one model in memory at a time) and write the comparison report.
    Returns {"histories": {arm: [per-step metrics]}, "paths": report files}."""
    for arm in arms:
        if arm not in ARMS:
            raise ValueError(f"unknown arm {arm!r}; arms: {ARMS}")
    histories = {}
    info = {**config.to_dict(), "model": str(model) if isinstance(model, (str, Path)) else type(model).__name__,
            "task": task.name if task else (config.dataset or config.task), **(experiment or {})}
    from detinfer.rl.report import write_report

    for arm in arms:
        try:
            histories[arm] = run_arm(model, config, arm, out, task=task, device=device, resume=resume,
                                     progress=progress, max_model_len=max_model_len, log=log,
                                     tensorboard=tensorboard, export_hf=export_hf)
        except KeyboardInterrupt as e:  # Interrupted from run_arm, or a Ctrl-C before its steps began
            where = e.where if isinstance(e, Interrupted) else f"[{arm}] before its first step"
            if isinstance(e, Interrupted) and e.partial:
                histories[arm] = e.partial
            not_run = [a for a in arms if a not in histories and a != arm]
            partial = {"histories": histories, "paths": None}
            if any(histories.values()):  # a report of the finished steps, marked partial
                info["partial"] = (f"interrupted (Ctrl-C) {where}" +
                                   (f"; arms not run: {', '.join(not_run)}" if not_run else ""))
                partial["paths"] = write_report(out, {a: h for a, h in histories.items() if h}, info)
            raise Interrupted(partial, where) from None
    paths = write_report(out, histories, info)
    return {"histories": histories, "paths": paths}
