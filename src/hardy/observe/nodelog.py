"""Node events recorded where nodes run (a worker process, a Dask or Ray task, a Daft UDF) and
carried back with the results they belong to.

A worker cannot call the parent's callbacks, so when the parent listens to node events it asks the
worker to log them: each node call becomes one record `(node, code, start_ns, end_ns, detail)`,
and each item one more, `(None, ITEM, start_ns, end_ns, pid)`. The records of an item travel in
the same message as its result, and the parent replays them (`Events.replay`) just before it
delivers the result, so callbacks see an item's node events in order, between its
`on_map_item_start` and `on_map_item_end`, with the durations measured in the worker. Wall-clock
nanoseconds let OpenTelemetry spans and the report's timeline show when things really happened.
When nobody listens, nothing is logged: the worker's plan is the plain one.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from ..node import Node

END, ERROR, CACHED, ITEM = 0, 1, 2, 3
Record = tuple  # (node name or None, code, start_ns, end_ns, detail)


class NodeLog:
    """The node events of the items run in this process since the last `take`."""

    def __init__(self) -> None:
        self.on = False
        self.item = -1
        self.pid = 0
        self.records: dict[int, list[Record]] = {}

    def switch(self, on: bool) -> None:
        """Log (or not) the chunks that follow, as the parent asked."""
        self.on = on
        self.pid = os.getpid()  # this process's, not the fork server's that created LOG
        self.records = {}

    def wrap(self, node: Node, func: Callable[..., Any]) -> Callable[..., Any]:
        """`func`, logging its calls while `on` (the plan is compiled once, logging is per chunk)."""
        name, clock, log = node.name, time.time_ns, self

        if node.is_async:
            async def logged_async(*args: Any, **kwargs: Any) -> Any:
                if not log.on:
                    return await func(*args, **kwargs)
                start = clock()
                try:
                    value = await func(*args, **kwargs)
                except Exception:
                    log.add(name, ERROR, start, clock(), None)
                    raise
                log.add(name, END, start, clock(), None)
                return value
            return logged_async

        def logged(*args: Any, **kwargs: Any) -> Any:
            if not log.on:
                return func(*args, **kwargs)
            start = clock()
            try:
                value = func(*args, **kwargs)
            except Exception:
                log.add(name, ERROR, start, clock(), None)
                raise
            log.add(name, END, start, clock(), None)
            return value
        return logged

    def cached(self, name: str, key: bytes, item: int | None) -> None:
        """The plan's cache-hit hook."""
        if self.on:
            now = time.time_ns()
            self.add(name, CACHED, now, now, key.hex() if isinstance(key, bytes) else str(key))

    def add(self, name: str | None, code: int, start: int, end: int, detail: Any) -> None:
        records = self.records.get(self.item)
        if records is None:
            records = self.records[self.item] = []
        records.append((name, code, start, end, detail))

    def run(self, run: Callable[[dict[str, Any], int], Any], item: dict[str, Any], i: int) -> Any:
        """`run(item, i)` as item i, its own span logged around the node records."""
        self.item = i
        if not self.on:
            return run(item, i)
        start = time.time_ns()
        try:
            return run(item, i)
        finally:
            self.add(None, ITEM, start, time.time_ns(), self.pid)

    def take(self) -> dict[int, list[Record]] | None:
        """The records gathered so far, by item (None when not logging), and a fresh start."""
        if not self.on:
            return None
        records, self.records = self.records, {}
        return records


LOG = NodeLog()  # one per process: the plans built in a worker share it
