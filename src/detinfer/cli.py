"""`detinfer` command line: one subcommand per job; each module owns its own flags."""

from __future__ import annotations

import sys

# subcommand -> (module, one-line help). Imported lazily so `detinfer --help` stays fast.
_COMMANDS = {
    "demo": ("detinfer.demo", "measure batch-(in)variance of stock kernels vs detinfer on this machine"),
    "pull": ("detinfer.models.pull", "fetch a known model into the local cache as an HF-format directory"),
    "generate": ("detinfer.engine.generate_cli", "complete one prompt with the offline engine"),
    "serve": ("detinfer.server.serve", "run the OpenAI-compatible HTTP server"),
    "repro": ("detinfer.repro.cli", "N runs of a prompt under load: how many unique completions? (report)"),
    "audit": ("detinfer.repro.audit", "check a model's batch invariance and name the first op that differs"),
    "rl": ("detinfer.rl.cli", "GRPO with sampler-trainer logprobs equal bit for bit; compare with stock kernels"),
    "export": ("detinfer.rl.export", "write a `detinfer rl` checkpoint's weights as a Hugging Face checkpoint"),
}


# Commands whose CPU runs get `cli_util.cpu_thread_policy` (set once here, at the process entry, so that
# calling a command's main() from Python never changes the caller's torch thread count).
_CPU_POLICY_COMMANDS = ("generate", "repro", "audit", "rl")


def _apply_cpu_thread_policy(cmd: str, rest: list[str]) -> None:
    if any(a in ("-h", "--help") for a in rest) or any(a.startswith("--url") for a in rest):
        return
    device = None
    for i, a in enumerate(rest):
        if a == "--device" and i + 1 < len(rest):
            device = rest[i + 1]
        elif a.startswith("--device="):
            device = a.split("=", 1)[1]
    from detinfer.cli_util import cpu_thread_policy

    threads = cpu_thread_policy(device)
    if threads is not None:
        print(f"detinfer {cmd}: CPU run, {threads} torch thread(s) (DETINFER_CPU_THREADS=N overrides)",
              file=sys.stderr)


def _usage() -> str:
    lines = ["usage: detinfer <command> [options]  |  detinfer --version", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in _COMMANDS.items()]
    lines += ["", "run `detinfer <command> --help` for a command's options"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from detinfer import __version__

        print(f"detinfer {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in _COMMANDS:
        print(f"detinfer: unknown command {cmd!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    import importlib

    if cmd in _CPU_POLICY_COMMANDS:
        _apply_cpu_thread_policy(cmd, rest)
    module = importlib.import_module(_COMMANDS[cmd][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
