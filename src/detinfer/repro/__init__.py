"""Reproducibility harness: run one prompt N times under a random background load and count the unique
completions (`detinfer repro`), and check a model's batch invariance op by op (`detinfer audit`).

    from detinfer.repro import ReproConfig, repro_offline, write_report
"""

from detinfer.repro.analysis import Completion, Summary, first_divergence, summarize
from detinfer.repro.api import repro_offline, repro_server
from detinfer.repro.experiment import ReproConfig, make_plan
from detinfer.repro.report import Section, write_report

__all__ = ["Completion", "ReproConfig", "Section", "Summary", "first_divergence", "make_plan",
           "repro_offline", "repro_server", "summarize", "write_report"]
