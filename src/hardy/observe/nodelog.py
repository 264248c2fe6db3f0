"""Node events recorded where nodes run (a worker process) and carried back with the results they
belong to.

A worker cannot call the parent's callbacks, so when the parent listens to node events it asks the
worker for a *logged* plan: the same plan, each node call also noting its step and start time.
A fast map delivers hundreds of thousands of node events a second, and on a small machine the
parent and its workers share the cores: what each does per event is as little as can be:

- while items run, one flat list of integers. A node call appends its start time t (the
  worker's monotonic clock, read anyway to date the step for the parent's deadlines): it is the
  item's next step, and it ends where the next entry begins, so one integer and one clock read
  per call are all it costs. An item appends `ITEM, t` as it begins, which also ends the item
  before it; the worker appends `PAUSE, t` before it sends. Items are not named: they ran in the
  order of the batch's rows, which say which items they are. The rare cases write more, after
  their code (a negative number: a time never is one): `RAISED, t, d` (the node running raised
  `details[d]`; a retry of it is the same step again), `STEP, k, t` (step k starts: a plan with a cache, whose hits
  are looked up before its misses run, or with async nodes, names its steps), `CACHED, d` (the
  step just named was answered from the cache, its signature is `details[d]`), `SPAN, k, e,
  start, end` (an async node, whose calls may overlap, written whole when it ends; e is 0, or
  1 + the index of what it raised in `details`);
- each batch of results travels with the list as an array (`Records`: a byte string to pickle);
  the parent cuts it into one array per field (`Records.events`, by slicing where it can) and
  its replay (`Events.replay` in callbacks.py) walks them in one loop, just before it delivers
  the batch's results.

Callbacks so see an item's node events in order, between its `on_map_item_start` and
`on_map_item_end`, with the durations measured in the worker; wall-clock nanoseconds (the worker's
clock plus one offset per batch) let OpenTelemetry spans and the report's timeline show when
things really happened. When nobody listens, the worker runs the plain plan: nothing is logged.
"""

from __future__ import annotations

import os
import pickle
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..node import Node

ITEM, PAUSE, RAISED, CACHED, SPAN, STEP = -1, -2, -3, -4, -5, -6  # codes of the entries that are not a bare start
END, ERROR = 0, 1  # a decoded event's code: a node's end or error, its cache hit (CACHED), an item's span (ITEM)


class Records:
    """The node log of some items that ran in one process, as it travels: the log (the worker's
    list, as an array: one byte string to pickle), the plan's node names by step, the cache hits'
    signatures, the offset that turns the worker's monotonic nanoseconds into wall-clock ones, and
    the worker's pid. The parent decodes it (`events`), by slicing where it can."""

    __slots__ = ("names", "data", "details", "offset", "pid", "_events")

    def __init__(self, names: tuple[str, ...], data: array[int], details: list[Any], offset: int, pid: int):
        self.names, self.data, self.details, self.offset, self.pid = names, data, details, offset, pid
        self._events: Events | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        return Records, (self.names, self.data, self.details, self.offset, self.pid)

    def events(self) -> Events:
        """The log decoded (once), items numbered in the order they ran. A batch where every item
        ran every node once, in order (no cache hit, no failure, no async node: a fast map's usual
        batch) is cut by slicing, in C; any other entry by entry. (Each entry that begins where
        that regular layout has one holds what the layout expects, an ITEM code or a time: so,
        entry by entry from the first, the log is that.)"""
        if self._events is None:
            data, steps = self.data, len(self.names)
            width = 2 + steps
            n = (len(data) - 2) // width
            if (n and steps and len(data) == n * width + 2 and data[0::width].count(ITEM) == n
                    and all(min(data[2 + k::width]) >= 0 for k in range(steps))):
                self._events = _regular(data, n, width, steps)
            else:
                self._events = _decoded(data.tolist(), self.details)
        return self._events

    def raised(self) -> bool:
        """Whether a node raised (rather than the process dying in it)."""
        codes = self.events().codes
        return codes is not None and ERROR in codes

    def split(self) -> list[Records]:
        """Each item's log alone, in the order they ran (for a sink that passes items on one by one)."""
        data, out = self.data, []
        begins = [p for p, code in enumerate(data) if code == ITEM]  # only codes are negative
        for p, q in zip(begins, [*begins[1:], len(data) - 2]):
            out.append(Records(self.names, data[p:q] + array("q", (PAUSE, data[q + 1])), self.details, self.offset,
                               self.pid))
        return out


