"""The demo's measurements and the CLI's argument handling (CPU)."""

import subprocess
import sys

import pytest

from detinfer import cli, demo


def test_shuffle_demo_counts_orders():
    counts = demo.shuffled_sums(10_000, seed=42)
    # Deterministic given the seed; many orders give many sums (the point of the demo). The exact counts
    # are properties of CPython's Mersenne Twister shuffle and IEEE arithmetic, measured: 258 and 133.
    assert counts == {"float64": 258, "float32": 133}


def test_matmul_demo_mode_gives_zero_on_cpu():
    import torch

    (m, k, n), stock, ours = demo.matmul_demo(torch.device("cpu"))
    assert (m, k, n) == (64, 512, 512)
    assert ours == 0.0 and stock >= 0.0


def test_cli_help_and_unknown_command(capsys):
    assert cli.main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out
    assert cli.main(["no-such-command"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_demo_rejects_bad_flags():
    with pytest.raises(SystemExit):
        demo.main(["--shuffles", "0"])


@pytest.mark.slow
def test_demo_runs_end_to_end():
    out = subprocess.run([sys.executable, "-m", "detinfer", "demo", "--shuffles", "200"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "batch_invariant" in out.stdout and "distinct float64 sums" in out.stdout
