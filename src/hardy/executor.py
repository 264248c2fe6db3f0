"""The contract every map executor keeps, and what it reports about worker processes.

An executor receives a compiled `Plan`, the list of item inputs and a results sink, and runs the
items: in this process (`engine/executors.py`), in hardy's worker processes (`workers/pool.py`),
per stage (`stages.py`) or on Dask, Ray and Daft (`integrations/`). The engine relies on exactly
what this class declares, so that a new executor is a subclass, not a guess at duck types.
It lives below both the engine and the worker pool, which implement it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from .plan import Plan


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
    not, the engine refuses timed nodes rather than pretend (`hardy.policy`)."""

    @abstractmethod
    def run_items(self, plan: Plan, items: Sequence[dict[str, Any]], results: Any) -> None:
        """Run every item of `items` through `plan`, calling `results.ok` / `results.fail` per item."""

    def run_one(self, plan: Plan, item: dict[str, Any], sink: Callable[[], Any]) -> dict[str, Any]:
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


def outcome(results: Any) -> dict[str, Any]:
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
    it runs, so `hardy.policy` leaves it alone, and it can say where it ran and for how long, for
    node events. An async node's calls are coroutines: both methods are then `async`."""

    @abstractmethod
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The node's outputs, as calling its function would give them (or its error, raised)."""

    @abstractmethod
    def located(self, *args: Any, **kwargs: Any) -> Any:
        """`(where, outcome)`: `Where` it ran, and a callable giving the outputs or raising the error."""
