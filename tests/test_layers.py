"""The layers import only downward (ARCHITECTURE.md), at run time too.

Every module of the package is read with ``ast`` - not imported, so an import inside a function,
or a module name handed to ``importlib.import_module`` / ``__import__``, counts like one at the top
of the file - and each import is checked against the layer order

    hardware < kernels < model < generation < runtime < serve < course, cli (and the package root)

A module may import its own layer and those below it. ``exercises/`` (the learner's stubs, which
import the model and the runtime) is as high as the course: only the course may read it. Below the
top, a dynamic import whose target the source does not spell out is refused, since no one could
check it. No module may reach itself through its imports (no import cycle), kernels/ included.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "minillm"
TOP = 7
LAYERS = {  # minillm.<first part> -> its layer
    "hardware": 1, "kernels": 2, "model": 3, "generation": 4, "runtime": 5,
    "llm": 5,  # LLM: the engine for offline use; the server is built on it
    "serve": 6, "course": TOP, "cli": TOP, "__main__": TOP,
}
OUTSIDE = {"exercises": TOP}  # top-level packages of the checkout beside minillm/
DYNAMIC = "<a module name computed at run time>"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def is_module(name: str) -> bool:
    """Whether minillm.a.b names a module or package of the checkout."""
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _literal_prefix(node: ast.expr) -> str | None:
    """The module name a string argument spells: "a.b" -> "a.b"; f"a.{x}" -> "a"; else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        prefix = node.values[0].value.rsplit(".", 1)[0] if "." in node.values[0].value else ""
        return prefix or None
    return None


def _is_dynamic_import(call: ast.Call) -> bool:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    return name in ("import_module", "__import__") and bool(call.args)


def imports_of(source: str, module: str, package: bool) -> list[tuple[int, str]]:
    """(line, imported module) for every import in source, the module called ``module``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, one level up per extra dot
                anchor = module.split(".") if package else module.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module
            # "from a import b" imports module a.b where there is one (a runs first, but that is
            # no cycle of a.b's making), else the name b of module a
            found += [(node.lineno, f"{base}.{alias.name}" if is_module(f"{base}.{alias.name}") else base)
                      for alias in node.names]
        elif isinstance(node, ast.Call) and _is_dynamic_import(node):
            found.append((node.lineno, _literal_prefix(node.args[0]) or DYNAMIC))
    return found


def layer_of(name: str) -> int | None:
    """The layer of an imported (or importing) module; None outside the checkout (numpy, ...)."""
    parts = name.split(".")
    if parts[0] == "minillm":
        if len(parts) == 1:
            return TOP  # the package root: the public face
        if parts[1] not in LAYERS:
            raise AssertionError(f"minillm.{parts[1]} has no layer: add it to LAYERS in {__file__}")
        return LAYERS[parts[1]]
    return OUTSIDE.get(parts[0])


def package_imports() -> dict[str, list[tuple[int, str]]]:
    """Every module of the package -> its imports."""
    return {module_name(path): imports_of(path.read_text(), module_name(path), is_package(path))
            for path in sorted(PACKAGE.rglob("*.py"))}


def violations(imports: dict[str, list[tuple[int, str]]]) -> list[str]:
    bad = []
    for module, found in imports.items():
        own = layer_of(module)
        for line, target in found:
            if target == DYNAMIC:
                if own < TOP:
                    bad.append(f"{module}:{line} imports a module named at run time (layer {own} must spell it out)")
            elif (layer := layer_of(target)) is not None and layer > own:
                bad.append(f"{module}:{line} imports {target} (layer {layer}) from layer {own}")
    return bad


def cycles(imports: dict[str, list[tuple[int, str]]], within: str) -> list[list[str]]:
    """The import cycles among the modules under ``within``: strongly connected components
    (Tarjan) of two or more modules, or of one that imports itself."""
    inside = lambda name: name == within or name.startswith(within + ".")  # noqa: E731
    graph = {m: sorted({t for _, t in found if inside(t) and t in imports and t != m} |
                       ({m} if any(t == m for _, t in found) else set()))
             for m, found in imports.items() if inside(m)}
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                components.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return components


# -----------------------------------------------------------------------------------------------
# the checker finds what it must (a checker that finds nothing would pass everything)


def test_every_kind_of_import_is_found_and_placed():
    source = """
import minillm.runtime.engine
from minillm.course import seats
from ..serve import app
import importlib
def later(chapter):
    from minillm import course
    importlib.import_module("minillm.generation.sampling")
    __import__(f"exercises.{chapter}")
    return importlib.import_module(chapter)
"""
    found = imports_of(source, "minillm.kernels.registry", package=False)
    assert found == [(2, "minillm.runtime.engine"), (3, "minillm.course.seats"), (4, "minillm.serve.app"),
                     (5, "importlib"), (7, "minillm.course"), (8, "minillm.generation.sampling"),
                     (9, "exercises"), (10, DYNAMIC)]
    assert len(violations({"minillm.kernels.registry": found})) == 7  # all but importlib: upward or dynamic
    assert violations({"minillm.course.seats": found}) == []  # the top may import anything, even dynamically
    assert cycles({"minillm.kernels.a": [(1, "minillm.kernels.b")], "minillm.kernels.b": [(2, "minillm.kernels.a")],
                   "minillm.kernels.c": [(3, "minillm.kernels.a")]}, "minillm.kernels") == [
        ["minillm.kernels.a", "minillm.kernels.b"]]


# -----------------------------------------------------------------------------------------------
# the package


def test_every_module_imports_only_its_layer_and_those_below():
    imports = package_imports()
    assert len(imports) > 50 and "minillm.kernels.registry" in imports  # it read the package
    bad = violations(imports)
    assert not bad, "imports up the layers:\n" + "\n".join(bad)


def test_kernels_import_nothing_above_them():
    """ARCHITECTURE.md: kernels/ knows nothing of exercises/, the course, the model or the runtime."""
    above = ("exercises", "minillm.course", "minillm.model", "minillm.runtime", "minillm.generation", "minillm.serve")
    reached = [f"{module}:{line} {target}" for module, found in package_imports().items()
               if module.startswith("minillm.kernels") for line, target in found
               if target == DYNAMIC or target.split(".")[0] == "exercises" or target.startswith(above)]
    assert not reached, "kernels/ reaches up:\n" + "\n".join(reached)


def test_no_import_cycle():
    """No module reaches itself through its imports - in kernels/ (where quant_formats.py once
    closed a cycle of five files) or anywhere else in the package."""
    found = cycles(package_imports(), "minillm")
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)
