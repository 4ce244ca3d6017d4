"""Pieces every `detinfer` subcommand shares: the argument parser, the model argument, CPU thread policy.

* `Parser`: no prefix matching of long flags (`--max-token 8` must be an error, not a prefix of
  `--max-tokens-something`), and errors are one line naming the problem plus where to find the usage,
  instead of a usage dump with the message at the bottom.
* `add_model_argument` / `model_path`: the model directory is accepted both as a positional argument and as
  `--model DIR`, in every subcommand that takes one, with `~` expanded (a quoted "~/..." reaches us as is).
* `cpu_thread_policy`: on a CPU, how many torch threads a run should use (see its doc).
* `check_outcome`: what `--check` prints and the exit status it gives (1: failed, 0: passed).
* `Interrupted` / `interrupt_handling`: Ctrl-C in a long command keeps the work that finished (a partial
  report or checkpoint), says so in one line and exits with status 130; a second Ctrl-C exits at once.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading


class Parser(argparse.ArgumentParser):
    """argparse without flag abbreviations and with one-line errors."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # noqa: D401 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def add_model_argument(parser: argparse.ArgumentParser, help_text: str = "HF-format model directory") -> None:
    """The model directory, positional or as --model (both spellings, one meaning)."""
    parser.add_argument("model_dir", nargs="?", metavar="MODEL_DIR", help=f"{help_text} (or --model DIR)")
    parser.add_argument("--model", dest="model_flag", metavar="DIR", help=f"{help_text} (same as MODEL_DIR)")


def model_path(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> str | None:
    """The model directory given either way, `~` expanded; an error if given twice differently."""
    pos, flag = ns.model_dir, ns.model_flag
    if pos is not None and flag is not None and os.path.expanduser(pos) != os.path.expanduser(flag):
        parser.error(f"the model was given twice ({pos!r} and --model {flag!r}); give it once")
    path = flag if flag is not None else pos
    return None if path is None else os.path.expanduser(path)


def runs_on_cpu(device: str | None) -> bool:
    """Whether a run asked for `device` (None: the default, a GPU where there is one) runs on the CPU."""
    if device is not None:
        return str(device).startswith("cpu")
    import torch

    return not torch.cuda.is_available()


def cpu_thread_policy(device: str | None) -> int | None:
    """Torch threads for a CPU run, set once before the work (None: leave torch's choice).

    Why: with the cores shared, every multi-threaded torch op waits at a barrier for a thread the OS has
    descheduled; a 2-core machine running anything else made a step several times slower with 2 threads
    than with 1. So: the cores the machine is not already busy with (1-minute load average), at least 1.
    DETINFER_CPU_THREADS (or OMP_NUM_THREADS) overrides. Thread counts never change a deterministic-mode
    bit (every reduction there has a fixed order or is exact)."""
    if device not in (None, "cpu"):
        return None
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    if device is None and torch.cuda.is_available():
        return None
    env = os.environ.get("DETINFER_CPU_THREADS") or os.environ.get("OMP_NUM_THREADS")
    if env:
        try:
            n = max(1, int(env))
        except ValueError:
            print(f"detinfer: ignoring DETINFER_CPU_THREADS/OMP_NUM_THREADS={env!r} (not an integer)",
                  file=sys.stderr)
        else:
            torch.set_num_threads(n)
            return n
    cores = os.cpu_count() or 1
    try:
        busy = os.getloadavg()[0]
    except OSError:  # pragma: no cover - platforms without a load average
        busy = 0.0
    n = max(1, min(torch.get_num_threads(), cores - int(busy + 0.5)))
    torch.set_num_threads(n)
    return n


def progress(msg: str, enabled: bool = True) -> None:
    """A progress line on stderr (stdout stays the result)."""
    if enabled:
        print(msg, file=sys.stderr, flush=True)


def check_outcome(failure: str | None, passed: str) -> int:
    """`--check`'s verdict: `check FAILED: <failure>` on stderr and exit status 1 when there is a failure,
    else `check passed: <passed>` on stdout and 0 (stdout stays the result; a CI step reads the status)."""
    if failure is not None:
        print(f"check FAILED: {failure}", file=sys.stderr)
        return 1
    print(f"check passed: {passed}")
    return 0


INTERRUPTED_EXIT_STATUS = 130  # 128 + SIGINT, what shells report for a command stopped by Ctrl-C


class Interrupted(KeyboardInterrupt):
    """Ctrl-C reached a command's work; `partial` is what had finished by then (None: nothing had).

    A KeyboardInterrupt, so code that does not know it still stops as on any Ctrl-C."""

    def __init__(self, partial=None, where: str = ""):
        super().__init__(where)
        self.partial, self.where = partial, where


@contextlib.contextmanager
def interrupt_handling():
    """For a command's main(): the first Ctrl-C raises KeyboardInterrupt as usual (the work saves what it
    finished), a second one ends the process at once with status 130, without waiting for that save (saves
    go to temporary files renamed into place, so an unfinished one never looks complete). Outside the main
    thread (signals go only there) it does nothing. The previous handler is restored on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def second(signum, frame):
        os.write(2, b"interrupted again: exiting now\n")
        os._exit(INTERRUPTED_EXIT_STATUS)

    def first(signum, frame):
        signal.signal(signal.SIGINT, second)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, first)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
