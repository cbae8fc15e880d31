"""The pipeline's shape, kept by tests: imports follow the data (spec -> lower -> render -> build ->
artifacts -> runtime), packages form no cycle, and the runtime needs nothing build-side.

Every ``import`` in ``kvgen/`` counts, also the ones inside functions: a lazy import is still a
dependency, only a later one.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from tests.conftest import ROOT

PACKAGE = ROOT / "kvgen"
# The bottom layer: modules every stage may use, which import no other part of kvgen.
BASE_MODULES = {"kvgen", "kvgen.arch", "kvgen.files", "kvgen.paths"}
BUILD_SIDE = ("spec", "lower", "render", "build")
TOOLS = ("measure", "tuning", "bench", "demo", "calibrate")

# unit -> the units it may import (besides itself). "base" is BASE_MODULES.
ALLOWED: dict[str, set[str]] = {
    "base": set(),
    "reference": {"base"},
    "spec": {"base", "reference"},
    "lower": {"base", "reference", "spec"},
    "render": {"base", "lower", "spec"},
    "kernels": {"base"},
    "artifacts": {"base"},
    "build": {"base", "reference", "spec", "lower", "render", "kernels", "artifacts"},
    "runtime": {"base", "reference", "kernels", "artifacts"},
    "measure": {"base", "reference", "kernels", "artifacts", "runtime"},
    "tuning": {"base", "reference", "kernels", "artifacts", "runtime", "measure", *BUILD_SIDE},
    "bench": {"base", "reference", "kernels", "artifacts", "runtime", "measure", *BUILD_SIDE},
    "demo": {"base", "reference", "kernels", "artifacts", "runtime", "measure", *BUILD_SIDE},
    "integrations": {"base", "reference", "kernels", "artifacts", "runtime", "measure", "spec", "lower"},
    "calibrate": {"base", "reference", "spec", "lower"},
    "cli": {"base", "reference", "kernels", "artifacts", "runtime", "measure", "tuning", "bench", "demo",
            "calibrate", *BUILD_SIDE},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def unit_of(module: str) -> str:
    """The pipeline unit a module belongs to (``kvgen.lower.plan`` -> ``lower``)."""
    if module in BASE_MODULES:
        return "base"
    parts = module.split(".")
    if parts[1] in ("cli", "__main__"):
        return "cli"
    return parts[1]


def imported_modules(path: Path) -> set[str]:
    """Every kvgen module ``path`` imports, relative imports resolved, at any nesting depth."""
    module = module_name(path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            # `from kvgen.x import y` may import the submodule kvgen.x.y: count the longer name if it exists.
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if _is_module(candidate) else base)
    return {name for name in found if name == "kvgen" or name.startswith("kvgen.")}


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def unit_graph() -> dict[str, dict[str, list[str]]]:
    """unit -> imported unit -> the 'module -> module' edges behind it."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(PACKAGE.rglob("*.py")):
        source = module_name(path)
        for target in imported_modules(path):
            if unit_of(source) != unit_of(target):
                graph[unit_of(source)][unit_of(target)].append(f"{source} -> {target}")
    return graph


def test_every_module_belongs_to_a_known_unit():
    units = {unit_of(module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert units <= set(ALLOWED), f"modules outside the pipeline's units: {sorted(units - set(ALLOWED))}"


def test_imports_follow_the_pipeline():
    wrong = [edge for unit, targets in unit_graph().items() for target, edges in targets.items()
             if target not in ALLOWED[unit] for edge in edges]
    assert not wrong, "imports against the pipeline direction:\n" + "\n".join(sorted(wrong))


def test_no_cycle_between_units():
    graph = {unit: set(targets) for unit, targets in unit_graph().items()}
    state: dict[str, str] = {}

    def visit(unit: str, trail: list[str]) -> list[str] | None:
        state[unit] = "open"
        for target in sorted(graph.get(unit, ())):
            if state.get(target) == "open":
                return trail + [unit, target]
            if target not in state and (cycle := visit(target, trail + [unit])):
                return cycle
        state[unit] = "done"
        return None

    for unit in sorted(graph):
        if unit not in state:
            cycle = visit(unit, [])
            assert cycle is None, "import cycle between units: " + " -> ".join(cycle)


def test_nothing_imports_the_cli():
    importers = [edge for targets in unit_graph().values() for edge in targets.get("cli", [])]
    assert not importers, importers


# A finder that makes the build side and the build-time libraries unimportable.
BLOCKER = """
import importlib.abc, sys
BLOCKED = {blocked!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(f"blocked for this test: {{name}}")
        return None
sys.meta_path.insert(0, Block())
"""


def test_runtime_imports_with_the_build_side_blocked():
    blocked = [f"kvgen.{unit}" for unit in (*BUILD_SIDE, *TOOLS, "cli")]
    blocked += ["pydantic", "yaml", "jinja2", "optuna", "rich", "cutlass"]
    code = BLOCKER.format(blocked=blocked) + (
        "import importlib, pkgutil, kvgen.runtime\n"
        "names = [m.name for m in pkgutil.walk_packages(kvgen.runtime.__path__, 'kvgen.runtime.')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "print(len(names), 'runtime modules')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "runtime modules" in proc.stdout
