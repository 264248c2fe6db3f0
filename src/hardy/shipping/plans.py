"""A plan across a process: it travels as its spec (graph, provided names, outputs, cache), pickled
once with cloudpickle and compiled again on the other side (`build_plan`), never as generated code.
Nodes defined at module level travel by reference, like plain functions (the worker imports the
user's module, made the caller's first: `shipping.replica`); the others (a script's, a notebook's,
`python -`'s) by value; `ship_modules=` sends a module by value. A node that cannot travel is an
error naming it, before anything is sent.
"""

from __future__ import annotations

import builtins
import functools
import io
import pickle
import sys
import weakref
import zipimport
from collections.abc import Callable
from importlib.machinery import PathFinder, SourceFileLoader, SourcelessFileLoader
from typing import Any

import cloudpickle

from ..errors import PicklingError, ReplicaError
from ..hashing import Reach, is_user_module
from ..hashing.state import token
from ..hashing.values import ABSENT
from ..model.graph import walk_nodes
from ..plan.compiled import Plan, Wrap
from .payload import unsendable
from .pickling import ByValuePickler
from .replica import (
    Fetch,
    Replica,
    Synced,
    builtins_read,
    is_script,
    kept,
    library_patches,
    module_aliases,
    reached_names,
)


def ship_plan(plan: Plan, everything: bool = False) -> bytes:
    """The plan's spec: its replica's header (`shipping.replica`: the stamps of what it reaches in
    user modules, small objects pickled), then the plan itself. `everything`: every object that
    pickles travels (an engine's worker on another machine cannot ask for one later)."""
    try:
        file = io.BytesIO()
        ByValuePickler(file, protocol=5).dump((plan.graph, plan.provided, plan.outputs, plan.cache, plan.keyed,
                                                plan.given_code))
        return pickle.dumps((kept(plan, lambda: replica_of(plan)).header(everything), file.getvalue()), protocol=5)
    except ReplicaError:  # (says the module and the fix itself)
        raise
    except Exception as exc:
        raise PicklingError(_unpicklable_node(plan, exc)) from exc


def build_plan(spec: bytes, wrap: Wrap | None = None,
               on_cached: Callable[[str, bytes, int | None], None] | None = None,
               fetch: Fetch | None = None) -> Plan:
    """The plan a spec describes, compiled here once this process's user modules hold what the
    caller's do (`synced`)."""
    replica, body = synced(spec, fetch)
    graph, provided, outputs, cache, keyed, given = cloudpickle.loads(body)
    if not replica.home:
        _adopt_main(graph.nodes)
    plan = Plan(graph, provided, outputs, "sequential", wrap=wrap, cache=cache, keyed=keyed, on_cached=on_cached)
    plan.given_code = given  # (a plan an engine's task ships again to hardy's workers covers it too)
    return plan


def _adopt_main(nodes: Any) -> None:
    """Nodes of the caller's `__main__` travel by value, each with the globals it reads; those
    globals become this process's `__main__`'s too. A node that hands a script's helper to a
    process pool of its own (multiprocessing, concurrent.futures) pickles it by name, as
    `__main__.helper`: it is then found, here and in the pool's forked children."""
    main = sys.modules.get("__main__")
    if main is None:
        return
    for node in walk_nodes(nodes):
        func = getattr(node, "func", None)
        namespace = getattr(func, "__globals__", None)
        if namespace is None or getattr(func, "__module__", None) != "__main__" or namespace is vars(main):
            continue
        for name, value in namespace.items():
            if not (name.startswith("__") and name.endswith("__")):
                setattr(main, name, value)


def synced(spec: bytes, fetch: Fetch | None = None) -> tuple[Synced, bytes]:
    """The spec's replica, with this process's user modules made the caller's (`Synced.sync`;
    `fetch(replica id, names)` asks the caller for objects that did not travel with the spec),
    and the rest of the spec."""
    header, body = pickle.loads(spec)
    replica = Synced(header)
    replica.sync(fetch)
    return replica, body


