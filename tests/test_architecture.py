"""The layering of docs/architecture.md, checked on the code: every import statement of
pdefit/ and systems/ is parsed (nothing is imported), and

- no module imports a layer above its own,
- only pdefit/app/ imports Hydra or OmegaConf,
- no two modules import each other, directly or round a circle,
- no function is longer than a screen and no module longer than the agreed size.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Layer of each top-level part of pdefit (systems/ is pdefit.systems); a module may import its
# own layer's package and any lower layer. Packages of the ground floor import nothing of each
# other, except runtime, which reads the options.
LAYERS = {
    "options": 0, "numerics": 0, "data": 0, "runtime": 0, "adjoint": 0,
    "model": 1, "parallel": 1,
    "systems": 2,
    "fitting": 3,
    "analysis": 4,
    "app": 5,
    "api": 6,
    "": 7,  # pdefit/__init__.py: the public names
}
SIDEWAYS = {"runtime": {"options"}}  # the one import between packages of one floor
# What the physics may import: the discretization, the model contract and the public names.
# A system's optional evaluate_fit hook judges a finished fit against the dataset's truths,
# so the sphere's (sphere_eval) also reads data and gathers device arrays.
SYSTEM_IMPORTS = {"numerics", "model", ""}
SYSTEM_HOOK_IMPORTS = {"pdefit.systems.sphere_eval": {"data", "parallel"}}
CONFIG_LIBRARIES = ("hydra", "omegaconf")
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 520


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "systems":  # installed as pdefit.systems
        parts.insert(0, "pdefit")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> list[Path]:
    return sorted([*ROOT.glob("pdefit/**/*.py"), *ROOT.glob("systems/*.py")])


MODULES = {module_name(p): p for p in sources()}


def imported(path: Path) -> Iterator[str]:
    """Every module named by an import in ``path`` (``from a import b`` names ``a.b`` when
    that is a module, else ``a``), relative imports resolved."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            modules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
            yield from modules or [base]


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def owner(module: str) -> str:
    """The module file ``module`` resolves to (a name inside a module → that module)."""
    while module not in MODULES and "." in module:
        module = module.rpartition(".")[0]
    return module


def edges() -> dict[str, set[str]]:
    return {name: {owner(m) for m in imported(path) if m.startswith("pdefit")} - {name}
            for name, path in MODULES.items()}


def test_no_module_imports_a_higher_layer():
    wrong = [f"{name} -> {target}" for name, targets in edges().items() for target in targets
             if layer(target) != layer(name)
             and LAYERS[layer(target)] >= LAYERS[layer(name)]
             and layer(target) not in SIDEWAYS.get(layer(name), set())]
    assert wrong == []


def test_systems_import_numerics_the_model_and_public_names_only():
    wrong = [f"{name} -> {target}" for name, targets in edges().items()
             if layer(name) == "systems" for target in targets
             if layer(target) not in {"systems", *SYSTEM_IMPORTS,
                                      *SYSTEM_HOOK_IMPORTS.get(name, ())}]
    assert wrong == []


def test_only_the_app_layer_imports_hydra_or_omegaconf():
    users = sorted(name for name, path in MODULES.items()
                   if any(m.split(".")[0] in CONFIG_LIBRARIES for m in imported(path)))
    assert users and all(layer(u) == "app" for u in users), users


def test_no_import_cycles():
    graph = edges()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert cycles == []


def test_nothing_but_the_public_face_imports_pdefit_itself():
    """``from pdefit import X`` inside pdefit would load every layer from any one of them."""
    offenders = sorted(name for name, targets in edges().items()
                       if "pdefit" in targets and name != "pdefit"
                       and not name.startswith("pdefit.systems"))
    assert offenders == []


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_functions_fit_on_a_screen_and_modules_stay_readable(path):
    source = path.read_text()
    assert source.count("\n") <= MAX_MODULE_LINES
    long = [f"{node.name}: {node.end_lineno - node.lineno + 1} lines"
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == []
