"""hardy's modules form layers that point one way: no import circle, lazy imports included.

Read from the source with `ast` (every `import` and `from ... import` anywhere in a module, inside
functions too), so a circle hidden behind a lazy import fails here as surely as a top-level one.
Imports under `if TYPE_CHECKING:` are left out: they name types for the checker and never run.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, modules: set[str]) -> set[str]:
    """The hardy modules `path` imports; a package's `__init__` counts only when imported itself."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    type_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                 for stmt in block.body for n in ast.walk(stmt)}
    for n in ast.walk(tree):
        if id(n) in type_only:
            continue
        if isinstance(n, ast.Import):
            found.update(a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                anchor = package.rsplit(".", n.level - 1)[0] if n.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)
            found.update(f"{base}.{a.name}" for a in n.names)  # `from . import x` may name a module
    return {m for m in found if m in modules and m != me}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_graph() -> dict[str, set[str]]:
    paths = sorted(SRC.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imported(p, modules) for p in paths}


def test_the_graph_sees_lazy_imports_and_leaves_out_type_only_ones():
    graph = import_graph()
    assert "hardy.cache" in graph["hardy"]  # imported inside hardy.__getattr__ only
    assert "hardy.workers.pool" in graph["hardy.engine.core"]  # imported inside a method
    assert "hardy.pipeline" not in graph["hardy.visualize"]  # under `if TYPE_CHECKING:` only


def test_no_import_cycles_between_hardy_modules():
    graph = import_graph()
    # A package's __init__ re-exports its modules; it is a facade, not a layer, so edges into a
    # package's own __init__ from inside that package are the only ones left out.
    for name, deps in graph.items():
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    try:
        order = list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        raise AssertionError("import cycle: " + " -> ".join(exc.args[1])) from None
    assert len(order) == len(graph)


def test_packages_form_layers_too():
    """Collapsed to hardy's packages and top-level modules (engine, workers, cache, observe, ...),
    the graph still has no circle: a module may not reach up into a package that uses it."""
    def part(module: str) -> str:
        return module.split(".")[1] if "." in module else module

    layers: dict[str, set[str]] = {}
    for name, deps in import_graph().items():  # the package facade `hardy` left out, as above
        layers.setdefault(part(name), set()).update(part(d) for d in deps if part(d) not in (part(name), "hardy"))
    try:
        graphlib.TopologicalSorter(layers).prepare()
    except graphlib.CycleError as exc:
        raise AssertionError("packages in a circle: " + " -> ".join(exc.args[1])) from None


def test_the_pipeline_runtime_never_imports_the_doctor():
    """The doctor (`hardy.doctor`: examine, import matrix, repeat, wheel) is a second product beside the
    pipeline runtime: only the command line may import it, so a pipeline never loads or depends on it."""
    allowed = ("hardy.doctor", "hardy.cli")
    graph = import_graph()
    assert "hardy.doctor" in graph and "hardy.doctor.repeat" in graph["hardy.cli.doctor"]  # the rule sees them
    wrong = {name: sorted(d for d in deps if d.startswith(allowed[0]))
             for name, deps in graph.items() if not name.startswith(allowed)}
    wrong = {name: deps for name, deps in wrong.items() if deps}
    assert not wrong, f"runtime modules import the doctor: {wrong}"


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_functions_are_short_enough_to_read_at_once():
    long = [f"{p.relative_to(SRC)}:{f.lineno} {f.name} ({f.end_lineno - f.lineno + 1} lines)"
            for p in sorted(SRC.rglob("*.py")) for f in _functions(ast.parse(p.read_text()))
            if f.end_lineno - f.lineno + 1 > 60]
    assert long == []


def test_modules_stay_a_size_a_newcomer_can_read():
    """At most 500 lines each. One exception: `errors.py` holds every exception class hardy raises
    (a newcomer looks for an error in one place, `test_errors` checks none lives elsewhere), so it
    grows with them; it still has a ceiling."""
    ceilings = {"errors.py": 600}
    big = [f"{p.relative_to(SRC)} ({n} lines)" for p in sorted(SRC.rglob("*.py"))
           if (n := len(p.read_text().splitlines())) > ceilings.get(str(p.relative_to(SRC / "hardy")), 500)]
    assert big == []


def test_no_module_imports_another_modules_private_names():
    private = [f"{p.relative_to(SRC)} imports {a.name} from {n.module or '.'}"
               for p in sorted(SRC.rglob("*.py")) for n in ast.walk(ast.parse(p.read_text()))
               if isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith("hardy"))
               for a in n.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert private == []