class Events:
    """A log decoded: per event its item (its place in the order they ran), node (`steps`,
    indices into the names), code (None: all END), start and end (the worker's nanoseconds), and
    for a cache hit its signature and for an error what was raised (`details`, by event); item r ran from `bounds[r]` to
    `bounds[r + 1]`. `regular`: every item ran every node once, in order."""

    __slots__ = ("items", "steps", "codes", "starts", "ends", "details", "bounds", "regular")

    def __init__(self) -> None:
        self.items: Sequence[int] = array("q")
        self.steps, self.starts, self.ends = array("h"), array("q"), array("q")
        self.codes: array[int] | None = None
        self.details: dict[int, Any] = {}
        self.bounds = array("q")
        self.regular = False

    def add(self, item: int, step: int, code: int, start: int, end: int, detail: Any = None) -> None:
        if code != END and self.codes is None:
            self.codes = array("b", bytes(len(self.steps)))
        if self.codes is not None:
            self.codes.append(code)
        if detail is not None:
            self.details[len(self.steps)] = detail
        self.items.append(item)  # type: ignore[attr-defined]  # an array, where decoded entry by entry
        self.steps.append(step)
        self.starts.append(start)
        self.ends.append(end)


def _regular(data: array[int], n: int, width: int, steps: int) -> Events:
    out = Events()
    out.regular = True
    out.bounds = data[1::width]  # each item's begin, then PAUSE's time: an item ends where the next begins
    if steps == 1:
        out.items, out.starts, out.ends = range(n), data[2::width], out.bounds[1:]
        out.steps = array("h", bytes(2 * n))
        return out
    for field in ("items", "starts", "ends"):  # item by item, node by node
        setattr(out, field, array("q", bytes(8 * n * steps)))
    for k in range(steps):  # node k ends where node k + 1 (or the next item) begins
        out.items[k::steps] = array("q", range(n))  # type: ignore[index]
        out.starts[k::steps] = data[2 + k::width]
        out.ends[k::steps] = data[3 + k::width] if k < steps - 1 else out.bounds[1:]
    out.steps = array("h", range(steps)) * n
    return out


def _decoded(data: list[int], details: list[Any]) -> Events:
    out = Events()
    for event in _entries(data):
        if event[2] == ITEM:
            out.bounds[-1:] = array("q", (event[3], event[4]))
        else:
            out.add(*event[:5], None if event[5] is None else details[event[5]])
    return out


def _entries(data: list[int]) -> Iterator[tuple[int, int, int, int, int, int | None]]:
    """(item, step, code, start, end, detail) per event of an irregular log (detail: an index into
    the details, or None), and (item, ITEM, ITEM, start, end, None) per item once it is over;
    items numbered in the order they ran."""
    item = node = -1
    ran = 0
    begun = start = following = 0  # following: the step a bare start time begins
    p = 0
    while p < len(data):
        code = data[p]
        if code == CACHED:
            yield item, node, CACHED, start, start, data[p + 1]
            node, p = -1, p + 2
            continue
        if code == SPAN:
            k, raised, s, e = data[p + 1:p + 5]
            if node >= 0:  # the sync node before it ended before it began
                yield item, node, END, start, s, None
            yield item, k, ERROR if raised else END, s, e, raised - 1 if raised else None
            node, p = -1, p + 5
            continue
        if code >= 0:  # a bare start time
            k, t, width = following, code, 1
        elif code == STEP:
            k, t, width = data[p + 1], data[p + 2], 3
        else:  # ITEM, PAUSE or RAISED: a time (and what was raised)
            k, t, width = -1, data[p + 1], 3 if code == RAISED else 2
        if node >= 0:
            yield item, node, ERROR if code == RAISED else END, start, t, data[p + 2] if code == RAISED else None
            if code == RAISED:
                following = node  # a retry of the step that raised is that step again
            node = -1
        if k >= 0:
            node, start, following = k, t, k + 1
        elif code != RAISED:  # ITEM or PAUSE: the item running is over
            if item >= 0:
                yield item, ITEM, ITEM, begun, t, None
            item, begun, following = (ran, t, 0) if code == ITEM else (-1, 0, 0)
            ran += code == ITEM
        p += width


