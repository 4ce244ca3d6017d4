"""`detinfer repro`: run one prompt N times under a random background load and report how many unique
completions came back, where they diverge, and why (logprobs).

    detinfer repro --model DIR --prompt "Tell me about Richard Feynman" --mode both --n 1000
    detinfer repro DIR --prompt "Tell me about Richard Feynman" --mode both     (DIR or --model DIR: the same)
    detinfer repro --url http://127.0.0.1:8000 --prompt-file prompt.txt --n 200
    detinfer repro --random-model qwen3-8b --prompt "Tell me about Richard Feynman" --mode both

Flags: the experiment's (`ReproConfig`), the engine's (`EngineConfig`, offline only), and the target.
Writes report.html (self-contained), report.json (every raw completion) and PNG plots into --out.
With --check the exit status is 1 when a run set that should reproduce (deterministic mode, or a server)
gave more than one distinct completion or logprob sequence: a regression test for a deployment.
Ctrl-C writes the runs that finished as a report marked partial and exits with status 130.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path

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
from detinfer.constants import MODES as ENGINE_MODES
from detinfer.engine.config import EngineConfig, add_dataclass_args, from_args
from detinfer.repro.experiment import ReproConfig

MODES = (*ENGINE_MODES, "both")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="detinfer repro", conflict_handler="resolve",
        description="Run one prompt N times while random background requests are in flight; report the "
                    "number of unique completions, where they diverge, and plots (HTML + JSON).")
    target = p.add_argument_group("target (one of)")
    add_model_argument(target, "HF-format model directory for the offline engine")
    from detinfer.models.families import preset_names

    target.add_argument("--random-model", help="build a model of this shape with random weights in-process "
                        f"({', '.join(preset_names())})")
    target.add_argument("--url", action="append", help="base URL of an OpenAI-compatible server; repeat to "
                        "compare several side by side")
    prompt = p.add_argument_group("prompt (one of)")
    prompt.add_argument("--prompt", help="the prompt text")
    prompt.add_argument("--prompt-file", help="file whose whole content (UTF-8) is the prompt")
    out = p.add_argument_group("output")
    out.add_argument("--out", default="repro-report", help="directory for the report (default: repro-report)")
    out.add_argument("--check", action="store_true", help="exit 1 unless every deterministic-mode or server "
                     "run set gave exactly one completion (and one logprob sequence, when logprobs are on)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_dataclass_args(p, ReproConfig)
    add_dataclass_args(p, EngineConfig)
    # Replaces EngineConfig's --mode (conflict_handler="resolve"): "both" runs each engine mode in turn.
    p.add_argument("--mode", choices=MODES, default=None,
                   help="offline engine mode; both: fast and deterministic side by side (default: deterministic)")
    p.add_argument("--device", default=None, help="torch device for the offline engine (default: cuda if "
                   "available)")
    p.add_argument("--random-seed", type=int, default=0, help="seed of --random-model's weights (default: 0)")
    p.add_argument("--model-name", default=None, help="server: the `model` to request (default: the first "
                   "one GET /v1/models lists)")
    p.add_argument("--api-key", default=None, help="server: bearer token")
    # --n and --max-tokens default by device (see CPU_DEFAULTS): None here means "not given".
    p.set_defaults(n=None, max_tokens=None)
    for action in p._actions:
        if action.dest == "n":
            action.help = (f"Runs of the prompt (default: {GPU_DEFAULTS['n']} on a GPU, {CPU_DEFAULTS['n']} on a "
                           "CPU).")
        elif action.dest == "max_tokens":
            action.help = (f"Most tokens per completion (default: {GPU_DEFAULTS['max_tokens']} on a GPU, "
                           f"{CPU_DEFAULTS['max_tokens']} on a CPU).")
    return p


# Sized so that a 135M-parameter model's run (both modes) takes minutes, not hours, on a 2-core CPU.
CPU_DEFAULTS = {"n": 20, "max_tokens": 64}
GPU_DEFAULTS = {"n": 1000, "max_tokens": 256}


def _on_cpu(ns: argparse.Namespace) -> bool:
    return not ns.url and runs_on_cpu(ns.device)


def _size_defaults(ns: argparse.Namespace) -> None:
    """Fill --n / --max-tokens left out with the device's defaults; say so on a CPU."""
    cpu = _on_cpu(ns)
    sizes = CPU_DEFAULTS if cpu else GPU_DEFAULTS
    left_out = [k for k in ("n", "max_tokens") if getattr(ns, k) is None]
    for k in left_out:
        setattr(ns, k, sizes[k])
    if cpu and left_out:  # name only the values filled in: the others are the user's own
        flags = " ".join(f"--{k.replace('_', '-')} {getattr(ns, k)}" for k in left_out)
        gpu = " ".join(f"--{k.replace('_', '-')} {GPU_DEFAULTS[k]}" for k in left_out)
        print(f"detinfer repro: no GPU: CPU-sized defaults: {flags} (a GPU run defaults to {gpu})", file=sys.stderr)


def _engine_config(ns: argparse.Namespace) -> EngineConfig:
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineConfig)
              if f.name != "mode" and hasattr(ns, f.name)}
    return EngineConfig(**values)


