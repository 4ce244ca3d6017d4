"""Per-step logs of one arm: metrics.jsonl (one JSON object per step), metrics.csv (one row per step) and,
optionally, TensorBoard events.

Both files mirror the trainer's history: on resume they are rewritten from the checkpoint's history, so they
never hold steps a run redid. The CSV's columns are stable: CSV_LEADING_COLUMNS first, then every other
metric in sorted order. A metric that appears later in the run (an eval on step 10, a reward function's first
failure) adds a column, and the file is rewritten whole with it, so every row always has every column (empty
where a step has no value). Histories are small (one row of ~40 numbers per step), so the rewrite is cheap.
"""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path

from detinfer.rl.checkpoint import jsonable

# The columns a user reads first, in this order (those a run has; the rest follow sorted by name).
CSV_LEADING_COLUMNS = ("step", "reward_mean", "response_len_mean", "truncated_frac", "loss",
                       "mismatch_bits_differ", "mismatch_max_abs_diff", "mismatch_kl_k3", "mismatch_tokens",
                       "weights_hash", "step_s", "rollout_s", "train_s")
TENSORBOARD_PACKAGE_HINT = "pip install tensorboard"


def csv_columns(history: list[dict]) -> list[str]:
    keys = {k for rec in history for k in rec}
    leading = [k for k in CSV_LEADING_COLUMNS if k in keys]
    return leading + sorted(keys - set(leading))


def write_csv(path: Path, history: list[dict], columns: list[str]) -> None:
    """The whole history as CSV (to a temporary file renamed into place: a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, restval="", extrasaction="raise")
        w.writeheader()
        for rec in history:
            w.writerow({k: _csv_value(v) for k, v in rec.items()})
    os.replace(tmp, path)


def _csv_value(v):
    if v is None:
        return ""
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)  # inf, -inf, nan
    return v


def tensorboard_writer_class():
    """torch's SummaryWriter, or an ImportError naming the package to install."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ImportError(f"--tensorboard needs the tensorboard package ({TENSORBOARD_PACKAGE_HINT})") from None
    return SummaryWriter


class StepLogs:
    """metrics.jsonl + metrics.csv (+ TensorBoard) of one arm, started from `history` (the steps already done)."""

    def __init__(self, arm_dir: str | Path, history: list[dict], *, tensorboard: bool = False):
        self.dir = Path(arm_dir)
        self.history = list(history)
        self.columns = csv_columns(self.history)
        with open(self.dir / "metrics.jsonl", "w", encoding="utf-8") as f:
            for rec in self.history:
                f.write(json.dumps(jsonable(rec)) + "\n")
        write_csv(self.dir / "metrics.csv", self.history, self.columns)
        self.writer = None
        if tensorboard:
            # purge_step: a resumed run's events replace any the interrupted run wrote past its checkpoint
            self.writer = tensorboard_writer_class()(log_dir=str(self.dir / "tensorboard"),
                                                     purge_step=len(self.history) + 1)

    def append(self, rec: dict) -> None:
        self.history.append(rec)
        with open(self.dir / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(jsonable(rec)) + "\n")
        new = [k for k in rec if k not in self.columns]
        if new:
            self.columns = csv_columns(self.history)
            write_csv(self.dir / "metrics.csv", self.history, self.columns)
        else:
            with open(self.dir / "metrics.csv", "a", encoding="utf-8", newline="") as f:
                csv.DictWriter(f, fieldnames=self.columns, restval="").writerow(
                    {k: _csv_value(v) for k, v in rec.items()})
        if self.writer is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                    self.writer.add_scalar(k, v, global_step=rec["step"])
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