def one_by_one(rows: Sequence[tuple[Any, ...]], unsent: dict[int, Any], records: Records | None,
               ok: Callable[[int, dict[str, Any], Sequence[Records]], None]) -> list[tuple[Any, ...]]:
    """A worker's batch for a sink whose `ok` sees each success alone, with its item's own log:
    each row's item leaves `unsent`; the failures are returned, each with its log."""
    logs, failed = records.split() if records is not None else [], []
    for r, row in enumerate(rows):
        unsent.pop(row[0], None)
        log = logs[r] if r < len(logs) else None
        if row[1]:
            ok(row[0], row[2], (log,) if log else ())
        else:
            failed.append((*row, (log,)) if log else row)
    return failed


class NodeLog:
    """The log of the items run in this process since it was last taken."""

    def __init__(self) -> None:
        self.data: list[int] = []
        self.details: list[Any] = []  # cache hits' signatures, what nodes raised
        self.steps: dict[str, int] = {}  # node name -> step, of the logged plan being built

    def note(self, k: int, node: Node, func: Callable[..., Any]) -> Callable[..., Any]:
        """`func` (step k's), noting its calls: for a sync node, the caller (the worker) writes
        its start itself, where it reads the clock anyway; an async node's calls may overlap, so
        each is written whole when it ends."""
        self.steps[node.name] = k
        if not node.is_async:
            return func
        add, clock, log = self.data.extend, time.monotonic_ns, self

        async def logged(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                value = await func(*args, **kwargs)
            except BaseException as exc:  # cancelled at its timeout too
                add((SPAN, k, 1 + log.kept(exc), start, clock()))
                raise
            add((SPAN, k, 0, start, clock()))
            return value
        return logged

    def cached(self, name: str, key: bytes, item: int | None) -> None:
        """The logged plan's cache-hit hook."""
        self.details.append(key.hex() if isinstance(key, bytes) else str(key))
        self.data += (STEP, self.steps[name], time.monotonic_ns(), CACHED, len(self.details) - 1)

    def raised(self, exc: BaseException) -> None:
        """The node running raised `exc` (its item fails, or the node's policy retries it)."""
        self.data += (RAISED, time.monotonic_ns(), self.kept(exc))

    def kept(self, exc: BaseException) -> int:
        """Where `exc` is kept in the details, to travel with the log: itself where it can be
        pickled (callbacks see what the node raised, also for an attempt that was retried), else
        its text."""
        try:
            pickle.dumps(exc)
        except Exception:
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        self.details.append(exc)
        return len(self.details) - 1

    def take(self, names: tuple[str, ...], ended: int | None = None) -> Records | None:
        """The log since the last call (None if empty), its last item ended now; `ended`: how many
        of its items ended (a dying worker's last words may come mid-item: the entries of the
        item running died with it)."""
        data = self.data
        if ended is not None and data.count(ITEM) > ended:  # that item ends where it began
            last = len(data) - 1 - data[::-1].index(ITEM)  # only codes are negative
            now, data[last:] = data[last + 1], []
        else:
            now = time.monotonic_ns()
        if not data:
            return None
        data += (PAUSE, now)
        records = Records(names, array("q", data), self.details, time.time_ns() - time.monotonic_ns(), os.getpid())
        data.clear()
        self.details = []
        return records


LOG = NodeLog()  # one per process: every logged plan built here records into it


def died(pid: int) -> Records:
    """The log of an item whose worker `pid` died running it: only the item's own (its node
    records died with the worker); the caller reports the node it died in."""
    now = time.time_ns()
    return Records((), array("q", (ITEM, now, PAUSE, now)), [], 0, pid)
