"""`detinfer rl`: GRPO on a verifiable task, sampler and trainer colocated on one set of weights, with
the sampler-vs-trainer mismatch logged every step; one report comparing the arms.

    detinfer rl --model DIR --task addition --steps 60 --mode both --out rl-report
    detinfer rl --model DIR --task emit-token --steps 4 --mode deterministic --out r   # then again:
    detinfer rl --model DIR --task emit-token --steps 8 --mode deterministic --out r --resume

--mode: deterministic | fast | fast-tis | both (= all three arms: deterministic; fast without importance
weighting; fast with truncated importance weighting, cap --tis-cap). Flags other than the target, --mode,
--out, --device, --resume and --check come from `RLConfig`.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from detinfer.engine.config import add_dataclass_args, from_args
from detinfer.rl.config import MODE_ARMS, RLConfig

PROG = "detinfer rl"


class _Parser(argparse.ArgumentParser):
    """Errors in one line (`detinfer rl: error: ...`), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{PROG}: error: {message} (see `{PROG} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, allow_abbrev=False,
                description="GRPO with the engine as the sampler and the same weights as the trainer; logs "
                            "reward and the sampler-vs-trainer logprob mismatch per step, writes a report.")
    p.add_argument("--model", required=True, help="HF-format model directory (or hub id) to train")
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
    add_dataclass_args(p, RLConfig)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        config = from_args(RLConfig, ns)
        if ns.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {ns.max_model_len}")
        from detinfer.rl.api import run

        command = "detinfer rl " + shlex.join(sys.argv[1:] if argv is None else argv)
        result = run(ns.model, config, MODE_ARMS[ns.mode], ns.out, device=ns.device, resume=ns.resume,
                     progress=not ns.no_progress, max_model_len=ns.max_model_len,
                     experiment={"command": command, "mode": ns.mode})
    except (ValueError, TypeError, FileNotFoundError, RuntimeError, ImportError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(f"report: {result['paths']['html']}")
    det = result["histories"].get("deterministic")
    if ns.check and det is not None:
        bad = [h["step"] for h in det if h["mismatch_bits_differ"] != 0 or h["mismatch_max_abs_diff"] != 0]
        if bad:
            print(f"check FAILED: deterministic sampler and trainer differed at steps {bad[:10]}", file=sys.stderr)
            return 1
        print(f"check passed: deterministic mismatch exactly 0 at all {len(det)} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
