"""The part every engine shares: chunks of items through the compiled plan, on the engine's workers.

`RemoteExecutor` is what every engine-backed executor shares (shipping with hardy's errors first,
delivering per-item rows, naming the node behind a crash, import errors); `DaftExecutor` builds on
it directly, since a Daft map is one query. `TaskExecutor` adds running a map as tasks: Dask and Ray
only say how to start, how to submit a function, how to wait and what their "a worker died" errors
look like. For tasks:

1. the plan's spec is shipped once (the engine's object store), items in chunks of a few thousand;
2. each task compiles the plan on the worker (memoised per spec) and runs its chunk, returning
   (index, ok, outputs or NodeError) per item — per-item errors never fail the task;
3. a task whose worker died (a segfault, an OOM kill) loses its chunk, so its items are run again
   one task each; an item that still kills its worker (after the nodes' `retries`) is run step by
   step, one node per task, which names the node that crashes; it becomes a `NodeCrashed` for that
   item alone, with what the engine reported. Every other item completes.
"""

from __future__ import annotations

import hashlib
import importlib
import pickle
from typing import Any, Sequence

import cloudpickle

from ..crash import signal_in_stack
from ..errors import HardyError, NodeCrashed
from ..observe.nodelog import LOG
from ..plan import Plan
from ..shipping import build_plan, dumps, run_items_here, ship_items, ship_plan

_PLANS: dict[tuple[bytes, bool], Plan] = {}
CHUNK_MAX = 5000


def plan_for(spec: bytes, log: bool = False) -> Plan:
    """The plan a spec describes, compiled once per process; `log`: its logged form (nodelog.py)."""
    key = (hashlib.blake2b(spec, digest_size=16).digest(), log)
    plan = _PLANS.get(key)
    if plan is None:
        from ..safety.environment import install_numba_guard
        install_numba_guard()
        if len(_PLANS) > 64:
            _PLANS.clear()
        plan = _PLANS[key] = build_plan(spec, wrap=LOG.wrapper(), on_cached=LOG.cached) if log else build_plan(spec)
    return plan


def run_chunk_remote(spec: bytes, chunk: bytes, log: bool = False) -> bytes:
    """Runs on the engine's worker: the chunk's items through the plan. Chunks and results travel
    as one pickle each, so the engine moves bytes instead of walking thousands of small objects.
    `log`: the parent listens to node events, which travel back in the rows (nodelog.py)."""
    return dumps(run_items_here(plan_for(spec, log), pickle.loads(chunk), log))


def run_step_remote(spec: bytes, k: int, values: dict[str, Any]) -> tuple:
    """Runs on the engine's worker: step k alone, on the values computed so far (diagnosis only)."""
    step = plan_for(spec).steps[k]
    out = step.node.func(**{p: values[v] for p, v in step.args})
    return (out,) if len(step.node.outputs) == 1 else tuple(out)


def require(module: str, extra: str) -> Any:
    """Import an engine's package, or say which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"hardy's {extra} integration needs the {module!r} package, which cannot be imported "
                          f"here ({exc}). Install it with: pip install \"hardy[{extra}]\"") from exc


class WorkerImportError(HardyError, ModuleNotFoundError):
    """The engine's workers cannot import a module the pipeline's code needs."""


class RemoteExecutor:
    """What every engine-backed map executor shares: shipping with hardy's own errors first,
    delivering per-item rows, naming the node behind a crash, translating the engine's errors."""

    mode = "sequential"
    engine = "engine"

    def __init__(self, ship_modules: Sequence[str] = ()):
        self.ship_modules = tuple(ship_modules)

    # --- what an engine provides ---------------------------------------------------------------

    def _start(self) -> None:
        """Connect to (or start) the engine; called before every map, cheap once started."""
        raise NotImplementedError

    def _run_map(self, plan: Plan, spec: bytes, items: Sequence[dict[str, Any]], results: Any) -> None:
        """Run every item, delivering to `results`."""
        raise NotImplementedError

    def _call(self, fn: Any, *args: Any) -> Any:
        """Run fn(*args) on one of the engine's workers; its result, or the engine's error."""
        raise NotImplementedError

    def _call_step(self, handle: Any, k: int, values: dict[str, Any], node: Any) -> Any:
        """Run step k of the shipped plan alone, on the values computed so far (diagnosis)."""
        return self._call(run_step_remote, handle, k, values)

    def _is_crash(self, exc: BaseException) -> bool:
        """Whether the engine's error means the worker process died."""
        raise NotImplementedError

    def close(self) -> None: raise NotImplementedError

    def _cause(self, exc: BaseException) -> BaseException:
        """The user-level exception inside an engine's wrapper, if any."""
        return exc

    def _crash_report(self, exc: BaseException) -> tuple[str, str]:
        """What the engine said of the worker whose death `_call` just raised, and that worker's
        Python stack where the engine lets hardy see it."""
        return str(exc), ""

    # --- the shared part -----------------------------------------------------------------------

    def run_items(self, plan: Plan, items: Sequence[dict[str, Any]], results: Any) -> None:
        # cloudpickle's by-value registry is process-wide: `ship_modules` apply to this map only
        extra = [name for name in self.ship_modules if name not in cloudpickle.list_registry_pickle_by_value()]
        for name in extra:
            cloudpickle.register_pickle_by_value(importlib.import_module(name))
        try:
            spec = ship_plan(plan)  # hardy's clear error for anything that cannot travel, first
            if items:
                ship_items(items, [0])
            self._start()
            self._run_map(plan, spec, items, results)
        finally:
            for name in extra:
                cloudpickle.unregister_pickle_by_value(importlib.import_module(name))

    def _deliver(self, rows: list[tuple], results: Any) -> None:
        for i, ok, value, *records in rows:  # records: the item's node events, when logged
            if ok:
                results.ok(i, value, *records)
            else:
                results.fail(i, value, *records)

    def _diagnose(self, plan: Plan, handle: Any, item: dict[str, Any], i: int) -> NodeCrashed:
        """Run the item one node per call: the call whose worker dies names the node."""
        values = dict(item)
        for k, step in enumerate(plan.steps):
            try:
                out = self._call_step(handle, k, values, step.node)
            except Exception as exc:
                if self._is_crash(exc):
                    said, stack = self._crash_report(exc)
                    name, hint = signal_in_stack(stack)
                    return NodeCrashed(step.node.name, i, f"the {self.engine} worker running it died"
                                       + (f" ({hint})" if hint else "") + f": {said}", signal=name, stack=stack)
                return NodeCrashed(step.node.name, i, f"{self.engine} failed running it alone: "
                                                      f"{type(exc).__name__}: {exc}")
            values.update(zip(step.node.outputs, out))
        return NodeCrashed("?", i, f"the {self.engine} worker running this item died, but no single node "
                                   "crashes when run alone (a crash that depends on timing or state)")

    def _translate(self, exc: BaseException) -> BaseException:
        cause = self._cause(exc)
        missing = getattr(cause, "name", None) if isinstance(cause, ModuleNotFoundError) else None
        if missing is None and "No module named" in str(exc):
            missing = str(exc).split("No module named", 1)[1].split()[0].strip("'\"")
        if missing:
            return WorkerImportError(
                f"the {self.engine} workers cannot import module {missing!r}, which the pipeline's code comes "
                f"from. Install it on the workers, or ship it by value: "
                f"{type(self).__name__}(..., ship_modules=[{missing.split('.')[0]!r}]).")
        return cause if isinstance(cause, BaseException) else exc


