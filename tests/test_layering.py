"""hardy's modules form layers that point one way: no import circle, lazy imports included.

Read from the source with `ast` (every `import` and `from ... import` anywhere in a module, inside
functions too), so a circle hidden behind a lazy import fails here as surely as a top-level one.
Imports under `if TYPE_CHECKING:` are left out: they name types for the checker and never run.
"""

from __future__ import annotations

import ast
import graphlib
import re
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
    assert "hardy.api.pipeline" not in graph["hardy.api.visualize"]  # under `if TYPE_CHECKING:` only


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


def test_the_worker_pool_asks_what_a_death_means_in_one_place():
    """What a worker's death means (the record read, whose fault, the item's fate, the message) is
    the crash package's, and `crash/__init__.py` draws the walk from the pool into it: in the pool,
    `workers/deaths.py` alone asks, so no entry goes undrawn and no decision stays behind."""
    deciding = {f"hardy.crash.{m}" for m in ("autopsy", "blame", "verdict", "diagnosis", "sentence", "frames")}
    asking = sorted(m for m, deps in import_graph().items() if m.startswith("hardy.workers") and deps & deciding)
    assert asking == ["hardy.workers.deaths"]


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


# Other libraries' private names hardy relies on, each on purpose: what for, and where it is checked.
FOREIGN_PRIVATE = {
    "_call_s3": "s3fs: a raw S3 call with the bucket's own arguments (cache/objectstore.py)",
    "_is_compiled": "torch.cuda: whether this torch has CUDA, without initialising it",
    "_is_in_bad_fork": "torch.cuda: the fork probe (doctor's matrix pins the versions it holds for)",
    "_C": "torch: the CUDA arch flags this build has (doctor)",
    "_cuda_getArchFlags": "torch._C: as _C",
    "_parameters": "torch.nn.Module: a module's own tensors, hashed for cache keys",
    "_buffers": "torch.nn.Module: as _parameters",
    "_modules": "torch.nn.Module: as _parameters",
    "_non_persistent_buffers_set": "torch.nn.Module: the buffers state_dict() leaves out, for a module's key",
    "_refresh_thread": "rich.live.Live: the thread drawing the progress bar, named hardy's (a fork check skips it)",
    "_version": "torch.Tensor: its in-place version counter, for a tensor's cache key",
    "_indices": "torch: a sparse COO tensor's indices as stored (indices() refuses an uncoalesced one), for its key",
    "_values": "torch: as _indices, its values as stored (duplicates apart, summed in that order)",
    "_dispatcher": "numba: a ufunc's dispatcher, for its cache key",
    "_frozen": "numba: whether a ufunc's loops are fixed, for its cache key",
    "_can_compile": "numba: whether a dispatcher compiles new signatures (else its explicit ones key it)",
    "_backends": "jax: whether a backend was started before a fork",
    "_data": "os.environ: its encoded mapping, compared cheaply to see that nothing changed",
    "_config": "multiprocessing: a daemonic process's flag, lifted so a Dask worker may start hardy's",
    "_dynamic_class_reduce": "cloudpickle: a class pickled by value",
    "_initializing": "importlib: a module spec's mark while the module's top level runs (one that runs a map is "
                     "never imported by a worker: shipping/replica.py)",
    "_abc_registry_clear": "abc.ABCMeta: an ABC's virtual subclasses made a caller's again in a worker (a reload "
                           "took one back: no public way forgets a registration)",
    "_abc_caches_clear": "abc.ABCMeta: as _abc_registry_clear, its isinstance caches",
    "_clear_cache": "functools.singledispatch: told apart from another function with a registry attribute",
    "_extobj_contextvar": "numpy 2: the context variable holding its error state, read at every call to see that "
                          "np.seterr changed nothing (np.geterr costs 0.8 us; numpy 1 takes that path)",
    "_InferenceMode": "torch._C: the guard torch.inference_mode() enters, entered in a worker for its caller (torch "
                      "has no setter for the mode)",
    "_get_deterministic_algorithms": "torch._C: read at every call to see that torch's settings changed nothing "
                                     "(shipping/context.py; the public calls and torch.backends' properties "
                                     "cost 0.1 to 0.3 us each, these 0.03)",
    "_get_deterministic_algorithms_warn_only": "torch._C: as _get_deterministic_algorithms",
    "_len_torch_function_stack": "torch._C: whether the thread's stack of function modes holds anything (a default "
                                 "device), read at every call (0.04 us; torch.get_default_device() costs 3.6)",
    "_get_current_function_mode_stack": "torch.overrides: the thread's function modes, for the default device as it "
                                        "was set (torch.get_default_device() makes a tensor there: CUDA would start)",
    "_get_float32_matmul_precision": "torch._C: as _get_deterministic_algorithms",
    "_get_cudnn_deterministic": "torch._C: as _get_deterministic_algorithms",
    "_get_cudnn_benchmark": "torch._C: as _get_deterministic_algorithms",
    "_get_cudnn_allow_tf32": "torch._C: as _get_deterministic_algorithms",
    "_make_skeleton_class": "cloudpickle: its reduction of a class by value, told from an Enum's, whose arguments "
                            "differ (shipping/reductions.py gives it the slots a `class` statement gives)",
    "_get_cudnn_enabled": "torch._C: as _get_deterministic_algorithms",
    "_get_mkldnn_enabled": "torch._C: as _get_deterministic_algorithms",
    "_c": "torch.jit.RecursiveScriptModule: the compiled module, whose attributes a change token walks "
          "(hashing/torchscript.py; writing its archive at every call would cost milliseconds)",
    "_jit_debug_module_iterators": "torch._C: a compiled module's attributes by name, recursively (torch has no "
                                   "public listing)",
    "_cache": "logging.Logger: its level cache, which every setLevel empties: read to tell cheaply that a log level "
              "may have changed (shipping/context.py)",
    "__cxa_demangle": "libstdc++ through ctypes: C++ symbols in native stacks",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def _class_names(tree: ast.AST) -> set[str]:
    """The private attribute names a module's classes define: methods, names in a class body or its
    `__slots__`, and what its methods assign to `self.`/`cls.`."""
    found: set[str] = set()
    for c in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for s in c.body:
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.add(s.name)
            targets = s.targets if isinstance(s, ast.Assign) else [s.target] if isinstance(s, ast.AnnAssign) else []
            found.update(t.id for t in targets if isinstance(t, ast.Name))
            if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in targets) and s.value is not None:
                found.update(e.value for e in ast.walk(s.value) if isinstance(e, ast.Constant))
    found.update(n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                 and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))
    return {name for name in found if isinstance(name, str) and _private(name)}


def _accesses(tree: ast.AST) -> list[tuple[ast.AST, ast.expr, str, bool]]:
    """Every `(node, x, "_name", sets)` of a private attribute: `x._name` (`sets`: assigned), and
    `getattr`, `hasattr`, `setattr` or `delattr` with the name spelled out."""
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and _private(n.attr):
            found.append((n, n.value, n.attr, isinstance(n.ctx, ast.Store)))
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and len(n.args) >= 2
              and n.func.id in ("getattr", "hasattr", "setattr", "delattr")
              and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str) and _private(n.args[1].value)):
            found.append((n, n.args[0], n.args[1].value, n.func.id == "setattr"))
    return found


def private_reaches(sources: dict[str, str]) -> list[str]:
    """`where: x._name` for each access (read, write or delete, or through `getattr` and kin) of a
    private attribute that the accessing module's classes do not define: one another hardy
    module's classes define (reach it through a public name, or move the logic to its owner), or
    one that no hardy class defines and the module neither sets on objects itself (a mark it puts
    on them) nor is listed in FOREIGN_PRIVATE (another library's). `os._exit` and the like, read
    off a module imported by name, are that module's own public way in."""
    trees = {name: ast.parse(text) for name, text in sources.items()}
    owned = {name: _class_names(tree) for name, tree in trees.items()}
    found = []
    for name, tree in trees.items():
        modules = {a.asname or a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                   for a in n.names if not a.name.startswith("hardy")}
        accesses = _accesses(tree)
        marks = {attr for _, _, attr, sets in accesses if sets}
        for n, x, attr, _ in accesses:
            if attr in owned[name] or (isinstance(x, ast.Name) and x.id in modules):
                continue
            owners = sorted(other for other, names in owned.items() if attr in names)
            if owners or (attr not in marks and attr not in FOREIGN_PRIVATE):
                found.append(f"{name}:{n.lineno}: {ast.unparse(n)}" + (f" (defined in {', '.join(owners)})"
                                                                      if owners else ""))
    return found


def test_the_private_attribute_rule_sees_reaches_and_leaves_owners_alone():
    sources = {
        "plan": "class Plan:\n    __slots__ = ('_steps',)\n    def __init__(self):\n        self._wrap = None\n"
                "    def _run(self):\n        return self._wrap, self._steps\n",
        "batching": "import os\ndef cut(plan):\n    os._exit(0)\n    return plan._wrap, plan._steps, plan._run()\n",
        "marks": "def mark(exc):\n    exc._step = 1\n    return exc._step, exc._unknown, getattr(exc, '_other', 0)\n",
        "probe": "def probe(p):\n    return hasattr(p, '_wrap'), getattr(p, 'public')\n",
    }
    assert private_reaches(sources) == [
        "batching:4: plan._wrap (defined in plan)", "batching:4: plan._steps (defined in plan)",
        "batching:4: plan._run (defined in plan)", "marks:3: exc._unknown", "marks:3: getattr(exc, '_other', 0)",
        "probe:2: hasattr(p, '_wrap') (defined in plan)"]


