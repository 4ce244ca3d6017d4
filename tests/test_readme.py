"""README.md's code blocks work as written.

Every ```python block runs, in a fresh interpreter, on the tiny real model (stories260k) on this machine.
The only edits made to a block before it runs are the substitutions in `SUBSTITUTIONS` (placeholder model
paths, and the server address of the OpenAI-client block); nothing else in the block changes. The
OpenAI-client block runs against a `detinfer serve` that this module starts on a free port of 127.0.0.1,
serving a copy of stories260k (with a ChatML chat template added to its tokenizer config, since
stories260k has none) under the name the block asks for.

Every ```bash block's `detinfer` commands are parsed by that subcommand's own argparse parser (nothing is
run, nothing installed), and every `pip install -e ".[extra]"` names an extra pyproject.toml defines.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_SERVER_URL = "http://127.0.0.1:8000/v1"  # the address the README's client block uses
README_SERVED_NAME = "smollm2-135m-instruct"  # the model name the README's client block requests
BLOCK_TIMEOUT_S = 600


def fenced_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def substitutions(model_dir: Path, server_url: str | None) -> dict[str, str]:
    """Placeholder -> what the test puts there. The placeholders are the quoted strings as they appear."""
    subs = {'"path/to/hf-model-dir"': repr(str(model_dir)), '"path/to/model"': repr(str(model_dir))}
    if server_url is not None:
        subs[f'"{README_SERVER_URL}"'] = repr(f"{server_url}/v1")
    return subs


def apply_substitutions(block: str, subs: dict[str, str]) -> str:
    for placeholder, value in subs.items():
        block = block.replace(placeholder, value)
    return block


def _needs_server(block: str) -> bool:
    return README_SERVER_URL in block


PYTHON_BLOCKS = fenced_blocks(README.read_text(encoding="utf-8"), "python")
BASH_BLOCKS = fenced_blocks(README.read_text(encoding="utf-8"), "bash")


def _block_id(block: str) -> str:
    """A readable test id: the block's first statement that is not an import."""
    for line in block.splitlines():
        if line.strip() and not line.startswith(("import ", "from ")):
            return re.sub(r"\W+", "_", line.split("#")[0]).strip("_")[:40]
    return "block"


def run_block(block: str, tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "readme_block.py"
    script.write_text(block, encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1")
    if not torch.cuda.is_available():
        env.setdefault("TRITON_INTERPRET", "1")
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=BLOCK_TIMEOUT_S)


def _load_server_helpers():
    """tests/server/conftest.py's ServerProcess, loaded under its own module name (one way to start a server)."""
    spec = importlib.util.spec_from_file_location("readme_server_helpers", ROOT / "tests" / "server" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def readme_server(stories_dir, tmp_path_factory):
    """`detinfer serve` on stories260k plus a ChatML template, named as the README's client block asks."""
    from detinfer.models.testing import CHATML_TEMPLATE

    model = tmp_path_factory.mktemp("readme-model") / "stories260k-chat"
    shutil.copytree(stories_dir, model)
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["chat_template"] = CHATML_TEMPLATE
    cfg_path.write_text(json.dumps(cfg), encoding="utf-8")
    helpers = _load_server_helpers()
    server = helpers.ServerProcess(model, tmp_path_factory.mktemp("readme-server-logs"),
                                   "--served-model-name", README_SERVED_NAME).start()
    yield server
    server.stop(timeout=30.0)


def test_readme_has_the_blocks_this_module_runs():
    assert len(PYTHON_BLOCKS) >= 4 and any(_needs_server(b) for b in PYTHON_BLOCKS)
    assert any("detinfer repro" in b for b in BASH_BLOCKS)


@pytest.mark.slow
@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[_block_id(b) for b in PYTHON_BLOCKS])
def test_python_block_runs_as_written(block, stories_dir, request, tmp_path):
    url = request.getfixturevalue("readme_server").url if _needs_server(block) else None
    result = run_block(apply_substitutions(block, substitutions(stories_dir, url)), tmp_path)
    assert result.returncode == 0, f"README block failed:\n{block}\n--- stderr ---\n{result.stderr[-4000:]}"
    assert result.stdout.strip() or "print(" not in block, "the block prints nothing"


# --- bash blocks -------------------------------------------------------------------------------------


def shell_commands(block: str) -> list[list[str]]:
    """Every simple command of the block's lines that mention detinfer or pip (continuations joined)."""
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        if "detinfer" not in line and "pip " not in line:
            continue  # e.g. curl's multi-line JSON body
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        current: list[str] = []
        for token in [*lexer, ";"]:
            if token in ("&&", "||", ";", "|", "&"):
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(token)
    return commands


DETINFER_COMMANDS = [c for b in BASH_BLOCKS for c in shell_commands(b) if c[0] == "detinfer"]
PIP_COMMANDS = [c for b in BASH_BLOCKS for c in shell_commands(b) if c[:2] == ["pip", "install"]]


def test_shell_command_splitting():
    assert shell_commands('pip install -e ".[x]" && detinfer pull m  # note\ndetinfer serve d \\\n  --port 1') == [
        ["pip", "install", "-e", ".[x]"], ["detinfer", "pull", "m"], ["detinfer", "serve", "d", "--port", "1"]]


@pytest.mark.parametrize("argv", DETINFER_COMMANDS, ids=[" ".join(c[:2]) for c in DETINFER_COMMANDS])
def test_bash_block_detinfer_command_parses(argv):
    """The subcommand exists and its own parser accepts every flag and value (nothing runs)."""
    from detinfer.cli import _COMMANDS

    assert len(argv) >= 2 and argv[1] in _COMMANDS, f"unknown subcommand in {shlex.join(argv)}"
    parser = importlib.import_module(_COMMANDS[argv[1]][0]).build_parser()
    try:
        ns = parser.parse_args(argv[2:])
    except SystemExit as e:
        pytest.fail(f"`{shlex.join(argv)}` does not parse (exit {e.code})")
    except Exception as e:  # detinfer serve's parser raises its own error type
        pytest.fail(f"`{shlex.join(argv)}` does not parse: {e}")
    if argv[1] == "pull":
        from detinfer.models.pull import REGISTRY

        assert ns.name in REGISTRY, f"detinfer pull: unknown model {ns.name!r}"


def test_detinfer_commands_found():
    assert {c[1] for c in DETINFER_COMMANDS} >= {"pull", "repro", "serve"}


@pytest.mark.parametrize("argv", PIP_COMMANDS, ids=[" ".join(c[2:]) for c in PIP_COMMANDS])
def test_bash_block_pip_extras_exist(argv):
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    for arg in argv[2:]:
        m = re.fullmatch(r"\.\[([\w,-]+)\]", arg)
        if m:
            for extra in m.group(1).split(","):
                assert extra in extras, f"pip install {arg}: pyproject.toml has no extra {extra!r}"
