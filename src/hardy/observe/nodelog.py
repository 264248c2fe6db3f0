"""Node events recorded where nodes run (a worker process, a Dask or Ray task, a Daft UDF) and
carried back with the results they belong to.

A worker cannot call the parent's callbacks, so when the parent listens to node events it asks the
worker for a *logged* plan (the same plan built with `LOG.wrapper()`, each node call recorded).
Each call becomes one record `node, code, start_ns, end_ns, detail` and each item one more,
`None, ITEM, start_ns, end_ns, pid`, five fields each in one flat list per item (no tuple per
record: fewer objects to pickle and for the garbage collector to walk). An item's records travel in
its result row `(i, ok, value, records)`, and the parent replays them (`Events.replay`) just before it delivers
the result, so callbacks see an item's node events in order, between its `on_map_item_start`
and `on_map_item_end`, with the durations measured in the worker; wall-clock nanoseconds let
OpenTelemetry spans and the report's timeline show when things really happened. When nobody
listens the worker runs the plain plan: nothing is logged, nothing is checked.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from ..node import Node

END, ERROR, CACHED, ITEM = 0, 1, 2, 3
FIELDS = 5  # per record: node name (None for the item's own), code, start_ns, end_ns, detail


class NodeLog:
    """The records of the item running in this process."""

    def __init__(self) -> None:
        self.records: list[Any] = []
        self.start = 0
        self.pid = 0

    def wrap(self, node: Node, func: Callable[..., Any]) -> Callable[..., Any]:
        """`func`, recording each call."""
        name, clock, log = node.name, time.time_ns, self

        if node.is_async:
            async def logged_async(*args: Any, **kwargs: Any) -> Any:
                start = clock()
                try:
                    value = await func(*args, **kwargs)
                except Exception:
                    log.records += (name, ERROR, start, clock(), None)
                    raise
                log.records += (name, END, start, clock(), None)
                return value
            return logged_async

        def logged(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                value = func(*args, **kwargs)
            except Exception:
                log.records += (name, ERROR, start, clock(), None)
                raise
            log.records += (name, END, start, clock(), None)
            return value
        return logged

    def wrapper(self, wrap: Callable[[int, Node], Callable[..., Any]] | None = None
                ) -> Callable[[int, Node], Callable[..., Any]]:
        """A plan's `wrap` that records each node call (around what `wrap` gives, if any); build the
        logged plan with it and `on_cached=LOG.cached`, in the process that runs it."""
        self.pid = os.getpid()
        return lambda k, n: self.wrap(n, wrap(k, n) if wrap else n.func)

    def cached(self, name: str, key: bytes, item: int | None) -> None:
        """The logged plan's cache-hit hook."""
        now = time.time_ns()
        self.records += (name, CACHED, now, now, key.hex() if isinstance(key, bytes) else str(key))

    def begin(self) -> None:
        self.records = []
        self.start = time.time_ns()

    def end(self) -> list[Any]:
        """The item's records, closed by its own (ITEM) record naming this process."""
        records = self.records
        records += (None, ITEM, self.start, time.time_ns(), self.pid)
        self.records = []
        return records


LOG = NodeLog()  # one per process: every logged plan built here records into it


def item_record(pid: int) -> list[Any]:
    """The records of an item whose worker `pid` died running it: only the item's own (its node
    records died with the worker); the caller reports the node it died in."""
    now = time.time_ns()
    return [None, ITEM, now, now, pid]
