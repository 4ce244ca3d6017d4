"""On-policy RL on the engine's own weights: GRPO whose sampler and trainer agree bit for bit.

Exports resolve lazily, so the config and tasks import without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "RLConfig": "detinfer.rl.config",
    "ARMS": "detinfer.rl.config",
    "Task": "detinfer.rl.tasks",
    "Example": "detinfer.rl.tasks",
    "TASKS": "detinfer.rl.tasks",
    "GRPOTrainer": "detinfer.rl.grpo",
    "run": "detinfer.rl.api",
    "run_arm": "detinfer.rl.api",
    "save_checkpoint": "detinfer.rl.checkpoint",
    "load_checkpoint": "detinfer.rl.checkpoint",
    "write_report": "detinfer.rl.report",
    "export_hf": "detinfer.rl.export",
    "export_checkpoint": "detinfer.rl.export",
}
__all__ = ["ARMS", "TASKS", "Example", "GRPOTrainer", "RLConfig", "Task", "export_checkpoint", "export_hf",
           "load_checkpoint", "run", "run_arm", "save_checkpoint", "write_report"]

if TYPE_CHECKING:
    from detinfer.rl.api import run, run_arm
    from detinfer.rl.checkpoint import load_checkpoint, save_checkpoint
    from detinfer.rl.config import ARMS, RLConfig
    from detinfer.rl.export import export_checkpoint, export_hf
    from detinfer.rl.grpo import GRPOTrainer
    from detinfer.rl.report import write_report
    from detinfer.rl.tasks import TASKS, Example, Task


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'detinfer.rl' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