class TaskExecutor(RemoteExecutor):
    """A map executor on an engine that runs Python functions as tasks (see the module docstring):
    an engine says how to start, submit a function, wait, and what its "a worker died" errors are."""

    def _workers(self) -> int: raise NotImplementedError
    def _put(self, data: bytes) -> Any: raise NotImplementedError
    def _submit(self, fn: Any, *args: Any) -> Any: raise NotImplementedError
    def _wait_any(self, futures: list[Any]) -> list[Any]: raise NotImplementedError
    def _result(self, future: Any) -> Any: raise NotImplementedError
    def _cancel(self, futures: list[Any]) -> None: raise NotImplementedError

    def _call(self, fn: Any, *args: Any) -> Any:
        return self._result(self._submit(fn, *args))

    def _run_map(self, plan: Plan, spec: bytes, items: Sequence[dict[str, Any]], results: Any) -> None:
        handle = self._put(spec)
        n = len(items)
        size = max(1, min(CHUNK_MAX, -(-n // (4 * max(1, self._workers())))))
        pending: dict[Any, list[int]] = {}
        for start in range(0, n, size):
            chunk = list(range(start, min(n, start + size)))
            for i in chunk:
                results.started(i)
            pending[self._submit(run_chunk_remote, handle, ship_items(items, chunk), results.log_nodes)] = chunk
        crashed: list[int] = []
        while pending:
            for fut in self._wait_any(list(pending)):
                chunk = pending.pop(fut)
                try:
                    rows = pickle.loads(self._result(fut))
                except Exception as exc:
                    if not self._is_crash(exc):
                        self._cancel(list(pending))
                        raise self._translate(exc) from exc
                    crashed += chunk
                    continue
                self._deliver(rows, results)
            if results.stop:
                self._cancel(list(pending))
                return
        if crashed:
            self._isolate(plan, handle, items, sorted(crashed), results)

    def _isolate(self, plan: Plan, handle: Any, items: Sequence[dict[str, Any]],
                 suspects: list[int], results: Any) -> None:
        """A chunk's worker died: run its items one per task to find the one(s) that kill it.

        First all at once; the items whose task still died (the culprit, and innocents that shared
        its worker) then run one at a time, up to 1 + the nodes' `retries` times each."""
        log = results.log_nodes
        pending = {self._submit(run_chunk_remote, handle, ship_items(items, [i]), log): i for i in suspects}
        again: list[int] = []
        while pending:
            for fut in self._wait_any(list(pending)):
                i = pending.pop(fut)
                if not self._try_deliver(fut, results):
                    again.append(i)
        attempts = 1 + max((s.node.retries for s in plan.steps), default=0)
        for i in sorted(again):
            if results.stop:
                return
            for _ in range(attempts):
                if self._try_deliver(self._submit(run_chunk_remote, handle, ship_items(items, [i]), log), results):
                    break
            else:
                results.fail(i, self._diagnose(plan, handle, items[i], i), worker=0)

    def _try_deliver(self, fut: Any, results: Any) -> bool:
        """Deliver a task's rows; False if its worker died."""
        try:
            rows = pickle.loads(self._result(fut))
        except Exception as exc:
            if not self._is_crash(exc):
                raise self._translate(exc) from exc
            return False
        self._deliver(rows, results)
        return True


__all__ = ["RemoteExecutor", "TaskExecutor", "WorkerImportError", "require", "run_chunk_remote",
           "run_step_remote"]
