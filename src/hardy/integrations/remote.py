"""The part every engine shares: chunks of items through the compiled plan, on the engine's workers.

`RemoteExecutor` is what every engine-backed executor shares (shipping with hardy's errors first,
delivering per-item rows, import errors); `DaftExecutor` builds on it directly, since a Daft map is
one query. `TaskExecutor` adds running a map as tasks: Dask and Ray only say how to start, how to
submit a function, how to wait and what their "a worker died" errors look like. For tasks:

1. the plan's spec is shipped once (the engine's object store), items in chunks of a few thousand,
   each item pickled on its own: one that cannot be fails alone here, and the engine's worker
   passes the others on unopened (`shipping.Pickled`), so an item whose class that machine cannot
   import, or whose unpickling raises or crashes, fails alone in hardy's worker process;
2. each task runs its chunk through `run_contained`: hardy's own worker machinery (the process
   executor's pool, one worker process per task thread) on the engine's worker, so the failure policy is the
   process executor's exactly: a crash or a timeout (the worker is killed) costs the item that
   caused it, after its node's `retries`, named with node, signal and the Python stack; the items
   that completed keep their results and never run again; the engine never sees a dead worker.
   Why not the engines' own machinery: Dask cannot stop a running task, Ray's forced cancel kills
   its whole worker (the chunk with it), Daft has no per-call timeout, and none of them says which
   item of a chunk killed it, so crash isolation there meant bisecting and rerunning innocents;
3. per-item errors never fail the task; a task whose engine worker itself died (the engine's own
   out-of-memory kill) is run once more, then its items fail naming the engine's report.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import pickle
import threading
from abc import abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import cloudpickle

from ..engine.in_process import chunk_size
from ..engine.results import Results
from ..errors import NodeCrashed, NodeError, NodeInterrupted, WorkerImportError, install_hint
from ..model.executor import Executor, ResultsSink, Row, WorkerCounts
from ..observe.nodelog import NodeLogBatch, died
from ..observe.watch import Watch
from ..plan.compiled import Plan
from ..plan.memo import Memo
from ..shipping import Pickled, build_plan, check_constants, context, dumps, item_error, portable, ship_each, ship_plan
from ..shipping.context import Travelling
from ..workers.deaths import with_inputs
from ..workers.pool import WorkerPool
from ..workers.replies import Forward, handle_logs

_PLANS: Memo[bytes, Plan] = Memo(64)
CHUNK_MAX = 5000


def plan_for(spec: bytes) -> Plan:
    """The plan a spec describes, compiled once per process."""
    key = hashlib.blake2b(spec, digest_size=16).digest()
    plan = _PLANS.get(key)
    if plan is None:
        from ..safety.environment import install_numba_guard
        install_numba_guard()
        plan = _PLANS.put(key, build_plan(spec))
    return plan


def run_chunk_remote(spec: bytes, chunk: bytes, log: bool = False, caller: Travelling | None = None,
                     home: int | None = None) -> bytes:
    """Runs on the engine's worker: the chunk's items through the plan, what happened to hardy's
    worker processes there meanwhile (for run reports), and, where this is not the caller's process
    (`home`, its pid), the log records and warnings of the chunk (`kept_logs`). Chunks and results
    travel as one pickle each, so the engine moves bytes instead of walking thousands of small
    objects. `log`: the caller listens to node events, which travel back in the rows (nodelog.py);
    `caller`: its environment, working directory and argv at the call (`shipping.context`)."""
    if caller is not None:
        caller.take_import_path()
    pool = _pool()
    before = pool.counts()
    records: list[logging.LogRecord] | None = [] if home is not None and home != os.getpid() else None
    rows = run_contained(plan_for(spec), [(i, Pickled(blob)) for i, blob in pickle.loads(chunk)], log, caller,
                         records)
    after = pool.counts()
    return dumps((rows, after.since(before), records or []))


_here = threading.local()  # per thread of the engine's worker (a Dask worker runs tasks in several)


class _Rows(Results):
    """A chunk's outcomes, with each item's node log (`log`) to send on to the caller's
    Results; a worker's death is logged as an item alone naming it, so that the caller
    reports the node it died in."""

    ok_per_item = True

    def __init__(self, n: int, log: bool, caller: Travelling | None = None):
        super().__init__(n, "continue", Watch.quiet(n, "chunk"))
        self.log_nodes = log
        self.context = caller.arrived() if caller is not None else None
        self.records: dict[int, list[NodeLogBatch]] = {}

    def ok(self, i: int, out: dict[str, Any], records: Sequence[NodeLogBatch] = ()) -> None:
        super().ok(i, out)
        if records:
            self.records[i] = list(records)

    def fail(self, i: int, err: NodeError, records: Sequence[NodeLogBatch] = (), worker: int | None = None) -> None:
        super().fail(i, err)
        if records or (worker is not None and self.log_nodes):
            self.records[i] = list(records) or [died(worker or 0)]


def _pool() -> WorkerPool:
    """This thread's pool of one hardy worker process, started on its first chunk and kept."""
    pool: WorkerPool | None = getattr(_here, "pool", None)
    if pool is None:
        import multiprocessing as mp
        # Dask's workers are daemonic processes, which multiprocessing forbids to start children
        # (so that none outlives them); hardy's pool stops its worker itself, at exit.
        mp.current_process()._config.pop("daemon", None)  # type: ignore[attr-defined]  # private, untyped
        pool = _here.pool = WorkerPool(workers=1)
    return pool


