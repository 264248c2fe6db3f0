"""What crosses a process (or machine) boundary: a plan's spec, chunks of items, results.

A plan travels as its spec — graph, provided names, outputs, cache — pickled once with cloudpickle
and compiled again on the other side (`build_plan`), never as generated code. Nodes defined at
module level travel by reference, like plain functions (the worker imports the user's module, and
crash stacks keep real file names); `ship_modules=` sends a module by value. Items travel with
pickle (cloudpickle when they hold functions). Anything that cannot travel gets an error naming the
node or the input and the remedy, before anything is sent.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle

from .errors import NodeError, PicklingError
from .plan import Plan, Wrap


def ship_plan(plan: Plan) -> bytes:
    try:
        spec: bytes = cloudpickle.dumps((plan.graph, plan.provided, plan.outputs, plan.cache, plan.keyed), protocol=5)
        return spec
    except Exception as exc:
        raise PicklingError(_unpicklable_node(plan, exc)) from exc


def build_plan(spec: bytes, wrap: Wrap | None = None,
               on_cached: Callable[[str, bytes, int | None], None] | None = None) -> Plan:
    graph, provided, outputs, cache, keyed = cloudpickle.loads(spec)
    return Plan(graph, provided, outputs, "sequential", wrap=wrap, cache=cache, keyed=keyed, on_cached=on_cached)


def dumps(obj: Any, buffer_callback: Callable[[Any], bool] | None = None) -> bytes:
    """pickle where it can; cloudpickle for functions, and for anything that names `__main__`:
    workers never import the user's main script, so its classes and functions travel by value.
    `buffer_callback` is pickle's; it is called with None when a second attempt starts over."""
    try:
        data = pickle.dumps(obj, protocol=5, buffer_callback=buffer_callback)
        if b"__main__" not in data:
            return data
    except Exception:
        pass
    if buffer_callback is not None:
        buffer_callback(None)
    by_value: bytes = cloudpickle.dumps(obj, protocol=5, buffer_callback=buffer_callback)
    return by_value


def globals_in(blob: bytes) -> list[str]:
    """The classes and functions a pickle refers to (module.name), to name what failed to load."""
    import pickletools
    found: list[str] = []
    pushed: list[str | None] = []
    memo: list[str | None] = []
    top: str | None = None  # the object on top of the stack, when it is a string
    try:
        for op, arg, _ in pickletools.genops(blob):
            if op.name == "MEMOIZE":
                memo.append(top)
                continue
            top = None
            if op.name == "GLOBAL":
                found.append(str(arg).replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(pushed) >= 2:
                found.append(f"{pushed[-2]}.{pushed[-1]}")
            elif op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
                top = arg
                pushed.append(top)
            elif op.name in ("BINGET", "LONG_BINGET") and isinstance(arg, int) and arg < len(memo):
                top = memo[arg]
                pushed.append(top)
    except Exception:  # a truncated or foreign pickle: report what was read
        pass
    return [g for g in dict.fromkeys(found) if not g.startswith(("builtins.", "copyreg.", "None"))]


def ship_items(items: Sequence[dict[str, Any]], indices: Sequence[int],
               wrap: Callable[[list[tuple[int, dict[str, Any]]]], Any] = lambda chunk: chunk,
               dump: Callable[[Any], Any] = dumps) -> Any:
    """A chunk of (index, item) pairs, pickled by `dump`; an unpicklable input is named with its item."""
    msg = wrap([(i, items[i]) for i in indices])
    try:
        return dump(msg)
    except Exception as exc:
        for i in indices:
            for name, value in items[i].items():
                try:
                    cloudpickle.dumps(value)
                except Exception as value_exc:
                    raise PicklingError(
                        f"input {name!r} of item {i} ({type(value).__name__}) cannot be sent to a worker "
                        f"process: {value_exc}. Pass data (or a path) instead, construct the object inside a "
                        "node, or wrap its class with @hardy.stateful so each worker builds its own.") from exc
        raise PicklingError(f"items {list(indices)[:5]} cannot be sent to a worker process: {exc}") from exc


def portable(err: NodeError) -> NodeError:
    """The error, with its cause replaced by a description if the cause cannot be pickled, and the
    cause's traceback kept as text in `stack` (a traceback object does not pickle)."""
    cause = err.__cause__
    if cause is not None and not getattr(err, "stack", ""):
        import traceback
        err.stack = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))
    try:
        pickle.dumps(err)
        return err
    except Exception:
        err.__cause__ = RemoteError(f"{type(cause).__name__}: {cause}") if cause else None
        return err


class RemoteError(Exception):
    """Stands for an exception that could not be pickled back to the caller."""


def _unpicklable_node(plan: Plan, exc: Exception) -> str:
    for step in plan.steps:
        try:
            cloudpickle.dumps(step.node)
        except Exception as node_exc:
            return (f"node {step.node.name!r} cannot be sent to a worker process: {node_exc}. Define it "
                    "at module level or in an importable module, and keep unpicklable objects (locks, open "
                    "files, clients) out of its closure: build them inside the node or with @stateful.")
    return f"the pipeline cannot be sent to a worker process: {exc}"
