"""The package's structure holds: layers, no cycles, ``__all__``, no borrowed private names.

Layers of ``nnh_data``, lowest first (``docs/architecture.md`` explains them); a module may
import its own layer or a lower one, never a higher one. ``nnh_train`` sits above all of
``nnh_data``, which never imports it. Imports under ``if TYPE_CHECKING:`` are annotations only
and do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [
    {"errors", "checks", "atomic", "packed", "seeding", "topology", "resplit_guard",
     "command_line"},
    {"columns"},
    {"order"},
    {"augment"},
    {"shards"},
    {"cache"},
    {"workers"},
    {"images"},
    {"precompute"},
    {"streaming"},
    {"loaders"},
    {"audit"},
    {"cli", "__init__"},
]
MAX_LINES = 800


def modules() -> dict[str, Path]:
    found = {}
    for package in ("nnh_data", "nnh_train"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = modules()


def imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, names, line) of every import of the package's own modules, lazy ones included,
    those under ``if TYPE_CHECKING:`` left out."""
    tree = ast.parse(path.read_text())
    guards = [node for node in ast.walk(tree) if isinstance(node, ast.If)
              and getattr(node.test, "id", None) == "TYPE_CHECKING"]  # fmt: skip
    skipped = {id(n) for guard in guards for n in ast.walk(guard)}
    out = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
    return [(m, n, line) for m, n, line in out if m.split(".")[0] in ("nnh_data", "nnh_train")]


def target(module: str, name: str) -> str:
    """The module an import names: ``from nnh_data.x import y`` is ``nnh_data.x.y`` when that
    is a module."""
    full = f"{module}.{name}"
    return full if full in MODULES else module


def layer(module: str) -> int:
    parts = module.split(".")
    if parts[0] == "nnh_train":
        return len(LAYERS)
    key = parts[1] if len(parts) > 1 else "__init__"
    return next(i for i, group in enumerate(LAYERS) if key in group)


def test_every_nnh_data_module_has_a_layer():
    unknown = [m for m in MODULES if m.startswith("nnh_data.") and not
               any(m.split(".")[1] in group for group in LAYERS)]  # fmt: skip
    assert not unknown, f"add these to LAYERS (and docs/architecture.md): {unknown}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down_the_layers(module):
    wrong = []
    for imported, names, line in imports(MODULES[module]):
        for name in names or [""]:
            dest = target(imported, name) if name else imported
            if layer(dest) > layer(module):
                wrong.append(f"line {line}: {dest} (layer {layer(dest)} > {layer(module)})")
    assert not wrong, f"{module} imports a higher layer: {wrong}"


def test_no_import_cycles():
    graph = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        for node in top:  # module-level imports only: those run at import time
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                graph[module] |= {target(node.module, a.name) for a in node.names} & set(MODULES)
    for module, deps in graph.items():  # a package's own __init__ runs first anyway
        graph[module] = {d for d in deps if d != module and not module.startswith(d + ".")}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                pytest.fail("import cycle: " + " -> ".join(trail[trail.index(dep):] + [dep])
                            if dep in trail else f"import cycle through {dep}")  # fmt: skip
            if dep not in state:
                visit(dep, trail + [dep])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_nnh_data_never_imports_nnh_train():
    wrong = [(m, i) for m, p in MODULES.items() if m.startswith("nnh_data")
             for i, _, _ in imports(p) if i.startswith("nnh_train")]  # fmt: skip
    assert not wrong


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_declares_all(module):
    tree = ast.parse(MODULES[module].read_text())
    names = [t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
             if isinstance(t, ast.Name)]  # fmt: skip
    assert "__all__" in names, f"{module} has no __all__"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_another_modules_private_names(module):
    wrong = [(i, n) for i, names, _ in imports(MODULES[module]) for n in names
             if n.startswith("_") and not n.startswith("__")]  # fmt: skip
    assert not wrong, f"{module} imports private names {wrong}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_stay_readable_in_one_sitting(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines: split it along its seams"
