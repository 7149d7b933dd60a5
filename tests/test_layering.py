"""The road in the imports: each subpackage imports only itself and the layers before it, every
import statement counted (function-level ones too), so no two subpackages form a cycle. And
the road from a module to a plan is walked by one function: only `passes/lower.py` runs the
passes."""

from __future__ import annotations

import ast
from pathlib import Path

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
    ("cli",),  # the stof-cc command
)
LEVEL = {name: index for index, names in enumerate(LAYERS) for name in names}


def _imports() -> list[tuple[str, str, str, int]]:
    """(importing unit, imported unit, file, line) for every stof_cc import between units."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        unit = relative.parts[0] if len(relative.parts) > 1 else relative.stem
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names] * (node.module == "stof_cc")
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            else:
                continue
            for module in modules:
                parts = module.split(".")
                if parts[0] == "stof_cc" and len(parts) > 1 and parts[1] != unit:
                    found.append((unit, parts[1], str(relative), node.lineno))
    return found


def test_every_unit_has_a_layer():
    units = {p.parts[0] if len(p.parts) > 1 else p.stem for p in (f.relative_to(PACKAGE) for f in PACKAGE.rglob("*.py"))}
    assert units - {"__init__", "__main__"} <= set(LEVEL), f"put these in LAYERS: {units - set(LEVEL)}"


def test_imports_follow_the_road():
    backwards = [f"{file}:{line}: {unit} ({LEVEL[unit]}) imports {target} ({LEVEL.get(target)})"
                 for unit, target, file, line in _imports()
                 if unit in LEVEL and (target not in LEVEL or LEVEL[target] >= LEVEL[unit])]
    assert not backwards, "imports against the road:\n" + "\n".join(backwards)


def test_only_lower_runs_the_passes():
    callers = sorted({str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                      for node in ast.walk(ast.parse(path.read_text()))
                      if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None))
                      == "run_passes"})
    assert callers == ["passes/lower.py"]