def replica_of(plan: Plan) -> Replica:
    """What `plan`'s nodes reach in user modules, the nodes' own names included, as this process has
    it now. Modules loaded by another loader than Python's own (pytest's assertion rewriting changes
    their bytecode) or sent by value (`ship_modules`: their code travels with the plan) are left out."""
    reach = plan.reached()
    by_value = cloudpickle.list_registry_pickle_by_value()
    names = reached_names(reach.reads, reach.modules)
    for node in walk_nodes(plan.graph.nodes):  # each node's own name, or its function's, where it is found by name
        binding = node.binding() or _binding(getattr(node, "func", None))
        if binding is not None:
            names.setdefault(binding[0], set()).add(binding[1])
    replicated = {m: n for m, n in names.items() if m in sys.modules and _replicable(m, by_value, reach.modules)}
    replicated.update(library_patches(reach.reads))  # (`math.sqrt = my_sqrt`: a worker's library has its own)
    carried = builtins_read(reach.reads)  # (`builtins.THRESHOLD = 0.5`: a worker's builtins lack it)
    if carried:
        replicated["builtins"] = carried
        if plan.watched is not None:
            _watch_builtins(plan.watched, carried)
    replica = Replica(replicated, module_aliases(reach.reads), functools.partial(_reader, weakref.ref(plan)))
    _refuse_unsendable(plan, replica)
    return replica


def _watch_builtins(watched: Reach, names: set[str]) -> None:
    """The names carried in `builtins`, read by the plan's `Reach` too where its fingerprints did
    not note them there (they note a global its module lacks): rebound, or changed in place,
    between two calls, the plan is stale and its replica made again, as for a module's names."""
    namespace = vars(builtins)
    noted = {name for where, name, _ in watched.reads if where is namespace}
    for name in sorted(names - noted):
        value = namespace.get(name, ABSENT)
        watched.reads.append((namespace, name, value))
        if value is not ABSENT and (now := token(value)) is not None:
            watched.watched.append((value, now))


def _replicable(name: str, by_value: Any, reached: set[str]) -> bool:
    """Whether a worker's copy of module `name` is compared with this process's: a user module loaded
    by Python's own loader from source, or made at run time (no file: the worker rebuilds it), and
    the names a module's code reads in `__main__` (`reached`: the modules read as modules), and a
    script a launcher ran (`runpy.run_path`), by the names the plan reads there. Not one
    sent by value (`ship_modules`: its code travels with the plan), nor one loaded by another loader
    (pytest's assertion rewriting changes the bytecode)."""
    module = sys.modules[name]
    if is_script(name):
        return name in reached or name != "__main__"
    if not is_user_module(name) or name.split(".")[0] in by_value or name in by_value:
        return False
    loader = getattr(module, "__loader__", None)  # None: made at run time, or rebuilt here from a caller's objects
    return loader is None or isinstance(loader, _FILE_LOADERS) or not _found_by_path(name)


# Loaders a worker's own import reproduces from sys.path: a source file, a `.pyc` alone, a zip's member
_FILE_LOADERS = (SourceFileLoader, SourcelessFileLoader, zipimport.zipimporter)


def _found_by_path(name: str) -> bool:
    """Whether a worker's import finds module `name` on its sys.path (the caller's, synced) as a
    file, whatever loader the caller used (pytest's assertion rewriting: a worker imports the file).
    A module a custom importer serves (`sys.meta_path`) is not: the worker lacks that importer, so
    the module is rebuilt there from the caller's objects (`replica._module`), or refused
    (`_refuse_unsendable`)."""
    parent = sys.modules.get(name.rpartition(".")[0]) if "." in name else None
    try:
        return PathFinder.find_spec(name, getattr(parent, "__path__", None)) is not None
    except (ImportError, ValueError):
        return False


def _refuse_unsendable(plan: Plan, replica: Replica) -> None:
    """A module a worker cannot import (`_found_by_path`) travels whole, as the caller's objects:
    one of them that does not pickle refuses the plan here, before any item runs, naming the
    module, its loader, a node that reads it and the fix (the worker would fail every item)."""
    for module_name, objects in replica.objects.items():
        loader = getattr(sys.modules.get(module_name), "__loader__", None)
        if loader is None or isinstance(loader, _FILE_LOADERS) or is_script(module_name) \
                or not is_user_module(module_name) or _found_by_path(module_name):
            continue
        for name, value in objects.items():
            why = unsendable(module_name, name, value, bound=replica.bound()) if name else ""
            if why:
                raise ReplicaError(
                    f"module {module_name!r} was loaded by {type(loader).__module__}.{type(loader).__qualname__}, "
                    f"which a worker process lacks, so it travels as this process's objects, and its {name!r} "
                    f"({type(value).__module__}.{type(value).__qualname__}) cannot be sent ({why}); node "
                    f"{_reader(weakref.ref(plan), module_name, name)!r} reads it. Make the module importable "
                    f"from a file on sys.path (a .py, a .pyc or a zip), or run the pipeline in-process "
                    f"(map_executor=\"sequential\").")


