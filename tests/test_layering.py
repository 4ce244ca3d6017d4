"""The package layering, checked on the source: every import in src/detinfer, wherever it is (module level,
inside a function, under `if TYPE_CHECKING:`), must point down the layer order below or within its own
package, and no two packages or modules may import each other, directly or through others.

What counts as an import:
- every `import` / `from ... import` statement, relative ones resolved. Function-level imports count:
  deferring an import hides a dependency from import time, not from the design (the module still needs the
  other one to work, and a cycle is still a cycle). TYPE_CHECKING-only imports count too: a type named in a
  signature is a dependency of that signature.
- `importlib.import_module("detinfer.x")` with a literal name (or an f-string's literal prefix,
  `f"detinfer.kernels.{name}"` -> the kernels package). A name computed from a variable (the packages'
  lazy re-export tables, the CLI's command table) is not followed; those tables name their own package's
  modules (re-exports) or sit at the top (the command table).
- `from detinfer import NAME`, and `detinfer.NAME` after a bare `import detinfer`: resolved to where NAME
  lives: a module, a lazily re-exported name's own module (read from the facade's TYPE_CHECKING block), or
  the facade's own constants (`__version__`), which import nothing and are allowed everywhere.

The layer order, bottom first (a module may import its own package and the packages of lower layers only;
packages of one layer are independent of each other):
- the shared names and numbers (constants.py: imports nothing)
- leaf utilities: dtype names, the CLI parser helpers, the HTML shell, the admission check of a request's
  token ids and prompt length (shared by engine, train and server)
- kernels: Triton kernels and their pure-torch references (every formula lives here, RoPE and SiLU included)
- cache (step layout, paged KV pools) and ops (the numerics backend choosing kernel or reference)
- models: the one Transformer, configs, families, loading, the weight-sharding rule
- distributed: process groups, collectives, the tensor-parallel layers (a sharded Transformer)
- engine (scheduler, model runner, CUDA graphs, tensor-parallel runner and workers, the LLM API) and train
  (the differentiable forward over the engine's model)
- the applications: server, repro, rl, demo
- the command table (cli) and the `detinfer` facade (its lazy re-exports)
- `python -m detinfer` (__main__)
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "detinfer"

LAYERS: list[tuple[str, ...]] = [
    ("constants",),
    ("dtypes", "cli_util", "report_html", "admission"),
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

Edge = tuple[str, int, str]  # (importing module, line, imported module)


def module_files(src: Path = SRC) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package's name for its __init__)."""
    out = {}
    for path in sorted((src / ROOT).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
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


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _resolve(base: str, name: str) -> str | None:
    """`from base import name` -> the module it loads (None: a constant of the facade itself)."""
    if f"{base}.{name}" in MODULES:
        return f"{base}.{name}"
    if base == ROOT:
        return FACADE.get(name)  # a re-export's own module; None for __version__ (it imports nothing)
    return base


def _facade_attributes(tree: ast.AST) -> list[str]:
    """After a bare `import detinfer`: the `detinfer.NAME` attributes the module reads."""
    return sorted({node.attr for node in ast.walk(tree)
                   if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == ROOT})


def _import_module_name(node: ast.Call) -> str | None:
    """The literal module name of an `importlib.import_module(...)` call (an f-string's literal prefix)."""
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if called != "import_module" or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return str(arg.values[0].value).rstrip(".")
    return None


def import_targets(module: str, node: ast.AST, tree: ast.AST, is_package: bool = False) -> list[str]:
    """The detinfer modules one node of `module` (syntax tree `tree`) imports."""
    if isinstance(node, ast.Import):
        names = []
        for alias in node.names:
            if alias.name == ROOT and alias.asname is None:
                names += [t for t in (_resolve(ROOT, a) for a in _facade_attributes(tree)) if t]
            else:
                names.append(alias.name)
    elif isinstance(node, ast.ImportFrom):
        base = _absolute(module, is_package, node)
        names = [t for t in (_resolve(base, alias.name) for alias in node.names) if t]
    elif isinstance(node, ast.Call) and _import_module_name(node):
        names = [_import_module_name(node)]
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


def edges_of(module: str, source: str, is_package: bool = False) -> list[Edge]:
    tree = ast.parse(source)
    return [(module, node.lineno, target) for node in ast.walk(tree)
            for target in import_targets(module, node, tree, is_package)]


def all_edges() -> list[Edge]:
    return sorted(e for module, path in MODULES.items()
                  for e in edges_of(module, path.read_text(), path.name == "__init__.py"))


EDGES = all_edges()


def _where(module: str, line: int, target: str) -> str:
    path = MODULES.get(module)
    name = path.relative_to(SRC.parent) if path else module
    return f"{name}:{line} -> {target}"


def layering_violations(edges: list[Edge]) -> list[str]:
    """One line per import of a package in the importer's own layer or above: `file:line -> target [why]`."""
    bad = []
    for module, line, target in edges:
        src, dst = unit_of(module), unit_of(target)
        if src != dst and LAYER_OF[dst] >= LAYER_OF[src]:
            how = "up" if LAYER_OF[dst] > LAYER_OF[src] else "sideways (same layer)"
            bad.append(f"{_where(module, line, target)}  [{src} imports {dst}: {how}]")
    return bad


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in sorted(graph):
        if start in index:
            continue
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        work = [(start, iter(sorted(graph[start])))]
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = [stack.pop()]
                    while component[-1] != node:
                        component.append(stack.pop())
                    on_stack.difference_update(component)
                    if len(component) > 1:
                        out.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def import_cycles(edges: list[Edge], node_of: Callable[[str], str], label: str) -> list[str]:
    """Each cycle of the graph whose nodes are `node_of(module)`, with the imports that make it."""
    graph: dict[str, set[str]] = {}
    for module, _, target in edges:
        a, b = node_of(module), node_of(target)
        graph.setdefault(b, set())
        graph.setdefault(a, set()).update({b} - {a})
    lines = []
    for component in _strongly_connected(graph):
        members = set(component)
        lines.append(f"{label} cycle {' <-> '.join(component)}:")
        lines += [f"  {_where(m, line, t)}" for m, line, t in edges
                  if node_of(m) in members and node_of(t) in members and node_of(m) != node_of(t)]
    return lines


def test_every_unit_has_a_layer():
    units = {unit_of(m) for m in MODULES}
    assert units <= set(LAYER_OF), f"add these to LAYERS in tests/test_layering.py: {sorted(units - set(LAYER_OF))}"


def test_no_import_points_up_or_sideways():
    bad = layering_violations(EDGES)
    assert not bad, "imports against the layering (tests/test_layering.py LAYERS):\n" + "\n".join(bad)


def test_no_cycle_between_subpackages():
    lines = import_cycles(EDGES, unit_of, "subpackage")
    assert not lines, "\n".join(lines)


def test_no_cycle_between_modules():
    # A package's __init__ is a node of its own, so a package re-exporting a module that imports the package
    # back shows up here as a cycle too.
    lines = import_cycles(EDGES, lambda m: m, "module")
    assert not lines, "\n".join(lines)


def test_the_checker_sees_every_kind_of_import():
    """The walk itself: function-level, TYPE_CHECKING, relative, literal import_module and facade imports
    are edges; a facade constant is not."""
    source = '''
import importlib
from typing import TYPE_CHECKING
import detinfer
from detinfer import __version__, LLM
if TYPE_CHECKING:
    from detinfer.engine import config
def f():
    from detinfer.ops.backend import Ops
    from ..models import transformer
    importlib.import_module("detinfer.server.app")
    importlib.import_module(f"detinfer.train.{f}")
    return detinfer.batch_invariant, detinfer.__version__
'''
    targets = {t for _, _, t in edges_of("detinfer.kernels.rmsnorm", source)}
    assert targets == {"detinfer.ops.mode", "detinfer.engine", "detinfer.engine.config", "detinfer.ops.backend",
                       "detinfer.models.transformer", "detinfer.server.app", "detinfer.train"}


def test_the_checker_reports_file_line_and_target():
    edges = [("detinfer.kernels.rope_qk", 7, "detinfer.ops.backend"), ("detinfer.cache", 3, "detinfer.ops"),
             ("detinfer.ops.backend", 9, "detinfer.kernels.rope")]
    assert layering_violations(edges) == [
        "src/detinfer/kernels/rope_qk.py:7 -> detinfer.ops.backend  [kernels imports ops: up]",
        "src/detinfer/cache/__init__.py:3 -> detinfer.ops  [cache imports ops: sideways (same layer)]"]
    cycle = edges + [("detinfer.ops", 1, "detinfer.kernels.rope_qk")]
    assert import_cycles(cycle, unit_of, "subpackage")[0] == "subpackage cycle kernels <-> ops:"
    assert import_cycles(cycle, lambda m: m, "module") == []  # no module-level loop among these modules
    loop = [("detinfer.engine.a", 1, "detinfer.engine.b"), ("detinfer.engine.b", 2, "detinfer.engine.c"),
            ("detinfer.engine.c", 3, "detinfer.engine.a")]
    assert import_cycles(loop, lambda m: m, "module")[0] == \
        "module cycle detinfer.engine.a <-> detinfer.engine.b <-> detinfer.engine.c:"
