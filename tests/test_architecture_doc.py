"""docs/architecture.md names only what exists, and its module map lists every module once.

A renamed or removed module or function would otherwise leave the newcomer's map pointing at nothing:
* every backticked `path/to/module.py` is a file under src/detinfer (or of the repository, e.g. tests/);
* every module under src/detinfer (except __init__ / __main__) is in the module map's first column once;
* every backticked code name (`name`, `Class.method`, `function()`, `module.name`) is defined somewhere under
  src/detinfer (a def, a class, or an assigned attribute or field; an attribute of a class in the files of that
  class or its bases).
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "detinfer"
DOC = ROOT / "docs" / "architecture.md"

# Backticked words in the doc that are not code names (strings, shell words, torch's own names).
NOT_CODE = {"spawn", "torch.library", "add_reader"}  # a start method, torch's and asyncio's names


def doc_text() -> str:
    return DOC.read_text(encoding="utf-8")


def backticked(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def modules() -> set[str]:
    return {p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")}


def module_map_rows(text: str) -> list[str]:
    """The first cell of every row of the module map's table."""
    section = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [row.split(" | ", 1)[0] for row in rows]


def files_of_cell(cell: str) -> list[str]:
    """A cell's files; a bare name is in the folder of the file before it in the same cell."""
    files, folder = [], ""
    for name in re.findall(r"`([^`]+\.py)`", cell):
        if "/" in name:
            folder = name.rsplit("/", 1)[0] + "/"
            files.append(name)
        else:
            files.append(folder + name)
    return files


def test_module_map_lists_every_module_once():
    listed = [f for cell in module_map_rows(doc_text()) for f in files_of_cell(cell)]
    duplicates = sorted({f for f in listed if listed.count(f) > 1})
    assert not duplicates, f"listed more than once in the module map: {duplicates}"
    missing = sorted(modules() - set(listed))
    assert not missing, f"modules missing from docs/architecture.md's module map: {missing}"
    stale = sorted(set(listed) - modules())
    assert not stale, f"module map names modules that do not exist under src/detinfer: {stale}"


def test_every_backticked_module_path_exists():
    basenames = {m.rsplit("/", 1)[-1] for m in modules()}
    stale = []
    for name in backticked(doc_text()):
        if not re.fullmatch(r"[\w/]+\.py", name):
            continue
        if "/" in name:
            if not ((SRC / name).is_file() or (ROOT / name).is_file()):
                stale.append(name)
        elif name not in basenames:
            stale.append(name)
    assert not stale, f"docs/architecture.md names files that do not exist: {sorted(set(stale))}"


def defined_in(text: str) -> set[str]:
    """The names a source file defines: functions, classes, assigned names, attributes and fields."""
    names = set(re.findall(r"\b(?:def|class)\s+(\w+)", text))
    names.update(re.findall(r"^\s*(\w+)\s*(?::[^=\n]*)?=", text, flags=re.M))  # x = ..., x: T = ...
    names.update(re.findall(r"^\s*(\w+)\s*:\s*[\w.\[\], |\"']+$", text, flags=re.M))  # fields without a default
    names.update(re.findall(r"\bself\.(\w+)\s*(?::[^=\n]*)?=", text))
    return names


@cache
def definitions() -> tuple[frozenset[str], dict[str, set[str]]]:
    """(every name defined under src/detinfer, module and package names included;
    class name -> the names defined in the files that define it or one of its base classes)."""
    names: set[str] = {"detinfer"}
    own: dict[str, set[str]] = {}
    bases: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        names.add(path.stem)
        names.update(path.relative_to(SRC).parts[:-1])
        text = path.read_text(encoding="utf-8")
        here = defined_in(text)
        names.update(here)
        for cls, base_list in re.findall(r"^\s*class\s+(\w+)\s*(?:\(([^)]*)\))?", text, flags=re.M):
            own.setdefault(cls, set()).update(here)
            bases.setdefault(cls, set()).update(re.findall(r"\w+", base_list))

    def members(cls: str, seen: frozenset[str] = frozenset()) -> set[str]:
        out = set(own[cls])
        for base in bases[cls] - seen - {cls}:
            if base in own:
                out |= members(base, seen | {cls})
        return out

    return frozenset(names), {cls: members(cls) for cls in own}


def undefined(name: str) -> bool:
    """A part of a dotted name is defined nowhere, or an attribute of a class is not defined beside it."""
    defined, members = definitions()
    parts = name.split(".")
    if any(part not in defined for part in parts):
        return True
    return any(parts[i] in members and parts[i + 1] not in members[parts[i]] for i in range(len(parts) - 1))


def code_names(text: str) -> list[str]:
    """Backticked names that read as code: identifiers, dotted names and calls (arguments dropped)."""
    out = []
    for item in backticked(text):
        name = re.sub(r"\(.*\)$", "", item.strip())
        if name in NOT_CODE or name.endswith(".py") or name.isupper():
            continue  # files are checked above; ALL_CAPS names are environment variables and constants
        if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", name):
            continue
        out.append(name)
    return out


def test_every_backticked_code_name_is_defined():
    stale = sorted({name for name in code_names(doc_text()) if undefined(name)})
    assert not stale, f"docs/architecture.md names code that does not exist under src/detinfer: {stale}"


def test_the_checks_catch_stale_names():
    """The checks above fail on names the request path no longer has."""
    for gone in ("CoreLoop", "LLMEngine._run", "to_device()", "_stop_strings", "Sequence.stops_on_token"):
        names = code_names(f"`{gone}`")
        assert names and all(undefined(n) for n in names), gone
    assert not undefined("LLMEngine.step") and not undefined("engine.testing.CoreStepGate")
    assert not undefined("CoreAsyncEngine.add_requests")  # inherited from AsyncEngine
    assert files_of_cell("`engine/core.py`, `core_loop.py`") == ["engine/core.py", "engine/core_loop.py"]
    assert "engine/core_loop.py" not in modules()