def test_no_module_reaches_into_another_modules_private_attributes():
    sources = {str(p.relative_to(SRC)): p.read_text() for p in sorted(SRC.rglob("*.py"))}
    assert private_reaches(sources) == []
    used = {attr for text in sources.values() for _, _, attr, _ in _accesses(ast.parse(text))}
    assert sorted(set(FOREIGN_PRIVATE) - used) == []  # each entry still needed


# Bottom to top: each package (or top-level module) may import only those listed before it. The
# architecture page draws the same list; a new package takes its place here or the test fails.
ORDER = [
    "system", "lazy", "collector", "wording", "tracebacks", "buffers", "native", "errors",  # leaves
    "hashing", "model", "cache", "safety", "crash",  # fingerprints, the model, the cache, hazards, crashes
    "plan", "shipping", "observe", "parts",  # compiled plans, what crosses processes, observing, plan parts
    "workers", "engine", "api",  # the runtime, from the worker pool up to what users call
    "doctor", "integrations", "replay_item", "cli", "compat", "hardy", "__main__",  # the outside; python -m hardy
]


def test_packages_import_only_packages_below_them():
    """Collapsed to hardy's packages and top-level modules, every import points down ORDER: a module
    may not reach up into a package that uses it (a module of `parts` importing from `engine`, which
    runs parts, would be one even without a module circle)."""
    def part(module: str) -> str:
        return module.split(".")[1] if "." in module else module

    graph = import_graph()
    unplaced = sorted({part(m) for m in graph} - set(ORDER))
    assert unplaced == [], f"place these in ORDER: {unplaced}"
    upward = sorted(f"{m} imports {d}" for m, deps in graph.items() for d in deps
                    if part(d) != part(m) and part(d) != "hardy" and ORDER.index(part(d)) > ORDER.index(part(m)))
    assert upward == []


def test_no_two_modules_share_a_file_name():
    """A newcomer who reads `items.py` in a traceback should not have to guess which one. The
    HyperNodes shim is exempt: its modules mirror HyperNodes' own, so users change only the import."""
    mirrors = SRC / "hardy" / "compat" / "hypernodes"
    names = [p.name for p in SRC.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")
             and mirrors not in p.parents]
    assert sorted({n for n in names if names.count(n) > 1}) == []


def test_the_architecture_page_names_every_module():
    """docs/architecture.md's table "Where each concept lives" is the map a newcomer starts from: a
    module it does not name (by its path, or by its file name in its package's row) is one they
    cannot find. The HyperNodes shim is one row."""
    page = (SRC.parent / "docs" / "architecture.md").read_text()
    table = page.split("## Where each concept lives", 1)[1].split("\n## ", 1)[0]
    named: set[str] = set()
    for row in table.splitlines():
        cells = row.split("|")
        if len(cells) < 4 or not cells[2].strip().startswith("`"):
            continue
        packages = re.findall(r"`([\w/]+)/`", cells[2])
        for path in re.findall(r"([\w/]+\.(?:py|c))\b", row):
            named.add(path)
            named.update(f"{package}/{path}" for package in packages if "/" not in path)
    hardy = SRC / "hardy"
    modules = [str(p.relative_to(hardy)) for p in sorted(hardy.rglob("*.py"))
               if p.name not in ("__init__.py", "__main__.py") and "compat" not in p.relative_to(hardy).parts]
    assert [m for m in modules if m not in named] == []


# What a first map's critical path would wait for without using it: a script's `from hardy import`
# (before its map starts the fork server), the server's launch, and the server's own imports
# (before it forks a worker). Each is imported by the function that needs it.
HELPERS = ("pathlib", "shutil", "tempfile", "subprocess", "importlib.abc", "importlib.resources")
LATER = ("logging", "pickle", "traceback", "queue")  # needed by a map, once its fork server is on its way
NOT_WAITED_FOR = {
    "from hardy import Pipeline, node": HELPERS + LATER,
    # (the launch itself runs `subprocess`; a fork server's folder, gone, cost it `tempfile` and `shutil`)
    "from hardy import Pipeline, node; import hardy.workers.launch": tuple(h for h in HELPERS if h != "subprocess")
    + LATER,
    "import hardy.workers.server, hardy.workers.worker": HELPERS,
}