def _reader(plan_ref: weakref.ref[Plan], module_name: str, name: str) -> str:
    """The node that reads `name` in `module_name`, for a refusal: the first whose function is
    defined there, or reads the module, one of its objects or (`builtins`) that name; else the first
    node (what it reaches was found through another's code)."""
    import inspect
    plan = plan_ref()
    if plan is None or not plan.steps:
        return "<pipeline>"
    module = sys.modules.get(module_name)
    for step in plan.steps:
        func = getattr(step.node, "func", None)
        if getattr(func, "__module__", None) == module_name:
            return str(step.node.name)
        try:
            reads = inspect.getclosurevars(func) if callable(func) else None
        except (TypeError, ValueError):
            reads = None
        if reads is not None and (name in reads.builtins and module_name == "builtins" or any(
                v is module or getattr(v, "__module__", None) == module_name for v in reads.globals.values())):
            return str(step.node.name)
    return str(plan.steps[0].node.name)


def _binding(func: Any) -> tuple[str, str] | None:
    """(module, top-level name) through which `func` travels by reference (a module's function, or a
    method of a module's class), or None when it travels by value."""
    module_name, qualname = getattr(func, "__module__", None), getattr(func, "__qualname__", None)
    if not isinstance(module_name, str) or not isinstance(qualname, str) or module_name == "__main__":
        return None
    module = sys.modules.get(module_name)
    if module is None or "<locals>" in qualname or not qualname:
        return None
    target: Any = module
    for part in qualname.split("."):
        target = getattr(target, part, None)
    return (module_name, qualname.split(".")[0]) if target is func else None


def _unpicklable_node(plan: Plan, exc: Exception) -> str:
    """The node that cannot travel, pickled one by one as the plan is (`ByValuePickler`), and the fix:
    hardy's own refusal says its fix (a proxy, `reductions.reduce_posing`); any other, the usual one."""
    for step in plan.steps:
        try:
            ByValuePickler(io.BytesIO(), protocol=5).dump(step.node)
        except PicklingError as node_exc:
            return f"node {step.node.name!r} cannot be sent to a worker process: {node_exc}."
        except Exception as node_exc:
            culprit = _unpicklable_read(getattr(step.node, "func", None), set())
            if culprit:
                return (f"node {step.node.name!r} cannot be sent to a worker process: {culprit} cannot be "
                        f"pickled ({node_exc}). Build it inside the node (or with @stateful, once per worker), "
                        "or pass plain data or a path instead.")
            return (f"node {step.node.name!r} cannot be sent to a worker process: {node_exc}. Define it "
                    "at module level or in an importable module, and keep unpicklable objects (locks, open "
                    "files, clients) out of its closure: build them inside the node or with @stateful.")
    return f"the pipeline cannot be sent to a worker process: {exc}"


def _unpicklable_read(func: Any, seen: set[int]) -> str:
    """The global or closed-over variable a script's function reads (itself, or through a function
    it calls) that cannot be pickled, in words (`the global 'MODEL' (RecursiveScriptModule)`); ''
    when none is found, so that the message names what to move out of the node, not only why."""
    import inspect
    import types
    if not isinstance(func, types.FunctionType) or id(func) in seen:
        return ""
    seen.add(id(func))
    try:
        reads = inspect.getclosurevars(func)
    except (TypeError, ValueError):
        return ""
    for kind, values in (("global", reads.globals), ("closed-over variable", reads.nonlocals)):
        for name, value in values.items():
            if isinstance(value, types.ModuleType):
                continue
            try:
                ByValuePickler(io.BytesIO(), protocol=5).dump(value)
            except Exception:
                inner = _unpicklable_read(value, seen)
                return inner or f"the {kind} {name!r} it reads ({type(value).__name__})"
    return ""
