"""Running a chunk of items in the worker: item after item through the compiled plan, or group
after group through a batched plan (`hardy.parts.batching`), the status words saying which item and
step run, results sent in batches as they come (`replies.REPLIES`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from ..errors import CudaError, NodeError, PipelineRefused
from ..observe.nodelog import BATCHED, CACHED, FAILED, LOG, RAISED, SPAN, WAIT
from ..observe.nodelog import ITEM as BEGINS
from ..observe.nodelog import STEP as STEP_NAMED
from ..parts.batching import Batched, batched
from ..plan.columns import built
from ..plan.compiled import Plan
from ..shipping import open_input, portable, unopened
from ..shipping.replica import Refusal
from .lifeline import ZOMBIES_MAX, retiring
from .replies import REPLIES
from .status import BATCH, FLUSH_EVERY, IDLE, NO_STEP, OPENING, StatusWords


class Span(NamedTuple):
    """Consecutive items from `first` (a chunk's short forms, `Chunk.wire`): the values of the one
    input mapped over, `over`, the others being `constants`; or, `over` None, each item's inputs."""

    first: int
    constants: dict[str, Any]
    over: str | None
    values: Sequence[Any]

    def pairs(self) -> Iterable[tuple[int, dict[str, Any]]]:
        """The items as (index, inputs) pairs."""
        if self.over is None:
            return enumerate(self.values, self.first)
        return enumerate(built(self.constants, self.over, self.values), self.first)


def run_chunk(loaded: tuple[Plan, dict[str, str]] | str, items: Iterable[tuple[int, dict[str, Any]]] | Span,
              status: StatusWords, log: bool, sealed: int = 0, singly: bool = False) -> bool:
    """Run the items, (index, inputs) pairs or a `Span` (which a plain plan runs in its own loop,
    `Plan.each`); `log`: their node calls are logged and each batch carries its log
    (observe/nodelog.py); `sealed`: the chunk is sent again after it could not be unpickled whole,
    so each item's inputs are opened one by one (`open_item`), and, 2, after its results could not be
    pickled without a crash: each result is then sent alone; `singly`: a batched node is called
    for one item at a time. False when the worker must retire: after a sticky CUDA error every
    later CUDA call here would fail, so the rest of the chunk goes back to the parent unrun; or,
    before the chunk, when it holds too many exited processes nobody collects (`lifeline.retiring`)."""
    REPLIES.sent.clear()
    REPLIES.names = None
    clock = time.monotonic
    start = last = clock()
    if _retiring(start):
        return False
    each = _own_loop(loaded, items, log)
    if each is not None:
        return _run_each(each, loaded, items, status, start)  # type: ignore[arg-type]
    items = items.pairs() if isinstance(items, Span) else items
    if isinstance(loaded, str):  # it could not be loaded here, or was refused (`shipping.replica.Refusal`)
        cls = PipelineRefused if isinstance(loaded, Refusal) else NodeError
        REPLIES.producers = {}
        REPLIES.send([(i, False, cls("<pipeline>", None, i, loaded)) for i, _ in items], True)
        return True
    plan, REPLIES.producers = loaded
    if log:
        REPLIES.names = tuple(s.node.name for s in plan.steps)
    group = batched(plan)
    if group is not None:
        items = list(items)
        if sealed:  # opened first; an input that cannot be fails its item (sent with the first results)
            items = _open_all(plan, items, status)
        return _run_batched(group, plan, items, status, 1 if singly else group.group, log)
    named = log and names_steps(plan)
    note = LOG.data.extend if named else None  # bare: items begin with a node call
    batch = REPLIES.unsent
    run, append = plan.run, batch.append
    for i, item in items:
        now = clock()  # one clock read: when the last batch went, and when this item began
        if (now - last >= FLUSH_EVERY or sealed == 2) and batch:
            REPLIES.send(batch, False)
            last = now = clock()
        status.step = NO_STEP
        status.item = i
        if sealed or note:
            item = _begin(plan, i, item, status, sealed, note, now)
            if isinstance(item, NodeError):
                append((i, False, item))
                continue
        try:
            append((i, True, run(item, i)))
        except NodeError as err:  # a node's call that raised logged it (an error between calls is no node's)
            if _failed(err, i, batch, status, log, named, now):
                return False
        status.item = IDLE
    if plan.cache is not None:
        plan.cache.report()  # the cache faults of this batch, in one warning
    REPLIES.send(batch, True, clock() - start)
    return True


def _retiring(now: float) -> bool:
    """Whether the worker must retire before its next chunk (its items go back unrun, to a fresh
    worker): it holds too many exited processes. A question to the kernel, so not before every
    small chunk."""
    if now < _CHECKED[0] + RETIRE_CHECK:
        return False
    _CHECKED[0] = now
    if not retiring(os.getpid()):
        return False
    REPLIES.retire(f"it held {ZOMBIES_MAX} or more exited processes that its nodes' processes left behind, "
                   "which only its end collects")
    return True


def _own_loop(loaded: tuple[Plan, dict[str, str]] | str, items: Iterable[tuple[int, dict[str, Any]]] | Span,
              log: bool) -> Callable[..., Any] | None:
    """The plan's own loop for `items` (`Plan.each`): for a `Span` through a plain plan whose node
    calls are not logged."""
    if not isinstance(items, Span) or isinstance(loaded, str) or log:
        return None
    return loaded[0].each(items.over)


def _run_each(each: Callable[..., Any], loaded: tuple[Plan, dict[str, str]], span: Span, status: StatusWords,
              start: float) -> bool:
    """`run_chunk` for a plain plan (`Plan.marks`): its own loop runs the items (`Plan.each`),
    their outputs appended to `REPLIES.outs` (a list per output), and comes back here when a
    batch of results is due or an item failed; a batch goes when it is due, as in `run_chunk`."""
    plan, REPLIES.producers = loaded
    columns = REPLIES.start_outs(span.first, plan.outputs)
    values, clock, last, i = iter(span.values), time.monotonic, start, span.first
    while (stopped := each(values, span.constants, i, columns, last + FLUSH_EVERY)) is not None:
        i, err = stopped
        if err is not None:
            REPLIES.to_rows()  # (a batch with a failure is rows)
            REPLIES.first = i + 1  # (`outs` go on from the next item)
            if _failed(err, i, REPLIES.unsent, status, False, False, 0.0):  # (its error made portable: its code)
                return False
            status.item = IDLE
            i += 1
        if clock() - last >= FLUSH_EVERY and (REPLIES.unsent or REPLIES.pending()):
            REPLIES.send(REPLIES.unsent, False)
            last = clock()
    REPLIES.send(REPLIES.unsent, True, clock() - start)
    return True


def _begin(plan: Plan, i: int, item: Any, status: StatusWords, sealed: int, note: Any, now: float) -> Any:
    """Item i's inputs, opened one by one when its chunk was sealed (or the error naming the one that
    cannot be); its beginning noted in the node log (`note`)."""
    if sealed:
        item = open_item(plan, i, item, status)
        if isinstance(item, NodeError):
            return item
    if note:
        note((BEGINS, now))  # an item begins (nodelog.py)
    return item


def _failed(err: NodeError, i: int, batch: list[Any], status: StatusWords, log: bool, named: bool, now: float) -> bool:
    """Item i failed (`err`); True when the worker must retire (a sticky CUDA error), its batch sent."""
    if log:
        LOG.failed(None if named or status.step >= 0 else now)
    batch.append((i, False, portable(err)))
    if isinstance(err, CudaError) and err.retires_worker:
        status.item = IDLE
        REPLIES.send(batch, False)
        return True
    return False


RETIRE_CHECK = 0.005  # seconds: how often, at most, a worker asks whether it must retire (`lifeline.retiring`)
_CHECKED = [0.0]  # when it last asked


def _open_all(plan: Plan, items: list[tuple[int, dict[str, Any]]], status: StatusWords) -> list[tuple[int, Any]]:
    """A sealed chunk's items opened before a batched plan runs them; one that cannot be opened
    fails alone (its error goes with the first results)."""
    opened = []
    for i, item in items:
        status.item = i
        value = open_item(plan, i, item, status)
        if isinstance(value, NodeError):
            REPLIES.unsent.append((i, False, value))
        else:
            opened.append((i, value))
    status.item = IDLE
    return opened


def _run_batched(group: Batched, plan: Plan, items: list[tuple[int, dict[str, Any]]], status: StatusWords, size: int,
                 log: bool) -> bool:
    """`run_chunk` for a plan with batched nodes (`hardy.parts.batching`): the status words name the
    item running, or BATCH and the node while a batch call runs; a group's results are sent as
    soon as they exist, so a crash in a later batch costs none of them. `log`: node events are
    logged (`Arranged`)."""
    clock = time.monotonic
    start = last = clock()
    batch = REPLIES.unsent
    arranged = Arranged() if log else None

    def at(i: int, span: tuple[float, float] | None = None) -> None:
        status.step = NO_STEP
        status.item = i
        if arranged is not None:
            arranged.at(i, span)

    def calling(k: int) -> None:
        if arranged is not None:
            arranged.flush()
        status.item = BATCH
        status.step = k
        status.step_start = clock()

    if arranged is not None:
        for row in batch:  # sealed items that could not be opened: logged first, as their rows are sent
            arranged.ended(row[0])
    try:
        for i, ok, value in group.run(items, at, calling, size=size,
                                      called=arranged.called if arranged is not None else None):
            if arranged is not None:
                arranged.ended(i)
            batch.append((i, True, value) if ok else (i, False, portable(value)))
            if not ok and isinstance(value, CudaError) and value.retires_worker:
                status.item = IDLE
                REPLIES.send(batch, False)
                return False
            now = clock()
            if now - last >= FLUSH_EVERY:
                REPLIES.send(batch, False)
                last = clock()
            if arranged is not None:
                arranged.mark = REPLIES.complete = len(LOG.data)
    finally:
        REPLIES.complete = None
    status.item = IDLE
    if plan.cache is not None:
        plan.cache.report()
    REPLIES.send(batch, True, clock() - start)
    return True


def _details(entries: list[float], base: int) -> list[tuple[int, Any]]:
    """(where, the detail) of each entry of a logged part naming one of `LOG.details` (what a
    node raised, a cache hit's signature), `base` added to where: an item's entries wait for its
    end, and the details they name are taken with each batch of results sent meanwhile."""
    found, p = [], 0
    while p < len(entries):
        code = entries[p]
        if code == RAISED:
            found.append((base + p + 2, LOG.details[int(entries[p + 2])]))
        elif code == CACHED:
            found.append((base + p + 1, LOG.details[int(entries[p + 1])]))
        elif code == SPAN and entries[p + 2]:
            found.append((base + p + 2, LOG.details[int(entries[p + 2]) - 1]))
        p += 1 if code >= 0 else 3 if code in (STEP_NAMED, RAISED) else 5 if code == SPAN else 2
    return found


class Arranged:
    """The node log of a batched plan's chunk, item by item. Its items wait for each other at each
    batched node, so their node calls interleave; the log (observe/nodelog.py) wants each item's
    calls together, in the order the items' rows are sent. So what an item's plans log is moved
    aside as it runs (`at`, `flush`) and written whole when the item's outcome is (`ended`):
    `ITEM` its start, its steps named, `WAIT` where each part of it ends, the batch calls made
    since the last item written (`BATCH`: the node's step, its items, start and end), `FAILED`
    (ends the item, failed or not). The batched node's own step, for an item, lasts the item's
    share of the call that computed it (`hardy.parts.batching`)."""

    def __init__(self) -> None:
        self.items: dict[int, list[float]] = {}
        self.kept: dict[int, list[tuple[int, Any]]] = {}  # per item: (where in its entries, a detail it names)
        self.current: int | None = None
        self.span: tuple[float, float] | None = None
        self.mark = REPLIES.complete = len(LOG.data)
        self.calls: list[tuple[int, int, float, float]] = []

    def flush(self) -> None:
        """What the item running logged since it began its part, moved to its own entries."""
        data, mark = LOG.data, self.mark
        entries = self.items.get(self.current) if self.current is not None else None
        if entries is not None and len(data) > mark:
            moved = data[mark:]
            if self.span is not None and moved[0] == STEP_NAMED:  # the batched node: its share of the call
                moved[2] = self.span[0]
                if len(moved) > 3 and moved[3] == RAISED:
                    moved[4] = self.span[1]
            self.kept.setdefault(self.current, []).extend(_details(moved, len(entries)))  # type: ignore[arg-type]
            entries += moved
            entries += (WAIT, self.span[1] if self.span is not None else time.monotonic())
        del data[mark:]
        self.current, self.span = None, None

    def at(self, i: int, span: tuple[float, float] | None) -> None:
        self.flush()
        if i not in self.items:
            self.items[i] = [BEGINS, time.monotonic()]
        self.current, self.span = i, span

    def called(self, k: int, n: int, start: float, end: float) -> None:
        self.calls.append((k, n, start, end))

    def ended(self, i: int) -> None:
        """Item i's outcome is out: its entries (and the calls made since the last) into the log."""
        self.flush()
        now = time.monotonic()
        entries = self.items.pop(i, None) or [BEGINS, now]
        for at, detail in self.kept.pop(i, ()):  # the log's details may have been sent since: kept again
            LOG.details.append(detail)
            entries[at] = len(LOG.details) - 1 + (entries[at - 2] == SPAN)
        data = LOG.data
        data += entries[:2]
        for k, n, start, end in self.calls:
            LOG.details.append(n)
            data += (BATCHED, k, len(LOG.details) - 1, start, end)
        self.calls.clear()
        data += entries[2:]
        data += (FAILED, now)
        self.mark = REPLIES.complete = len(data)


def open_item(plan: Plan, i: int, item: Any, status: StatusWords) -> Any:
    """A sealed item's inputs, each unpickled on its own (STEP says which, should one crash the
    worker); the error naming the input that cannot be."""
    parts = list(item.items()) if isinstance(item, dict) else [(None, item)]
    opened = {}
    for k, (name, value) in enumerate(parts):
        status.step = OPENING - k
        try:
            value = open_input(value)
        except Exception as exc:  # whatever a __setstate__ raises
            return unopened(plan, i, name, item[name] if name is not None else item, exc)
        if name is None:  # a whole item, as an engine's task shipped it (`shipping.Pickled`)
            status.step = NO_STEP
            return value
        opened[name] = value
    status.step = NO_STEP
    return opened


def names_steps(plan: Plan) -> bool:
    """Whether the log of `plan` names its steps and its items: in a bare log, a start time is
    the item's next step, and the first one the item's beginning (observe/nodelog.py)."""
    return plan.cache is not None or not plan.steps or any(s.node.is_async or s.node.batch for s in plan.steps)
