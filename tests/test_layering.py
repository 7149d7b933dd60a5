"""The road in the imports: each subpackage imports only itself and the layers before it, every
import statement counted (function-level ones too), so no two subpackages form a cycle; no two
modules import each other, directly or around a circle. And the road from a module to a plan is
walked by one function: only `passes/lower.py` runs the passes."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import networkx as nx

import stof_cc

PACKAGE = Path(stof_cc.__file__).parent
LAYERS = (
    ("ir", "masks"),  # the IR and the masks: nothing of stof-cc below them
    ("passes",),  # Graph -> Graph, the partition and `lower`
    ("codegen",),  # what templates share: elementwise chains -> C++
    ("templates",),  # kernel specs, with the hardware constants and pricing they need
    ("backends",),  # compile, load and launch a template point
    ("tune",),  # stage 1 and stage 2 of the search, the database
    ("runtime",),  # stof_cc.attention, stof_cc.compile, the build folder
    ("loading",),  # FILE.py:FACTORY references
    ("hf", "distributed"),  # transformers' registries; context parallelism over torch.distributed, both onto stof_cc.attention
    ("cli",),  # the stof-cc command
)
LEVEL = {name: index for index, names in enumerate(LAYERS) for name in names}


def _module_name(path: Path) -> str:
    """``stof_cc/masks/zoo.py`` -> ``stof_cc.masks.zoo``; a package's ``__init__.py`` is the package."""
    parts = ("stof_cc", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _unit(module: str) -> str | None:
    """The subpackage (or top-level module) ``module`` belongs to; None for stof_cc itself."""
    return module.split(".")[1] if "." in module else None


def _is_type_checking(test: ast.expr) -> bool:
    return getattr(test, "id", getattr(test, "attr", None)) == "TYPE_CHECKING"


def _walk(tree: ast.AST) -> Iterator[tuple[ast.AST, bool]]:
    """Every node of ``tree``, with whether it sits under ``if TYPE_CHECKING:`` (never runs)."""
    stack = [(tree, False)]
    while stack:
        node, typing_only = stack.pop()
        yield node, typing_only
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack += [(child, True) for child in node.body] + [(child, typing_only) for child in node.orelse]
        else:
            stack += [(child, typing_only) for child in ast.iter_child_nodes(node)]


def _imports() -> list[tuple[str, str, str, int, bool]]:
    """(importing module, imported module, file, line, typing only) for every import of a stof_cc
    module, module-level and function-level, absolute and relative. ``from package import name``
    imports the package, and the submodule ``package.name`` where there is one."""
    found = []
    for module, path in MODULES.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node, typing_only in _walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                parts = package.split(".")[:len(package.split(".")) + 1 - node.level] if node.level else []
                source = ".".join(parts + [node.module] * bool(node.module))
                targets = [source] + [f"{source}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            found += [(module, target, str(path.relative_to(PACKAGE)), node.lineno, typing_only)
                      for target in targets if target in MODULES and target != module]
    return sorted(found)


def test_every_unit_has_a_layer():
    units = {_unit(module) for module in MODULES} - {None, "__main__"}
    assert units <= set(LEVEL), f"put these in LAYERS: {units - set(LEVEL)}"


def test_imports_follow_the_road():
    backwards = [f"{file}:{line}: {_unit(module)} ({LEVEL[_unit(module)]}) imports {_unit(target)} "
                 f"({LEVEL.get(_unit(target))})"
                 for module, target, file, line, _ in _imports()
                 if _unit(module) in LEVEL and _unit(target) not in (None, _unit(module))
                 and (_unit(target) not in LEVEL or LEVEL[_unit(target)] >= LEVEL[_unit(module)])]
    assert not backwards, "imports against the road:\n" + "\n".join(backwards)


def test_no_module_imports_itself_around_a_circle():
    """Imports that run (not those under ``if TYPE_CHECKING:``) form no cycle of modules."""
    imports = [record for record in _imports() if not record[4]]
    graph = nx.DiGraph((module, target) for module, target, *_ in imports)
    circles = sorted(sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1)
    report = ["\n".join([", ".join(circle) + ":"] + [
        f"    {file}:{line}: {module} imports {target}" for module, target, file, line, _ in imports
        if module in circle and target in circle]) for circle in circles]
    assert not circles, f"{len(circles)} circle(s) of modules importing each other:\n" + "\n".join(report)


def test_only_lower_runs_the_passes():
    callers = sorted({str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                      for node in ast.walk(ast.parse(path.read_text()))
                      if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None))
                      == "run_passes"})
    assert callers == ["passes/lower.py"]
