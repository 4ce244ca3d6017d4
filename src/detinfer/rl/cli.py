"""`detinfer rl`: GRPO on a verifiable task, sampler and trainer colocated on one set of weights, with
the sampler-vs-trainer mismatch logged every step; one report comparing the arms.

    detinfer rl DIR --task addition --steps 60 --mode both --out rl-report        (DIR or --model DIR)
    detinfer rl --model DIR --task emit-token --steps 4 --mode deterministic --out r   # then again:
    detinfer rl --model DIR --task emit-token --steps 8 --mode deterministic --out r --resume

Outputs per arm: <out>/<arm>/metrics.jsonl and metrics.csv, checkpoint/, tensorboard/ (--tensorboard), hf/
(--export-hf; or later: detinfer export <out>/<arm>/checkpoint OUT --model DIR).

--mode: deterministic | fast | fast-tis | both (= all three arms: deterministic; fast without importance
weighting; fast with truncated importance weighting, cap --tis-cap). Flags other than the target, --mode,
--out, --device, --resume and --check come from `RLConfig`. On a CPU, --steps, --prompts-per-step,
--n-samples and --max-tokens default to CPU_DEFAULTS (GPU-sized steps take minutes there).
Ctrl-C: the finished steps are checkpointed and reported (marked partial); exit status 130.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from detinfer.cli_util import (
    INTERRUPTED_EXIT_STATUS,
    Interrupted,
    Parser,
    add_model_argument,
    check_outcome,
    interrupt_handling,
    model_path,
    runs_on_cpu,
)
from detinfer.engine.config import add_dataclass_args, from_args
from detinfer.rl.config import MODE_ARMS, RLConfig
from detinfer.rl.tasks import get_task

PROG = "detinfer rl"


# RLConfig's defaults are sized for a GPU: on a CPU one such step took 805 s with SmolLM2-135M. A CPU run gets
# these instead, for each flag not given, so that a step takes seconds and the whole run a minute or two.
CPU_DEFAULTS = {"steps": 4, "prompts_per_step": 4, "n_samples": 4, "max_tokens": 16}


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG,
               description="GRPO with the engine as the sampler and the same weights as the trainer; logs "
                           "reward and the sampler-vs-trainer logprob mismatch per step, writes a report.")
    add_model_argument(p, "HF-format model directory (or hub id) to train")
    p.add_argument("--mode", choices=list(MODE_ARMS), default="deterministic",
                   help="which arm(s) to run; both: deterministic, fast and fast-tis (default: deterministic)")
    p.add_argument("--out", default="rl-report", help="output directory: report, metrics, checkpoints "
                   "(default: rl-report)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    p.add_argument("--max-model-len", type=int, default=512, help="engine: most tokens per sequence, prompt "
                   "included (default: 512)")
    p.add_argument("--resume", action="store_true", help="continue each arm from its checkpoint in --out "
                   "(bitwise the same as an uninterrupted run in deterministic mode)")
    p.add_argument("--check", action="store_true", help="exit 1 unless the deterministic arm's mismatch was "
                   "exactly 0 at every step")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--tensorboard", action="store_true", help="also write TensorBoard events to "
                   "<out>/<arm>/tensorboard (needs the tensorboard package)")
    p.add_argument("--export-hf", action="store_true", help="at the end, write each arm's trained weights as a "
                   "Hugging Face checkpoint (config.json, tokenizer, model.safetensors) to <out>/<arm>/hf")
    add_dataclass_args(p, RLConfig)
    p.set_defaults(**{k: None for k in CPU_DEFAULTS})  # None: not given, filled in by device in main
    for action in p._actions:
        if action.dest in CPU_DEFAULTS:
            gpu = getattr(RLConfig, action.dest)
            action.help = f"{action.help.rstrip('.')} (default: {gpu}; {CPU_DEFAULTS[action.dest]} on a CPU)."
    return p


def _size_defaults(ns: argparse.Namespace) -> str | None:
    """Fill the sizes left out with the device's defaults; on a CPU, the one-line notice saying so."""
    cpu = runs_on_cpu(ns.device)
    left_out = [k for k in CPU_DEFAULTS if getattr(ns, k) is None]
    for k in left_out:
        setattr(ns, k, CPU_DEFAULTS[k] if cpu else getattr(RLConfig, k))
    if not (cpu and left_out):
        return None
    flags = " ".join(f"--{k.replace('_', '-')} {getattr(ns, k)}" for k in left_out)
    gpu = " ".join(f"--{k.replace('_', '-')} {getattr(RLConfig, k)}" for k in left_out)
    return f"{PROG}: no GPU: CPU-sized defaults {flags} (a GPU run defaults to {gpu}; give a flag to override it)"


def main(argv: list[str] | None = None) -> int:
    with interrupt_handling():
        try:
            return _main(argv)
        except Interrupted as e:
            paths = e.partial.get("paths") if isinstance(e.partial, dict) else None
            saved = (f"partial report: {paths['html']} (--resume continues from the checkpoints)" if paths else
                     "no step had finished: nothing saved")
            print(f"{PROG}: interrupted (Ctrl-C) {e.where}; {saved}", file=sys.stderr)
            return INTERRUPTED_EXIT_STATUS
        except KeyboardInterrupt:
            print(f"{PROG}: interrupted (Ctrl-C) before any step had finished; nothing saved", file=sys.stderr)
            return INTERRUPTED_EXIT_STATUS


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    model = model_path(parser, ns)
    if model is None:
        parser.error("give the model directory (MODEL_DIR or --model DIR)")
    try:
        notice = _size_defaults(ns)
        config = from_args(RLConfig, ns)
        get_task(config.task)  # an unknown task is refused before anything loads
        if ns.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {ns.max_model_len}")
        if notice:
            print(notice, file=sys.stderr)
        from detinfer.rl.api import run

        command = "detinfer rl " + shlex.join(sys.argv[1:] if argv is None else argv)
        result = run(model, config, MODE_ARMS[ns.mode], ns.out, device=ns.device, resume=ns.resume,
                     progress=not ns.no_progress, max_model_len=ns.max_model_len,
                     experiment={"command": command, "mode": ns.mode}, tensorboard=ns.tensorboard,
                     export_hf=ns.export_hf)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError, ImportError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(f"report: {result['paths']['html']}")
    det = result["histories"].get("deterministic")
    if ns.check and det is not None:
        bad = [h["step"] for h in det if h["mismatch_bits_differ"] != 0 or h["mismatch_max_abs_diff"] != 0]
        return check_outcome(f"deterministic sampler and trainer differed at steps {bad[:10]}" if bad else None,
                             f"deterministic mismatch exactly 0 at all {len(det)} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
