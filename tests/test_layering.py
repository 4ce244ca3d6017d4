"""The package layering, checked on the source: every import statement in src/detinfer, wherever it is
(module level, inside a function, under `if TYPE_CHECKING:`), must point down the layer order below or
within its own package, and no two modules may import each other, directly or through others.

Function-level imports count: deferring an import hides a dependency from import time, not from the
design (the module still needs the other one to work, and a cycle still exists). TYPE_CHECKING-only imports
count too: a type named in a signature is a dependency of that signature.

The layer order (a module may import its own package and the packages of lower layers only; packages of one
layer are independent of each other):
- leaf utilities with no detinfer imports of their own: dtype names, the CLI parser helpers, the HTML shell
- kernels: Triton kernels and their pure-torch references (all numerics: every formula lives here)
- cache (step layout, paged KV pools) and ops (the numerics backend choosing kernel or reference)
- models: the one Transformer, configs, families, loading, weight sharding rules
- distributed: process groups, collectives, tensor-parallel layers (a sharded Transformer)
- engine (scheduler, model runner, TP runner and workers, LLM API) and train (the differentiable forward)
- the applications: server, repro, rl, demo
- the command table (cli) and the `detinfer` facade (its lazy re-exports)
- `python -m detinfer` (__main__)

`from detinfer import NAME` and `detinfer.NAME` after `import detinfer` are resolved to where NAME lives: a
module, a lazily re-exported name's own module (read from the facade's TYPE_CHECKING block), or the facade's
own constants (`__version__`), which import nothing and are allowed everywhere.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "detinfer"

LAYERS: list[tuple[str, ...]] = [
    ("dtypes", "cli_util", "report_html"),
    ("kernels",),
    ("cache", "ops"),
    ("models",),
    ("distributed",),
    ("engine", "train"),
    ("server", "repro", "rl", "demo"),
    ("cli", ROOT),
    ("__main__",),
]
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package's name for its __init__)."""
    out = {}
    for path in sorted((SRC / ROOT).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = module_files()


def unit_of(module: str) -> str:
    """The layering unit a module belongs to: its top-level subpackage or module under detinfer."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT


def facade_reexports() -> dict[str, str]:
    """Names the facade re-exports lazily -> the module they come from (its TYPE_CHECKING imports)."""
    out = {}
    for node in ast.walk(ast.parse(MODULES[ROOT].read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(ROOT + "."):
            out.update({alias.asname or alias.name: node.module for alias in node.names})
    return out


FACADE = facade_reexports()


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if MODULES[module].name != "__init__.py":
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _facade_names(tree: ast.AST) -> list[str]:
    """After a bare `import detinfer`: the `detinfer.NAME` attributes the module reads."""
    return sorted({node.attr for node in ast.walk(tree)
                   if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == ROOT})


def _resolve_facade(base: str, name: str) -> str | None:
    """`from base import name` -> the module it loads (None: a constant of the facade itself)."""
    if f"{base}.{name}" in MODULES:
        return f"{base}.{name}"
    if base == ROOT:
        return FACADE.get(name)  # a re-export's own module; None for __version__ (it imports nothing)
    return base


def import_targets(module: str, node: ast.AST, tree: ast.AST | None = None) -> list[str]:
    """The detinfer modules an import statement in `module` (whose syntax tree is `tree`) loads."""
    if isinstance(node, ast.Import):
        names = []
        for alias in node.names:
            if alias.name == ROOT and alias.asname is None and tree is not None:
                names += [t for t in (_resolve_facade(ROOT, a) for a in _facade_names(tree)) if t]
            else:
                names.append(alias.name)
    elif isinstance(node, ast.ImportFrom):
        base = _absolute(module, node)
        names = [t for t in (_resolve_facade(base, alias.name) for alias in node.names) if t]
    else:
        return []
    out = []
    for name in names:
        if name != ROOT and not name.startswith(ROOT + "."):
            continue
        while name not in MODULES and "." in name:  # `import a.b.c` where c is a name, not a module
            name = name.rsplit(".", 1)[0]
        if name not in out:
            out.append(name)
    return out


def all_imports() -> list[tuple[str, int, str]]:
    """(importing module, line, imported module) for every detinfer import in the package."""
    edges = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            edges.extend((module, node.lineno, target) for target in import_targets(module, node, tree))
    return sorted(edges)


EDGES = all_imports()


def where(module: str, line: int, target: str) -> str:
    return f"{MODULES[module].relative_to(SRC.parent)}:{line} -> {target}"


def test_every_unit_has_a_layer():
    units = {unit_of(m) for m in MODULES}
    assert units <= set(LAYER_OF), f"add these to LAYERS: {sorted(units - set(LAYER_OF))}"


def test_no_import_points_up_or_sideways():
    bad = []
    for module, line, target in EDGES:
        src, dst = unit_of(module), unit_of(target)
        if src != dst and LAYER_OF[dst] >= LAYER_OF[src]:
            how = "up" if LAYER_OF[dst] > LAYER_OF[src] else "sideways (same layer)"
            bad.append(f"{where(module, line, target)}  [{src} imports {dst}: {how}]")
    assert not bad, "imports against the layering (tests/test_layering.py LAYERS):\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def _cycle_report(nodes_of, label) -> list[str]:
    graph: dict[str, set[str]] = {}
    for module, _, target in EDGES:
        a, b = nodes_of(module), nodes_of(target)
        graph.setdefault(a, set())
        graph.setdefault(b, set())
        if a != b:
            graph[a].add(b)
    lines = []
    for component in _cycles(graph):
        members = set(component)
        lines.append(f"{label} cycle {' <-> '.join(component)}:")
        lines += [f"  {where(m, line, t)}" for m, line, t in EDGES
                  if nodes_of(m) in members and nodes_of(t) in members and nodes_of(m) != nodes_of(t)]
    return lines


def test_no_cycle_between_subpackages():
    lines = _cycle_report(unit_of, "subpackage")
    assert not lines, "\n".join(lines)


def test_no_cycle_between_modules():
    # A package's __init__ is its own node: a package whose __init__ re-exports a submodule that imports a
    # sibling through the package name would show up here as a cycle, and rightly so.
    lines = _cycle_report(lambda m: m, "module")
    assert not lines, "\n".join(lines)


def test_the_walk_sees_function_level_and_type_checking_imports():
    """The checker itself: an import inside a function and one under TYPE_CHECKING are both edges."""
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from detinfer.engine import config\n"
              "def f():\n    from detinfer.ops.backend import Ops\n    import detinfer.kernels.rope\n")
    module = "detinfer.kernels.rmsnorm"
    found = [t for node in ast.walk(ast.parse(source)) for t in import_targets(module, node)]
    assert found == ["detinfer.engine.config", "detinfer.ops.backend", "detinfer.kernels.rope"] or \
        sorted(found) == sorted(["detinfer.engine.config", "detinfer.ops.backend", "detinfer.kernels.rope"])
    assert {LAYER_OF[unit_of(t)] > LAYER_OF["kernels"] for t in found[:2]} == {True}
