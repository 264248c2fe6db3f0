"""Node events recorded where nodes run (a worker process) and carried back with the results they
belong to.

A worker cannot call the parent's callbacks, so when the parent listens to node events it asks the
worker for a *logged* plan: the same plan, each node call also noting its step and start time.
A fast map delivers hundreds of thousands of node events a second, and on a small machine the
parent and its workers share the cores: what each does per event is as little as can be:

- while items run, one flat list of numbers. A node call appends its start time t (the
  worker's `time.monotonic()`, read anyway to date the step for the parent's deadlines): it is
  the item's next step, and it ends where the next entry begins, so one number and one clock
  read per call are all it costs. An item begins with its first node call: a start time after
  the item running has started every step begins the next item (and ends the one before). The
  worker appends `PAUSE, t` before it sends. Items are not named: they ran in the order of the
  batch's rows, which say which items they are. The rare cases write more, after their code (a
  negative integer: a time never is one): `RAISED, t, d` (the node running raised `details[d]`;
  a retry of it is the same step again), `FAILED, t` (the item running failed: it ends), `ITEM,
  t` (an item begins: one that failed before any node call, and every item of a plan that names
  its steps), `STEP, k, t` (step k starts: a plan with a cache, whose hits are looked up before
  its misses run, or with async nodes, names its steps), `CACHED, d` (the step just named was
  answered from the cache, its signature is `details[d]`), `SPAN, k, e, start, end` (an async
  node, whose calls may overlap, written whole when it ends; e is 0, or 1 + the index of what it
  raised in `details`), `WAIT, t` (the node running ends: its item waits for others at a batched
  node) and `BATCHED, k, d, start, end` (a call of batched step k on `details[d]` items: a plan
  with batched nodes writes each item whole once it is over, `workers.chunks.Arranged`);
- each batch of results travels with the list as an array of doubles (`NodeLogBatch`: a byte string
  to pickle); the parent cuts it into one array per field (`NodeLogBatch.events`, by slicing where it
  can) and its replay (`Events.replay` in events.py) walks them in one loop, just before it
  delivers the batch's results.

Why seconds as floats, not nanoseconds as integers: a nanosecond count is a two-digit Python
int, and reading an event's two times and dividing their difference by 1e9 costs the parent
45 ns per event; as seconds, the duration is one float subtraction, 21 ns. The worker's list of
floats also becomes an array twice as fast. A double has 53 bits: a nanosecond's resolution for
the first 97 days after the machine booted, 4 ns after a year.

Callbacks so see an item's node events in order, between its `on_map_item_start` and
`on_map_item_end`, with the durations measured in the worker; wall-clock nanoseconds (the worker's
clock plus one offset per batch) let OpenTelemetry spans and the report's timeline show when
things really happened. When nobody listens, the worker runs the plain plan: nothing is logged.
"""

from __future__ import annotations

import os
import struct
import sys
import time
from array import array
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any

from ..errors import text_of
from ..model.node import Node

ITEM, PAUSE, RAISED, CACHED, SPAN, STEP, FAILED = -1, -2, -3, -4, -5, -6, -7  # the entries that are not a bare start
WAIT, BATCHED = -8, -9
END, ERROR = 0, 1  # a decoded event's code: a node's end or error, its cache hit (CACHED), a batch call
# (BATCHED, its items in the details), an item's span (ITEM)