def run_contained(plan: Plan, chunk: list[tuple[int, Any]], log: bool = False,
                  caller: Travelling | None = None, records: list[logging.LogRecord] | None = None) -> list[Row]:
    """(index, ok, outputs or NodeError[, node records]) per item, each item run in hardy's worker
    process here (`_pool`), with the caller's environment, working directory and argv (`caller`);
    `records`: the log records and warnings meanwhile are kept there for the caller (`kept_logs`)."""
    results = _Rows(len(chunk), log, caller)
    results.kept_logs = records
    try:
        with kept_logs(records):
            _pool().run_items(plan, [item for _, item in chunk], results)
    except KeyboardInterrupt:  # a node's (`Results.raise_ending`): its items unrun come back saying so
        if not isinstance(results.ending, NodeInterrupted):
            raise
    ending, rows = results.ending, []
    for k, (i, _) in enumerate(chunk):
        err = results.failures.get(k)
        if err is None and results.values[k] is None and isinstance(ending, NodeInterrupted):
            err = NodeInterrupted(ending.node, None, i, ending.reason)  # (the caller's results stop at the first)
        if err is not None:
            err.item = i
        row = (i, True, results.values[k]) if err is None else (i, False, portable(err))
        rows.append((*row, results.records[k]) if k in results.records else row)
    return rows


@contextmanager
def kept_logs(records: list[logging.LogRecord] | None) -> Iterator[None]:
    """In an engine's worker process, which is not the caller's: what this thread logs meanwhile
    (hardy's pool: a crash retried) kept in `records`, beside what hardy's workers there send (a
    node's log records and warnings: `ResultsSink.kept_logs`), for the caller to handle
    (`TaskExecutor._run_map`, `DaftExecutor._query`: `replies.handle_logs`) as the process
    executor's parent does: its loggers, handlers, warning filters and `catch_warnings(record=True)`
    see them, each at its level, with its category and the node's file and line. Handled here, they
    went to the engine worker's log (Ray's, in its session folder) or nowhere (Daft's). None:
    nothing kept (the caller's own process: a local Dask cluster's threads)."""
    if records is None:
        yield
        return
    own = Forward()
    own.records = records  # (one list: workers' and the pool's records in the order they came)
    thread = threading.get_ident()
    own.addFilter(lambda record: record.thread == thread)
    root = logging.getLogger()
    root.addHandler(own)
    try:
        yield
    finally:
        root.removeHandler(own)


