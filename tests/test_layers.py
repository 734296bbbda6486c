"""The layer rules of docs/ARCHITECTURE.md, checked on the source itself.

Every module's imports are parsed (``ast``, so imports inside functions
count too):

- ``chip`` and ``interconnect`` are pure: no ray, no ``pod``, not each other;
- ``pod.config``, ``pod.state``, ``pod.report``, ``pod.programs`` and
  ``pod.workloads`` never import ``pod.runtime`` or ``pod.commands``;
- timing-only mode (``pod.runtime.timing``) never imports ray, not even
  through the modules it imports;
- only ``pod.runtime`` imports ray;
- no import cycles between the modules of the repository;
- no function in ``pod/`` longer than ``MAX_FUNCTION_LINES``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("chip", "interconnect", "pod")
#: "about 80 lines" (a screen or two); docstrings count
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """Every module name an ``import`` or ``from ... import`` statement names."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            # "from pod.workloads import files" imports the module pod.workloads.files
            names.update(f"{node.module}.{alias.name}" for alias in node.names
                         if f"{node.module}.{alias.name}" in MODULES)
    return names


IMPORTS = {name: _imports(path) for name, path in MODULES.items()}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_the_modules_are_found():
    assert "pod.runtime.pod" in MODULES and "chip.mxu" in MODULES
    assert "ray" in IMPORTS["pod.runtime.pod"]


@pytest.mark.parametrize("package", ["chip", "interconnect"])
def test_chip_and_interconnect_are_pure(package):
    other = "interconnect" if package == "chip" else "chip"
    bad = {name: sorted(i for i in imports if _under(i, "ray") or _under(i, "pod")
                        or _under(i, other))
           for name, imports in IMPORTS.items() if _under(name, package)}
    assert not {k: v for k, v in bad.items() if v}


@pytest.mark.parametrize("layer", ["pod.config", "pod.state", "pod.report", "pod.programs",
                                   "pod.workloads"])
def test_lower_layers_never_import_runtime_or_commands(layer):
    bad = {name: sorted(i for i in imports if _under(i, "pod.runtime") or _under(i, "pod.commands")
                        or _under(i, "pod.cli"))
           for name, imports in IMPORTS.items() if _under(name, layer)}
    assert not {k: v for k, v in bad.items() if v}


def test_only_runtime_imports_ray():
    bad = sorted(name for name, imports in IMPORTS.items()
                 if any(_under(i, "ray") for i in imports) and not _under(name, "pod.runtime"))
    assert bad == []


def test_no_import_cycles():
    graph = {name: {i for i in imports if i in MODULES and i != name}
             for name, imports in IMPORTS.items()}
    # a package's __init__ re-exporting its own modules is not a cycle of the code
    for name in graph:
        graph[name] = {i for i in graph[name] if not _under(i, name)}
    cycles = []
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert cycles == []


def test_no_long_functions_in_pod():
    long = []
    for name, path in MODULES.items():
        if not _under(name, "pod"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def test_the_checker_sees_a_violation(tmp_path):
    """The rules can fail: a module importing ray and runtime is flagged."""
    bad = tmp_path / "bad.py"
    bad.write_text("import ray\nfrom pod.runtime.coordinator import Pod\n"
                   "def f():\n    from pod.commands import train\n")
    names = _imports(bad)
    assert "ray" in names and "pod.runtime.coordinator" in names and "pod.commands" in names


def _reachable(start: str) -> set[str]:
    """Every repository module ``start`` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for imported in IMPORTS.get(name, ()):
            for module in MODULES:
                if _under(imported, module) or module == imported:
                    todo.append(module)
    return seen


def test_timing_only_mode_never_imports_ray():
    """The timing pod and everything it reaches import no ray (a sweep of thousands of
    points then costs no Ray import); the Ray pod, by contrast, does (the check can fail)."""
    assert not {m for m in _reachable("pod.runtime.timing") if "ray" in IMPORTS[m]}
    assert "pod.runtime.pod" in _reachable("pod.runtime.pod")
    assert any("ray" in IMPORTS[m] for m in _reachable("pod.runtime.pod"))