class NodeLogBatch:
    """The node log of some items that ran in one process, as it travels: the log (the worker's
    list, as an array of doubles: one byte string to pickle), the plan's node names by step, the
    cache hits' signatures, the offset that turns the worker's monotonic clock into wall-clock
    nanoseconds (`_wall_offset`), and the worker's pid. The parent decodes it (`events`), by
    slicing where it can."""

    __slots__ = ("names", "data", "details", "offset", "pid", "_events")

    def __init__(self, names: tuple[str, ...], data: array[float], details: list[Any], offset: int, pid: int):
        self.names, self.data, self.details, self.offset, self.pid = names, data, details, offset, pid
        self._events: Events | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        return NodeLogBatch, (self.names, self.data, self.details, self.offset, self.pid)

    def events(self) -> Events:
        """The log decoded (once), items numbered in the order they ran. A batch where every item
        ran every node once, in order (no cache hit, no failure, no async node: a fast map's usual
        batch) is nothing but start times, as many per item as the plan has steps, then PAUSE:
        it is cut by slicing, in C. Any other is decoded entry by entry."""
        if self._events is None:
            data, steps = self.data, len(self.names)
            body = len(data) - 2
            if steps and body > 0 and body % steps == 0 and data[-2] == PAUSE and _times(data, body):
                self._events = _regular(data, body // steps, steps)
            else:
                self._events = _decoded(self.entries(), self.details, steps)
        return self._events

    def entries(self) -> list[float]:
        """The log as the worker wrote it: codes, indices and times, as floats."""
        return self.data.tolist()

    def hits(self) -> int:
        """How many node calls the cache answered: CACHED entries (no index or time is negative)."""
        return self.data.count(CACHED)

    def batches(self) -> list[tuple[str, int, float]]:
        """The batch calls logged: (node, items, seconds) each."""
        if BATCHED not in self.data:
            return []
        events = self.events()
        return [(self.names[events.steps[e]], events.details[e], events.ends[e] - events.starts[e])
                for e, code in enumerate(events.codes or ()) if code == BATCHED]

    def raised(self) -> bool:
        """Whether a node raised (rather than the process dying in it)."""
        codes = self.events().codes
        return codes is not None and ERROR in codes

    def split(self) -> list[NodeLogBatch]:
        """Each item's log alone, in the order they ran (for a sink that passes items on one by one)."""
        data = self.data
        spans = [(e[5], e[4]) for e in _entries(self.entries(), len(self.names)) if e[2] == ITEM]
        ends = [p for p, _ in spans[1:]] + [len(data) - 2]
        return [NodeLogBatch(self.names, data[p:q] + array("d", (PAUSE, end)), self.details, self.offset, self.pid)
                for (p, end), q in zip(spans, ends)]


class Events:
    """A log decoded: per event its item (its place in the order they ran), node (`steps`,
    indices into the names), code (None: all END), start and end (the worker's monotonic
    seconds), and for a cache hit its signature and for an error what was raised (`details`, by
    event); item r ran from `bounds[r]` to `bounds[r + 1]` (`spans`: when items did not run one
    after the other, each one's (start, end)). `regular`: every item ran every node once, in order."""

    __slots__ = ("items", "steps", "codes", "starts", "ends", "details", "bounds", "regular", "spans")

    def __init__(self) -> None:
        self.items: Sequence[int] = array("q")
        self.steps, self.starts, self.ends = array("h"), array("d"), array("d")
        self.codes: array[int] | None = None
        self.details: dict[int, Any] = {}
        self.bounds = array("d")
        self.spans: list[tuple[float, float]] = []
        self.regular = False

    def ran(self) -> list[tuple[float, float]]:
        """Each item's (start, end), in the order they ran."""
        bounds = self.bounds
        return self.spans or [(bounds[r], bounds[r + 1]) for r in range(len(bounds) - 1)]

    def add(self, item: int, step: int, code: int, start: float, end: float, detail: Any = None) -> None:
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


_SIGN = 7 if sys.byteorder == "little" else 0  # where a double keeps its sign: its top byte


def _times(data: array[float], n: int) -> bool:
    """Whether the first n entries are all times, none a (negative) code: each one's top byte is
    below 0x80. In C: `min()` would make a float object per entry, and cost as much as the rest
    of the decoding."""
    return data[:n].tobytes()[_SIGN::8].isascii()


def _regular(data: array[float], n: int, steps: int) -> Events:
    """A regular log's columns: its entries are the start times, item by item and node by node;
    each node ends where the next entry begins, the last at PAUSE."""
    out = Events()
    out.regular = True
    body = n * steps
    out.starts, out.ends, out.bounds = data[:body], data[1:body], data[0:body:steps]
    out.ends.append(data[-1])
    out.bounds.append(data[-1])
    if steps == 1:
        out.items, out.steps = range(n), array("h", bytes(2 * n))
        return out
    items = array("q", bytes(8 * body))
    for k in range(steps):
        items[k::steps] = array("q", range(n))
    out.items = items
    out.steps = array("h", range(steps)) * n
    return out


def _decoded(data: list[float], details: list[Any], steps: int) -> Events:
    out = Events()
    for event in _entries(data, steps):
        if event[2] == ITEM:
            out.bounds[-1:] = array("d", (event[3], event[4]))
            out.spans.append((event[3], event[4]))
        else:
            out.add(*event[:5], None if event[5] is None else details[event[5]])
    return out


def _entries(data: list[float], steps: int) -> Iterator[tuple[int, int, int, float, float, int | None]]:
    """(item, step, code, start, end, detail) per event of a log of a plan of `steps` steps
    (detail: an index into the details, or None), and (item, ITEM, ITEM, start, end, p) per item
    once it is over (p: where its entries begin); items numbered in the order they ran."""
    item = node = -1
    ran = begun_at = following = 0  # following: the step a bare start time begins
    begun = start = 0.0
    p = 0
    while p < len(data):
        code = data[p]
        if code == WAIT:
            if node >= 0:
                yield item, node, END, start, data[p + 1], None
                node = -1
            p += 2
            continue
        if code == BATCHED:
            yield item, int(data[p + 1]), BATCHED, data[p + 3], data[p + 4], int(data[p + 2])
            p += 5
            continue
        if code == CACHED:
            yield item, node, CACHED, start, start, int(data[p + 1])
            node, p = -1, p + 2
            continue
        if code == SPAN:
            k, raised, s, e = int(data[p + 1]), int(data[p + 2]), data[p + 3], data[p + 4]
            if node >= 0:  # the sync node before it ended before it began
                yield item, node, END, start, s, None
            yield item, k, ERROR if raised else END, s, e, raised - 1 if raised else None
            node, p = -1, p + 5
            continue
        t = code if code >= 0 else data[p + 2] if code == STEP else data[p + 1]
        if node >= 0:  # the node running ends where this entry begins
            yield item, node, ERROR if code == RAISED else END, start, t, int(data[p + 2]) if code == RAISED else None
            if code == RAISED:
                following = node  # a retry of the step that raised is that step again
            node = -1
        begins = code == ITEM or code >= 0 and (item < 0 or following == steps)
        if item >= 0 and (begins or code in (PAUSE, FAILED)):
            yield item, ITEM, ITEM, begun, t, begun_at
            item = -1
        if begins:
            item, begun, begun_at, following, ran = ran, t, p, 0, ran + 1
        if code >= 0 or code == STEP:
            node, start = following if code >= 0 else int(data[p + 1]), t
            following = node + 1
        p += 1 if code >= 0 else 3 if code in (STEP, RAISED) else 2


def row_logs(records: NodeLogBatch | None, n: int) -> list[NodeLogBatch | None]:
    """The log of each of a batch's n rows alone (None for a row with none: the batch was not
    logged, or its item did not run)."""
    logs: list[NodeLogBatch | None] = list(records.split()) if records is not None else []
    return logs[:n] + [None] * (n - len(logs))


def one_by_one(rows: Sequence[tuple[Any, ...]], unsent: MutableMapping[int, Any], records: NodeLogBatch | None,
               ok: Callable[[int, dict[str, Any], Sequence[NodeLogBatch]], None]) -> list[tuple[Any, ...]]:
    """A worker's batch for a sink whose `ok` sees each success alone, with its item's own log:
    each row's item leaves `unsent`; the failures are returned, each with its log."""
    failed = []
    for row, log in zip(rows, row_logs(records, len(rows))):
        unsent.pop(row[0], None)
        if row[1]:
            ok(row[0], row[2], (log,) if log else ())
        else:
            failed.append((*row, (log,)) if log else row)
    return failed


class NodeLog:
    """The log of the items run in this process since it was last taken."""

    def __init__(self) -> None:
        self.data: list[float] = []
        self.details: list[Any] = []  # cache hits' signatures, what nodes raised

    def note(self, k: int, node: Node, func: Callable[..., Any]) -> Callable[..., Any]:
        """`func` (step k's), noting its calls: for a sync node, the caller (the worker) writes
        its start itself, where it reads the clock anyway; an async node's calls may overlap, so
        each is written whole when it ends."""
        if not node.is_async:
            return func
        add, clock, log = self.data.extend, time.monotonic, self

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

    def cache_hook(self, steps: Mapping[str, int]) -> Callable[[str, bytes, int | None], None]:
        """A logged plan's cache-hit hook; `steps`: that plan's node names by step (a process
        runs many plans, and a node may be a different step in each)."""
        def cached(name: str, key: bytes, item: int | None) -> None:
            self.details.append(key.hex() if isinstance(key, bytes) else str(key))
            self.data += (STEP, steps[name], time.monotonic(), CACHED, len(self.details) - 1)
        return cached

    def raised(self, exc: BaseException) -> None:
        """The node running raised `exc` (its item fails, or the node's policy retries it)."""
        self.data += (RAISED, time.monotonic(), self.kept(exc))

    def kept(self, exc: BaseException) -> int:
        """Where `exc` is kept in the details, to travel with the log: itself where it comes back
        from a pickle (callbacks see what the node raised, also for an attempt that was retried),
        else its text. The round trip, because unpickling is where an exception fails: one whose
        constructor takes other arguments than it passes to Exception pickles, but cannot be
        rebuilt."""
        import pickle  # (here: `import hardy` stays light)
        try:
            pickle.loads(pickle.dumps(exc))
        except Exception:
            exc = RuntimeError(f"{type(exc).__name__}: {text_of(exc)}")
        self.details.append(exc)
        return len(self.details) - 1

    def failed(self, began: float | None) -> None:
        """The item running failed: it ends now. `began`: when it began, for an item that called
        no node (in a bare log, items begin with their first node call)."""
        now = time.monotonic()
        self.data += (FAILED, now) if began is None else (ITEM, began, FAILED, now)

    def take(self, names: tuple[str, ...], ended: int | None = None) -> NodeLogBatch | None:
        """The log since the last call (None if empty), its last item ended now; `ended`: how many
        of its items ended (a dying worker's last words may come mid-item: the entries of the
        item running died with it, and the item before ended where it began)."""
        data, now = self.data, time.monotonic()
        if ended is not None:
            items = [e for e in _entries([*data, PAUSE, now], len(names)) if e[2] == ITEM]
            if len(items) > ended:
                now, data[items[ended][5]:] = items[ended][3], []
        if not data:
            return None
        data += (PAUSE, now)
        # struct packs a list of floats 2.5 times as fast as array() converts it (no argument parsing per number)
        packed = array("d", struct.pack(f"{len(data)}d", *data))
        records = NodeLogBatch(names, packed, self.details, _wall_offset(), os.getpid())
        data.clear()
        self.details = []
        return records


LOG = NodeLog()  # one per process: every logged plan built here records into it


def died(pid: int) -> NodeLogBatch:
    """The log of an item whose worker `pid` died running it: only the item's own (its node
    records died with the worker); the caller reports the node it died in."""
    now = time.monotonic()
    return NodeLogBatch((), array("d", (ITEM, now, PAUSE, now)), [], _wall_offset(), pid)


def _wall_offset() -> int:
    """What turns this process's monotonic clock into wall-clock time: round(t * 1e9) + offset
    nanoseconds."""
    return time.time_ns() - time.monotonic_ns()