def test_a_first_map_waits_for_no_module_it_does_not_use():
    import subprocess
    import sys
    for imports, names in NOT_WAITED_FOR.items():
        # -S: site's .pth files may import these themselves (this machine's does); the test's
        # sys.path stands in for what site would add
        code = (f"import sys; sys.path[:0] = {[str(SRC), *(p for p in sys.path if p)]!r}; {imports}; "
                f"print(' '.join(m for m in {names!r} if m in sys.modules))")
        loaded = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True)
        assert loaded.stdout.split() == [], imports


# What runs a call (the plan compiler, the cache keys and hashing, the executors and the results
# sink, events) loads after a first call has launched its fork server, which boots meanwhile; and
# the hazards' checks of a start method load only for one asked for. (What explains a worker's
# death loads with the pool, not at the first death: a parent short of memory or descriptors as a
# worker dies must still be able to say why.)
MACHINERY = ("hardy.plan.compiled", "hardy.cache.keys", "hardy.hashing", "hardy.engine.results",
             "hardy.engine.in_process", "hardy.observe.watch", "hardy.observe.events", "hardy.parts.batching")
ON_DEMAND = ("hardy.safety.hazards",)
LAUNCH_PROBE = """
import subprocess, sys
from hardy import Pipeline, node
launch = subprocess.Popen

def spy(*args, **kwargs):
    print("at launch:", *[m for m in {machinery!r} if m in sys.modules])
    return launch(*args, **kwargs)

subprocess.Popen = spy

@node(output_name="y")
def f(x):
    return x + 1

p = Pipeline([f])
{call}
print("after:", *[m for m in {on_demand!r} if m in sys.modules])
"""


def test_a_first_call_launches_its_fork_server_before_it_loads_what_runs_the_call():
    import subprocess
    import sys
    for call in ('p.map(inputs={"x": [1, 2, 3]}, map_over="x")', 'p.run(inputs={"x": 1})',
                 'list(p.imap(inputs={"x": [1, 2, 3]}, map_over="x"))'):
        code = LAUNCH_PROBE.format(machinery=MACHINERY, on_demand=ON_DEMAND, call=call)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**__import__("os").environ, "PYTHONPATH": str(SRC)}).stdout
        assert out.splitlines() == ["at launch:", "after:"], (call, out)


COLLECTIONS_PROBE = """
import gc, sys, threading
from hardy import Pipeline, node
import hardy.engine.core as core
counted = []
gc.callbacks.append(lambda phase, info: counted.append(1) if phase == "start" else None)
make = core.Engine._make_process_pool

def made(self):
    before = len(counted)
    pool = make(self)
    print(len(counted) - before, gc.isenabled())
    return pool

core.Engine._make_process_pool = made
if sys.argv[1] == "off":
    gc.disable()
elif sys.argv[1] == "thread":
    threading.Thread(target=threading.Event().wait, daemon=True).start()

@node(output_name="y")
def f(x):
    return x + 1

Pipeline([f]).map(inputs={"x": [1, 2]}, map_over="x")
print(gc.isenabled())
"""


def test_a_first_map_builds_its_pool_with_the_collector_paused():
    """The launch's and the pool's modules are thousands of objects that live as long as the
    process: 17 to 19 collections walked them during a first map's `_make_process_pool`; paused,
    one does as it ends. Only where the process has one thread, and never turned on where the user
    turned it off."""
    import subprocess
    import sys
    said = {}
    for case in ("on", "off", "thread"):
        said[case] = subprocess.run([sys.executable, "-c", COLLECTIONS_PROBE, case], capture_output=True, text=True,
                                    check=True, env={**__import__("os").environ, "PYTHONPATH": str(SRC)}).stdout.split()
    collections, during, after = said["on"]
    assert int(collections) <= 2 and during == "True" and after == "True", said
    assert said["off"] == ["0", "False", "False"], said
    assert int(said["thread"][0]) > 5 and said["thread"][1:] == ["True", "True"], said


def test_a_ctrl_c_as_the_collector_is_paused_leaves_it_on(monkeypatch):
    """A signal's handler runs between any two bytecodes: a Ctrl-C that lands just after the pause
    switched the collector off (here, `gc.disable` raising it once it has) must still find the
    clean-up that switches it on again. Before, it landed outside it, and the process ran on with
    the collector off for good (a caught `MapInterrupted`, a REPL)."""
    import gc

    from hardy.collector import paused
    off = gc.disable

    def disable_then_interrupted() -> None:
        off()
        raise KeyboardInterrupt

    monkeypatch.setattr(gc, "disable", disable_then_interrupted)
    assert gc.isenabled()
    try:
        with paused():
            pass
    except KeyboardInterrupt:
        pass
    finally:
        enabled = gc.isenabled()
        gc.enable()
    assert enabled
