"""`Results`: the sink every executor writes a map's items to.

It keeps each item's outputs at its input position, turns failures into `Failed` placeholders,
stops early under on_error="raise" and feeds the progress bar, the map-item callbacks and the run
report. Nothing computed is discarded: a MapError carries it all. It sits below the engine, the
worker pool and the stream runner, which all hand it results.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from ..collector import paused
from ..crash.containment import POISON, poisoned_here
from ..errors import Failed, NodeCrashed, NodeError, NodeInterrupted, PipelineRefused, ReplicaError
from ..model.executor import MapResults, Row
from ..observe.callbacks import ITEM_EVENTS, NODE_EVENTS
from ..observe.nodelog import one_by_one
from ..observe.progress import MapProgress
from ..observe.watch import Watch
from ..plan.source import columns_to_dicts

if TYPE_CHECKING:
    from ..observe.nodelog import NodeLogBatch
    from ..plan.compiled import Plan
    from ..shipping.context import Snapshot


class Results(MapResults):
    """Where executors put each item's outcome, by index.

    Executors count items from 0; `offset` is the map's index of item 0 (a window of a streamed
    map), added wherever an index leaves the sink: errors, events, the run report and the plan's
    cache events (a window's `Events` read their items by the map's index too)."""

    context: Snapshot | None = None
    """The caller's state its items run with (`shipping.context`), when not this process's now
    (an engine's chunk, run for a caller elsewhere)."""

    ok_per_item: ClassVar[bool] = False
    """Set by a subclass whose `ok` must see every success (a window announcing it, a remote
    chunk's rows, an isolated call's sink): `take` then calls it per row instead of its batch loop."""

    def __init__(self, n: int, on_error: str, watch: Watch, offset: int = 0, cached: bool = False,
                 batched: bool = False):
        """`watch`: what observes the call (`hardy.observe.watch`), told of each item here."""
        progress, events = watch.progress, watch.events
        self.offset = offset
        self.live = watch.report  # the run report being recorded (only with events: the recorder is a callback)
        # Executors that run items elsewhere log node events there only when someone listens, or
        # when the bar shown counts the cache hits of a `cached` plan or the batch calls of a
        # `batched` one (made where the items run).
        self._hits = (cached or batched) and progress.show
        self.kept_logs: list[Any] | None = None  # (handled in this process: `ResultsSink.kept_logs`)
        self.log_nodes = self._hits or events is not None and events.listens(
            *NODE_EVENTS, "on_node_cached", "on_map_item_cached", "on_batch_end")
        self._watch_items = events is not None and (self.live is not None or events.listens(*ITEM_EVENTS))
        self.values: list[Any] = [None] * n
        self.failures: dict[int, NodeError] = {}
        self.stop = False
        self.ending: ReplicaError | NodeInterrupted | None = None  # what stopped the call (`fail`)
        self._raise = on_error == "raise"
        self.progress = progress
        self.events = events
        # when each item was handed out or began here (its end event's duration); a list, not a
        # dict: a fast map hands out and ends a million items a second
        self._started = [time.perf_counter()] * n
        self.retries: dict[int, int] = {}
        # item i's way to run again under pdb here (`NodeError.debug`), given to its error: the map's
        self.rerun: Callable[[int], Callable[[str], bool]] | None = None

    def raise_ending(self) -> None:
        """End the call with the `ReplicaError` of a worker that refused its pipeline, or the
        KeyboardInterrupt a node raised in one, if either came: an executor calls it once its
        workers are stopped, whatever `on_error` says. The node's own exception where it came back
        as one (its class, message and frames: `workers.deaths.node_interrupted`), as in-process;
        else a KeyboardInterrupt saying its message, raised from what came back (a stand-in of a
        class this process cannot make, which is no KeyboardInterrupt), if anything did."""
        if isinstance(self.ending, NodeInterrupted):
            cause = self.ending.__cause__
            if isinstance(cause, KeyboardInterrupt):
                raise cause
            raise KeyboardInterrupt(*[self.ending.reason] if self.ending.reason else []) from cause
        if self.ending is not None:
            raise self.ending

    def ok(self, i: int, out: dict[str, Any], records: Sequence[NodeLogBatch] = ()) -> None:
        """Item i succeeded; `records`: its node log, from where it ran (a part per stage; nodelog.py)."""
        self.values[i] = out
        self.progress.done += 1
        if self._hits:
            self._count_hits(records)
        if self.events:  # `_observed` for one item (one run here is named in the context since its start)
            if records:
                self._replay(records, lambda r: i)
            if self._watch_items:
                self.events.items_done([(i, True, out)], self.offset, self._started, time.perf_counter(),
                                       not self.events.names(self.offset + i), self.retries)
                if self.live:
                    self.live.item_end(self.offset + i, True)

    def take(self, rows: Sequence[Row], unsent: MutableMapping[int, Any],
             records: NodeLogBatch | None = None) -> list[Row]:
        """A worker's batch of rows `(i, ok, value)` and their node log: each success delivered as
        `ok` would, each row's item removed from `unsent`; the failures are returned (with their
        part of the log, unless replayed here already), for the pool's policy to retry or `fail`
        them. One loop per batch: in a map of fast items, this loop is the parent's per-item
        cost, which bounds the whole map's throughput."""
        if self.ok_per_item:
            return one_by_one(rows, unsent, records, self.ok)
        failed: list[Row] = []
        pop = unsent.pop
        values = self.values
        for row in rows:
            i = row[0]
            pop(i, None)
            if row[1]:
                values[i] = row[2]
            else:
                failed.append(row)
        self.progress.done += len(rows) - len(failed)
        if self._hits and records is not None:
            self._count_hits((records,))
        if self.events:
            if records is not None:  # the failures' node events too, with their errors
                self._replay((records,), lambda r: rows[r][0], {row[0]: _cause(row[2]) for row in failed})
            self._observed(rows if not failed else [row for row in rows if row[1]], time.perf_counter())
        return failed

    def take_span(self, first: int, outputs: list[dict[str, Any]]) -> None:
        """The outputs of items `first`, `first` + 1, ..., all succeeded (a worker's batch of outputs
        only), delivered as `take` delivers them: in one slice when nothing watches each item."""
        if self.ok_per_item or self.events:
            self.take([(i, True, out) for i, out in enumerate(outputs, first)], {})
            return
        self.values[first:first + len(outputs)] = outputs
        self.progress.done += len(outputs)

    def take_columns(self, first: int, names: tuple[str, ...], columns: list[list[Any]]) -> int:
        """`take_span` for a list of outputs per name: each item's result dict made here, and,
        when no callback watches each item, delivered, with the collector paused: in a map of
        10,000 fast items, 4 or 5 collections of 20 to 40 us each would walk the young containers,
        the columns' and the batch's lists of thousands of values among them, on the parent's
        critical path; paused, one runs after those lists were freed."""
        quiet = not (self.ok_per_item or self.events)
        with paused():
            outputs = columns_to_dicts(names)(columns)
            columns.clear()  # (freed before the collector runs again: it would walk their values)
            n = len(outputs)
            if quiet:  # delivered, and the list of them freed, before it runs again
                self.take_span(first, outputs)
                del outputs
        if not quiet:
            self.take_span(first, outputs)
        return n

    def _observed(self, rows: Sequence[Row], now: float) -> None:
        """The ends of a worker's successful rows delivered at `now`, in one call (their node
        events were replayed just before: per item, events still come in order)."""
        if self._watch_items:
            self.events.items_done(rows, self.offset, self._started, now, True, self.retries)  # type: ignore[union-attr]
            if self.live:
                for row in rows:
                    self.live.item_end(self.offset + row[0], True)

    def fail(self, i: int, err: NodeError, records: Sequence[NodeLogBatch] = (), worker: int | None = None) -> None:
        """Item i failed; `records` as for `ok`; `worker`: the pid of a worker process that died
        running it (0 where the engine does not say which), so that the node it died in reports.
        A pipeline a worker refused to load (`PipelineRefused`) stops the call, which its executor then
        ends with one `ReplicaError` (`raise_ending`), after stopping its workers; and so does a
        node's KeyboardInterrupt (`NodeInterrupted`), its item left unrun, as in-process."""
        if isinstance(err, (PipelineRefused, NodeInterrupted)):
            self.ending = self.ending or (ReplicaError(str(err.reason)) if isinstance(err, PipelineRefused) else err)
            self.stop = True
            return
        if self._hits:
            self._count_hits(records)
        if self.events and (records or worker is not None):
            if records:
                self._replay(records, lambda r: i, {i: _cause(err)})
                worker = records[-1].pid
            if isinstance(err, NodeCrashed) and not any(log.raised() for log in records):
                self.events.crashed(self.offset + i, err, worker or 0, self.retries.get(i, 0))  # it died mid-node
        err.item = self.offset + i
        err.__traceback__ = None  # hardy's frames; its cause's traceback holds the user's
        if self.rerun is not None:
            err.rerun = self.rerun(i)
        self.failures[i] = err
        self.values[i] = Failed(err)
        self.progress.failed += 1
        if self._raise:
            self.stop = True
        if self.events and self._watch_items:
            self.events.item_failed(self.offset + i, err, self.retries.get(i, 0))
            if self.live:
                self.live.item_end(self.offset + i, False)

    def _count_hits(self, logs: Sequence[NodeLogBatch]) -> None:
        """The bar counts the cache hits and batch calls logged where items ran (here, the plan's
        own hook and `batch_called` count them)."""
        self.progress.cached += sum(log.hits() for log in logs)
        for log in logs:
            for name, size, duration in log.batches():
                self.progress.batch(name, size, duration)

    def batch_called(self, name: str, size: int, duration: float) -> None:
        """A batched node's call ran in this process (`hardy.parts.batching`): the bar and the callbacks."""
        self.progress.batch(name, size, duration)
        if self.events:
            self.events.batch_called(name, size, duration)

    def retried(self, i: int, err: NodeError, worker: int | None = None) -> None:
        """Item i's worker (pid `worker`) died of `err` and the item runs again (its node's
        `retries`): the node's on_error for the attempt that died, with its signal."""
        if self.events:
            err.item = self.offset + i
            self.events.crashed(self.offset + i, err, worker or 0, self.retries.get(i, 0))
        self.retries[i] = self.retries.get(i, 0) + 1

    def _replay(self, logs: Sequence[NodeLogBatch], which: Callable[[int], int],
                errors: dict[int, Exception] | None = None) -> None:
        """Node logs replayed to the callbacks and the report: `which(r)` is the item that ran
        r-th; `errors`: of the items that failed."""
        assert self.events is not None
        self.events.replay(logs, which, errors, self.offset, self.retries, self.live)

    def handed(self, chunk: Sequence[int], worker: int, again: bool = False) -> None:
        """The items of `chunk` were handed to worker process `worker` (a pid) at once; `again`:
        they were handed before, to a worker that died (they started then)."""
        if not self._watch_items:
            return
        assert self.events is not None  # items are watched only with events
        offset = self.offset
        if self.live:
            for i in chunk:
                self.live.item_start(offset + i, worker)
        if not again:
            started, now = self._started, time.perf_counter()
            for i in chunk:
                started[i] = now
            self.events.items_started([offset + i for i in chunk] if offset else chunk, worker)

    def started(self, i: int, worker: int | None = None) -> None:
        """An item was handed to worker process `worker` (a pid), or is about to run here (None)."""
        if self._watch_items:
            self._started[i] = time.perf_counter()
            if self.live:
                self.live.item_start(self.offset + i, worker)
            assert self.events is not None  # items are watched only with events
            self.events.item_started(self.offset + i, worker)
        elif worker is None and self.events:
            self.events.in_item(self.offset + i)

    def runner(self, plan: Plan) -> Callable[[dict[str, Any], int], dict[str, Any]]:
        return _skipping(self._runner(plan), self.crashed())

    def crashed(self) -> dict[int | None, Any]:
        """The items of this map that crashed a worker before (a nested map in a worker, run
        again without them: `crash.containment.poisoned_here`); {} almost always."""
        return poisoned_here() if POISON else {}

    def _runner(self, plan: Plan) -> Callable[[dict[str, Any], int], dict[str, Any]]:
        if not self.events and not self.offset:
            return plan.run
        run, started, offset = plan.run, self.started if self.events else None, self.offset

        def observed(item: dict[str, Any], i: int) -> dict[str, Any]:
            if started:
                started(i)
            return run(item, offset + i)
        return observed

    def async_runner(self, plan: Plan) -> Callable[[dict[str, Any], int], Awaitable[dict[str, Any]]]:
        assert plan.arun is not None
        if not self.events and not self.offset:
            return plan.arun
        arun, started, offset = plan.arun, self.started if self.events else None, self.offset

        async def observed(item: dict[str, Any], i: int) -> dict[str, Any]:
            if started:
                started(i)
            out: dict[str, Any] = await arun(item, offset + i)
            return out
        return observed


class OneRun(Results):
    """The sink of `run()`'s item in a worker process: node events are replayed from the worker's
    log as for a map's items, but a run has no items to announce."""

    def __init__(self, name: str, events: Any = None):
        super().__init__(1, "raise", Watch(MapProgress(1, name, False), events))
        self._watch_items = False


def _skipping(run: Callable[[dict[str, Any], int], dict[str, Any]],
              crashed: dict[int | None, Any]) -> Callable[[dict[str, Any], int], dict[str, Any]]:
    """`run`, failing the items that crashed a worker the last time instead of running them."""
    if not crashed:
        return run

    def skipping(item: dict[str, Any], i: int) -> dict[str, Any]:
        if i in crashed:
            err = crashed[i]
            if not err.inputs_summary:  # (the parent that made it never saw this inner item: it is here)
                from ..plan.compiled import KEYS
                from ..wording import summarize
                err.inputs_summary = summarize({k: v for k, v in item.items() if k != KEYS})
            raise err
        return run(item, i)
    return skipping


def _cause(err: NodeError) -> Exception:
    """What a node raised, as callbacks' on_error reports it (the NodeError, where it lost that)."""
    return err.__cause__ if isinstance(err.__cause__, Exception) else err
