"""The contract every map executor keeps, and what it reports about worker processes.

An executor receives a compiled `Plan`, the list of item inputs and a results sink, and runs the
items: in this process (`engine/in_process.py`), in hardy's worker processes (`workers/pool.py`),
per stage (`parts/stages.py`) or on Dask, Ray and Daft (`integrations/`). The engine relies on exactly
what this class declares, so that a new executor is a subclass, not a guess at duck types; the
sink's side of the seam is declared here too (`ResultsSink`, `MapResults`), as the map's
`engine.results.Results` and one stage's view of it (`stages`) keep it.
It lives below both the engine and the worker pool, which implement it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from ..errors import NodeError
    from ..observe.events import Events
    from ..observe.nodelog import NodeLogBatch
    from ..plan.compiled import Plan
    from ..shipping.context import Snapshot

Row = tuple[Any, ...]
"""A worker's outcome of one item: `(i, ok, outputs or NodeError[, its node log])`."""


class ResultsSink(Protocol):
    """What every executor delivers a map's items to, by index from 0: each outcome, when each
    item started and where, and whether to stop. A map's `Results` keeps them; one stage's view
    (`stages`) passes them on to the map's."""

    log_nodes: bool
    """Whether items run elsewhere send their node log back (someone listens to node events)."""

    kept_logs: list[Any] | None
    """Where the log records and warnings of this process's workers are kept for a caller in
    another process (an engine's worker: `integrations/remote.py`); None: handled here."""

    stop: bool
    """Set when the map ends early (on_error="raise" failed an item, the caller was interrupted):
    an executor hands out no more items."""

    @property
    def context(self) -> Snapshot | None:
        """The caller's state the items run with, when not this process's now (`shipping.context`)."""

    def ok(self, i: int, out: dict[str, Any], records: Sequence[NodeLogBatch] = ()) -> None:
        """Item i succeeded; `records`: its node log, from where it ran (a part per stage)."""

    def fail(self, i: int, err: NodeError, records: Sequence[NodeLogBatch] = (), worker: int | None = None) -> None:
        """Item i failed; `worker`: the pid of a worker process that died running it (0: unknown)."""

    def retried(self, i: int, err: NodeError, worker: int | None = None) -> None:
        """Item i's worker died of `err` and the item runs again (its node's `retries`)."""

    def started(self, i: int, worker: int | None = None) -> None:
        """Item i was handed to worker process `worker` (a pid), or is about to run here (None)."""

    def handed(self, chunk: Sequence[int], worker: int, again: bool = False) -> None:
        """The items of `chunk` were handed to `worker` at once; `again`: after one that died."""

    def take(self, rows: Sequence[Row], unsent: MutableMapping[int, Any],
             records: NodeLogBatch | None = None) -> list[Row]:
        """A worker's batch of rows: the successes delivered, their items removed from `unsent`, the
        failures returned for the executor's policy to retry or `fail`."""

    def take_span(self, first: int, outputs: list[dict[str, Any]]) -> None:
        """The outputs of items `first`, `first` + 1, ..., all succeeded."""

    def take_columns(self, first: int, names: tuple[str, ...], columns: list[list[Any]]) -> int:
        """`take_span` for outputs sent as a list per output name (a worker's `Header.columns`),
        emptied here: how many items they are."""

    def raise_ending(self) -> None:
        """Raise what ended the call before its items did (`engine.results.Results.ending`), if anything."""


class MapResults(ResultsSink, Protocol):
    """A whole map's results (`engine.results.Results`): what an executor running items in this
    process runs them through (the plan's runner, observed as the map is), and where a one-item
    map's outcome is read from (`outcome`). One stage's view is not one."""

    values: list[Any]
    failures: dict[int, NodeError]
    offset: int
    """The map's index of item 0 (a window of a streamed map), for errors and events."""

    events: Events | None

    def runner(self, plan: Plan) -> Callable[[dict[str, Any], int], dict[str, Any]]:
        """`plan.run` as item i of this map runs it here: numbered and observed as the map's."""

    def async_runner(self, plan: Plan) -> Callable[[dict[str, Any], int], Awaitable[dict[str, Any]]]:
        """`runner` for an async plan: a coroutine per item."""

    def crashed(self) -> dict[int | None, Any]:
        """The items of this map that crashed a worker before (a nested map run again without them)."""

    def batch_called(self, name: str, size: int, duration: float) -> None:
        """A batched node's call ran in this process."""