def _read_prompt(ns: argparse.Namespace) -> str:
    if (ns.prompt is None) == (ns.prompt_file is None):
        raise ValueError("give exactly one of --prompt and --prompt-file")
    if ns.prompt is not None:
        return ns.prompt
    path = Path(ns.prompt_file)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"prompt file {path} is not UTF-8 text ({e})") from None


def describe(section) -> str:
    """A few lines summarising one section for the terminal (same verdict as the HTML and --check)."""
    from detinfer.repro.report import at_unit, verdict

    s = section.summary
    lines = [f"{section.label}: {verdict(s)} (most common completion: {s.most_common_count} runs)"]
    rate = section.extra.get("output tokens/s")
    if rate is not None:
        lines.append(f"  {section.extra['output tokens']} output tokens (runs and background) in "
                     f"{section.elapsed_s:.1f} s: {rate} tokens/s")
    if s.agreed_prefix is not None:
        lines.append(f"  all runs agree for {s.agreed_prefix} {s.unit}s")
    if s.logprob_divergence:
        lines.append(f"  {len(s.logprob_divergence)} run(s) differ from run {s.reference_run} in logprob bits, "
                     f"the earliest {at_unit(s.unit, min(s.logprob_divergence))}")
    if s.pairs:
        p = s.pairs[0]
        lines.append(f"  #{p.a} vs #{p.b} diverge {at_unit(s.unit, p.index)}: ...{p.prefix[-40:]!r} -> "
                     f"{p.a_text[:30]!r} ({p.a_count} runs) vs {p.b_text[:30]!r} ({p.b_count} runs)")
    return "\n".join(lines)


def reproduces(section) -> bool:
    from detinfer.repro.report import reproduces as summary_reproduces

    return summary_reproduces(section.summary)


def main(argv: list[str] | None = None) -> int:
    with interrupt_handling():
        try:
            return _main(argv)
        except KeyboardInterrupt:  # outside the runs (their Ctrl-C: _report_partial)
            print("detinfer repro: interrupted (Ctrl-C) before any run had finished; no report written",
                  file=sys.stderr)
            return INTERRUPTED_EXIT_STATUS


def _report_partial(e: Interrupted, out: str, experiment: dict) -> int:
    """Ctrl-C: write the finished sections as a report marked partial; one line says what was kept."""
    from detinfer.repro.report import write_report

    sections = e.partial or []
    if not sections:
        print(f"detinfer repro: interrupted (Ctrl-C) {e.where}; no run had finished, nothing saved",
              file=sys.stderr)
        return INTERRUPTED_EXIT_STATUS
    paths = write_report(out, sections, {**experiment, "partial": f"interrupted (Ctrl-C) {e.where}"})
    print(f"detinfer repro: interrupted (Ctrl-C) {e.where}; partial report of the finished runs: {paths['html']}",
          file=sys.stderr)
    return INTERRUPTED_EXIT_STATUS


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    ns.model = model_path(parser, ns)
    targets = [ns.model is not None, ns.random_model is not None, bool(ns.url)]
    if sum(targets) != 1:
        parser.error("give exactly one target: a model directory (MODEL_DIR or --model DIR), --random-model "
                     "NAME or --url URL")
    if ns.url and ns.mode is not None:
        parser.error("--mode applies to the offline engine; a server runs in its own mode (compare servers "
                     "by repeating --url)")
    _size_defaults(ns)
    try:
        cfg = from_args(ReproConfig, ns)
        prompt = _read_prompt(ns)
        from detinfer.repro import api

        experiment = {"prompt": prompt, **dataclasses.asdict(cfg),
                      "target": ns.model or (f"random {ns.random_model}" if ns.random_model else ns.url),
                      "command": "detinfer repro " + shlex.join(sys.argv[1:] if argv is None else argv)}
        if ns.url:
            sections = api.repro_server(ns.url, prompt, cfg, model=ns.model_name, api_key=ns.api_key,
                                        progress=not ns.no_progress)
        else:
            mode = ns.mode or "deterministic"
            modes = ("fast", "deterministic") if mode == "both" else (mode,)
            sections = api.repro_offline(ns.model, prompt, cfg, modes=modes, engine_config=_engine_config(ns),
                                         device=ns.device, random_model=ns.random_model,
                                         random_seed=ns.random_seed, progress=not ns.no_progress)
        from detinfer.repro.report import write_report

        paths = write_report(ns.out, sections, experiment)
    except Interrupted as e:
        return _report_partial(e, ns.out, experiment)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError, ImportError) as e:
        print(f"detinfer repro: error: {e}", file=sys.stderr)
        return 2
    from detinfer.repro.report import headline

    print(headline(sections))
    for s in sections:
        print(describe(s))
    rates = {s.label: s.extra.get("output tokens/s") for s in sections}
    if rates.get("fast") and rates.get("deterministic"):  # the same plan in both: the cost of determinism
        print(f"throughput deterministic / fast: {rates['deterministic'] / rates['fast']:.3f}")
    print(f"report: {paths['html']}  (raw completions: {paths['json']})")
    if ns.check:
        must = [s for s in sections if s.label != "fast"]
        bad = [s.label for s in must if not reproduces(s)]
        return check_outcome(f"not reproducible: {', '.join(bad)}" if bad else None,
                             f"{', '.join(s.label for s in must)} reproduced bit for bit")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