def require(module: str, extra: str) -> Any:
    """Import an engine's package, or say which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"hardy's {extra} integration needs the {module!r} package, which cannot be imported "
                          f"here ({exc}). Install it with: {install_hint(extra)}") from exc


class RemoteExecutor(Executor):
    """What every engine-backed map executor shares: shipping with hardy's own errors first,
    delivering per-item rows, translating the engine's errors. An engine implements its abstract
    methods (what an engine provides, below)."""

    engine = "engine"
    enforces_timeouts = True  # chunks run in hardy's worker processes (run_contained)
    # Whether its workers run on this machine with the environment this process had as they started
    # (a local Ray's, at `ray.init`): a variable set back since to what this process started with is
    # sent too. Not to another machine's workers, whose own `PATH` it would replace.
    inherits_environment = False

    def __init__(self, ship_modules: Sequence[str] = ()):
        self.ship_modules = tuple(ship_modules)
        self._counts = WorkerCounts()

    def counts(self, peaks: bool = True) -> WorkerCounts:
        """hardy's worker processes on the engine's workers, as `WorkerPool.counts`: the peak
        RSS is each one's at its last chunk."""
        return self._counts + WorkerCounts()

    # --- what an engine provides ---------------------------------------------------------------

    @abstractmethod
    def _start(self) -> None:
        """Connect to (or start) the engine; called before every map, cheap once started."""

    @abstractmethod
    def _run_map(self, plan: Plan, spec: bytes, items: Sequence[dict[str, Any]], results: ResultsSink) -> None:
        """Run every item, delivering to `results`."""

    @abstractmethod
    def _is_crash(self, exc: BaseException) -> bool:
        """Whether the engine's error means the worker process died."""

    @abstractmethod
    def close(self) -> None:
        """Let go of the engine (a cluster this executor started is shut down)."""

    def _cause(self, exc: BaseException) -> BaseException:
        """The user-level exception inside an engine's wrapper, if any."""
        return exc

    # --- the shared part -----------------------------------------------------------------------

    def run_items(self, plan: Plan, items: Sequence[dict[str, Any]], results: ResultsSink) -> None:
        # cloudpickle's by-value registry is process-wide: `ship_modules` apply to this map only
        extra = [name for name in self.ship_modules if name not in cloudpickle.list_registry_pickle_by_value()]
        for name in extra:
            cloudpickle.register_pickle_by_value(importlib.import_module(name))
        try:
            spec = ship_plan(plan, everything=True)  # hardy's clear error for anything that cannot travel, first
            check_constants(items)
            self._start()
            self._run_map(plan, spec, items, results)
        finally:
            for name in extra:
                cloudpickle.unregister_pickle_by_value(importlib.import_module(name))

    def _ship(self, plan: Plan, items: Sequence[dict[str, Any]], chunk: Sequence[int],
              results: ResultsSink) -> bytes | None:
        """The chunk for a task (`shipping.ship_each`); its items that cannot be pickled fail here."""
        blobs, bad = ship_each(items, chunk)
        for i, why in bad.items():
            results.fail(i, item_error(plan, i, why))
        return pickle.dumps(blobs, protocol=5) if blobs else None

    def deliver(self, rows: list[Row], results: ResultsSink, items: Sequence[dict[str, Any]]) -> None:
        """A chunk's rows (`run_contained`), each item's outcome to `results`. A failure names its
        item's inputs as the process executor's do (`with_inputs`): the engine's worker passed the
        item on unopened, so a crash or a timeout there could not."""
        for i, ok, value, *records in rows:  # records: the item's node events, when logged
            if ok:
                results.ok(i, value, *records)
            else:
                results.fail(i, with_inputs(value, items[i]), *records)

    def translate(self, exc: BaseException) -> BaseException:
        """The error to raise for the engine's `exc`: the user's own (a worker's `ReplicaError`
        too) or hardy's naming the module a worker cannot import, chained to the engine's."""
        translated = self._translate_cause(exc)
        if translated is not exc and translated.__cause__ is None and translated is not exc.__cause__:
            translated.__cause__ = exc
        return translated

    def _translate_cause(self, exc: BaseException) -> BaseException:
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

    @abstractmethod
    def _workers(self) -> int:
        """How many tasks the engine runs at once (chunks are sized to keep them all busy)."""

    @abstractmethod
    def _put(self, data: bytes) -> Any:
        """`data` in the engine's object store, once for every task: a handle the tasks take."""

    @abstractmethod
    def _submit(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` as a task: its future."""

    @abstractmethod
    def _wait_any(self, futures: list[Any]) -> list[Any]:
        """The futures of `futures` done, once at least one is."""

    @abstractmethod
    def _result(self, future: Any) -> Any:
        """A done task's value, or the engine's error raised."""

    @abstractmethod
    def _cancel(self, futures: list[Any]) -> None:
        """Stop the tasks of `futures` (a map that ends early)."""

    def _run_map(self, plan: Plan, spec: bytes, items: Sequence[dict[str, Any]], results: ResultsSink) -> None:
        handle = self._put(spec)
        caller = context.current().travelling(set_back=self.inherits_environment)
        home = os.getpid()
        n = len(items)
        # whole batches of a batched node per chunk, as on every executor (`chunk_size`)
        size = chunk_size(plan, max(1, min(CHUNK_MAX, -(-n // (4 * max(1, self._workers()))))))
        pending: dict[Any, list[int]] = {}
        shipped: dict[Any, bytes] = {}
        for start in range(0, n, size):
            chunk = list(range(start, min(n, start + size)))
            for i in chunk:
                results.started(i)
            blob = self._ship(plan, items, chunk, results)
            if blob is not None:
                fut = self._submit(run_chunk_remote, handle, blob, results.log_nodes, caller, home)
                pending[fut], shipped[fut] = chunk, blob
        lost: set[Any] = set()
        while pending:
            for fut in self._wait_any(list(pending)):
                chunk, blob = pending.pop(fut), shipped.pop(fut)
                try:
                    rows, counts, records = pickle.loads(self._result(fut))
                except Exception as exc:
                    if not self._is_crash(exc):
                        self._cancel(list(pending))
                        translated = self.translate(exc)  # (chained to `exc` unless it is `exc`)
                        raise translated from translated.__cause__
                    if fut in lost:  # the engine's worker died under this chunk twice
                        for i in chunk:
                            results.fail(i, NodeCrashed("?", i, f"the {self.engine} worker running this item's "
                                                                f"chunk died, twice: {exc}"))
                    else:
                        again = self._submit(run_chunk_remote, handle, blob, results.log_nodes, caller, home)
                        pending[again], shipped[again] = chunk, blob
                        lost.add(again)
                    continue
                self._counts += counts
                handle_logs(None, records)  # (before the chunk's results, as the process executor does)
                self.deliver(rows, results, items)
            if results.stop:
                self._cancel(list(pending))
                results.raise_ending()
                return


__all__ = ["RemoteExecutor", "TaskExecutor", "kept_logs", "require", "run_chunk_remote", "run_contained"]