@dataclass
class WorkerCounts:
    """What happened to worker processes: started, died (not on purpose), recycled (stopped on
    purpose: max_tasks_per_worker, max_memory_per_worker), and the peak RSS of each live one by pid."""

    started: int = 0
    died: int = 0
    recycled: int = 0
    peak_rss: dict[str, int] = field(default_factory=dict)

    def __add__(self, other: WorkerCounts) -> WorkerCounts:
        return WorkerCounts(self.started + other.started, self.died + other.died,
                            self.recycled + other.recycled, {**self.peak_rss, **other.peak_rss})

    def as_dict(self) -> dict[str, Any]:
        """For a run report's JSON; by hand, as `dataclasses.asdict` deep-copies (9 µs of every map)."""
        return {"started": self.started, "died": self.died, "recycled": self.recycled, "peak_rss": self.peak_rss}

    def since(self, before: WorkerCounts) -> WorkerCounts:
        """What happened after `before` was taken; the peaks are today's."""
        return WorkerCounts(self.started - before.started, self.died - before.died,
                            self.recycled - before.recycled, dict(self.peak_rss))


class Executor(ABC):
    """Runs the items of a map and delivers each outcome to the results sink (`engine/results.py`)."""

    mode: ClassVar[str] = "sequential"
    """The plan flavour it runs: "sequential" (plain calls) or "async" (coroutines on one loop)."""

    enforces_timeouts: bool = False
    """Whether a node running past its `timeout=` is stopped (in a worker process, killed). Where
    not, the engine refuses timed nodes rather than pretend (`hardy.model.policy`)."""

    @abstractmethod
    def run_items(self, plan: Plan, items: Sequence[dict[str, Any]], results: ResultsSink) -> None:
        """Run every item of `items` through `plan`, calling `results.ok` / `results.fail` per item."""

    def run_one(self, plan: Plan, item: dict[str, Any], sink: Callable[[], MapResults]) -> dict[str, Any]:
        """One item's outputs (`run()` on this executor), or its error raised; `sink()` makes the
        results sink it goes through. A one-item map here; the worker pool has a shorter way."""
        results = sink()
        self.run_items(plan, [item], results)
        return outcome(results)

    def counts(self, peaks: bool = True) -> WorkerCounts | None:
        """Worker processes this executor started so far (None: it starts none); `peaks`: also
        read their peak memory, the only part that costs anything."""
        return None

    def close(self) -> None:  # noqa: B027  (most executors start nothing to stop)
        """Stop whatever the executor started (threads, processes, connections)."""


def outcome(results: MapResults) -> dict[str, Any]:
    """The outputs of a one-item map's item, from its results sink, or its error raised as a call
    raises it (numbered as no map's item)."""
    if results.failures:
        err = results.failures[0]
        err.item = None
        raise err
    out: dict[str, Any] = results.values[0]
    return out


Where = tuple[int, float | None] | None
"""Where an isolated call ran: the worker's pid and the seconds the node took there (None: it died)."""


class IsolatedCall(ABC):
    """A node's function as a plan calls it when every call runs elsewhere (`@node(isolate=True)`:
    a one-item map on the engine's worker pool). It applies the node's retries and timeout where
    it runs, so `hardy.model.policy` leaves it alone, and it can say where it ran and for how long, for
    node events. An async node's calls are coroutines: both methods are then `async`."""

    @abstractmethod
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The node's outputs, as calling its function would give them (or its error, raised)."""

    @abstractmethod
    def located(self, *args: Any, **kwargs: Any) -> Any:
        """`(where, outcome)`: `Where` it ran, and a callable giving the outputs or raising the error."""
