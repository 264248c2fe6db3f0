"""A plan across a process: it travels as its spec (graph, provided names, outputs, cache), pickled
once with cloudpickle and compiled again on the other side (`build_plan`), never as generated code.
Nodes defined at module level travel by reference, like plain functions (the worker imports the
user's module, made the parent's first: `_same_modules`); the others (a script's, a notebook's,
`python -`'s) by value; `ship_modules=` sends a module by value. A node that cannot travel is an
error naming it, before anything is sent.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Callable
from importlib.machinery import SourceFileLoader
from typing import Any

import cloudpickle

from ..errors import PicklingError, UnhashableError
from ..hashing import Reach, is_user_module, module_stamp, recording
from ..plan import Plan, Wrap
from .pickling import ByValuePickler


def ship_plan(plan: Plan) -> bytes:
    try:
        file = io.BytesIO()
        spec = (_Modules(_stamps(plan)), plan.graph, plan.provided, plan.outputs, plan.cache, plan.keyed)
        ByValuePickler(file, protocol=5).dump(spec)
        return file.getvalue()
    except Exception as exc:
        raise PicklingError(_unpicklable_node(plan, exc)) from exc


def build_plan(spec: bytes, wrap: Wrap | None = None,
               on_cached: Callable[[str, bytes, int | None], None] | None = None) -> Plan:
    _, graph, provided, outputs, cache, keyed = cloudpickle.loads(spec)
    return Plan(graph, provided, outputs, "sequential", wrap=wrap, cache=cache, keyed=keyed, on_cached=on_cached)


def _stamps(plan: Plan) -> dict[str, dict[str, bytes]]:
    """The stamps (`module_stamp`) of what the plan's nodes reach in user modules, as the parent
    has them now. Modules loaded by another loader than Python's own (pytest's assertion
    rewriting changes their bytecode) cannot be compared with the worker's import and are left out."""
    reach = Reach()
    previous = recording(reach)
    try:
        for step in plan.steps:
            try:
                step.node.fingerprint()
            except UnhashableError:
                pass
    finally:
        recording(previous)
    by_value = cloudpickle.list_registry_pickle_by_value()  # `ship_modules`: their code travels with the plan
    modules = {id(vars(m)): m for m in map(sys.modules.get, sorted(reach.modules))
               if m is not None and is_user_module(m.__name__) and m.__name__.split(".")[0] not in by_value
               and m.__name__ not in by_value and isinstance(getattr(m, "__loader__", None), SourceFileLoader)}
    names: dict[str, set[str]] = {}
    for namespace, name, _ in reach.reads:
        if id(namespace) in modules:
            names.setdefault(modules[id(namespace)].__name__, set()).add(name)
    return {m: module_stamp(sys.modules[m], sorted(n)) for m, n in names.items()}


class _Modules:
    """First in a plan's spec: unpickled before the nodes, in the worker, it makes the user
    modules there the parent's (`_same_modules`), so that nodes travelling by reference find
    the code the parent runs."""

    def __init__(self, stamps: dict[str, dict[str, bytes]]):
        self.stamps = stamps

    def __reduce__(self) -> tuple[Any, ...]:
        return (_same_modules, (self.stamps,))


def _same_modules(stamps: dict[str, dict[str, bytes]]) -> None:
    """A module the parent reloaded (or a notebook changed) since this worker imported it is
    reloaded here; one that still differs (its file edited since the parent loaded it) is an
    error naming it, never other code run in its place."""
    import importlib
    for name, stamp in stamps.items():
        module = sys.modules.get(name) or importlib.import_module(name)
        if module_stamp(module, stamp) == stamp:
            continue
        module = importlib.reload(module)
        mine = module_stamp(module, stamp)
        if mine != stamp:
            what = sorted(n for n in {*stamp, *mine} if stamp.get(n) != mine.get(n))
            raise ImportError(f"module {name!r} differs between the parent and this worker ({', '.join(what[:5])}): "
                              "its file was edited since the parent loaded it, or the parent changed it in memory; "
                              f"importlib.reload({name}) in the parent (or restore the file) and map again")


def _unpicklable_node(plan: Plan, exc: Exception) -> str:
    for step in plan.steps:
        try:
            cloudpickle.dumps(step.node)
        except Exception as node_exc:
            return (f"node {step.node.name!r} cannot be sent to a worker process: {node_exc}. Define it "
                    "at module level or in an importable module, and keep unpicklable objects (locks, open "
                    "files, clients) out of its closure: build them inside the node or with @stateful.")
    return f"the pipeline cannot be sent to a worker process: {exc}"
