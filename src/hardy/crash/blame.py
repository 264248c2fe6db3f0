"""Whose fault a death in a Python thread is, and who started that thread.

A worker runs its items in its main thread. A crash in another Python thread (a prefetch or I/O
thread that an earlier item's node started, one started while the plan loaded) is not the fault of
the item in flight: the dying thread names itself in the fault record and notes what was in flight
when it was started (`lines.thread_line`, `lines.watch_threads`). `elsewhere` decides what such a
death means: the worker's items run again, none blamed, with a warning, up to `MAX_THREAD_RERUNS`
times for the item it holds first; after that the item is charged (`verdict.charge` names the
thread and the count: `thread_clause`), so this never loops. A native thread (an OpenMP team) and a
thread running the plan's code work for the node running now: their crash is the node's.
`after_return` is what a record says of a death outside any item.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .autopsy import Ending, examine
from .doing import BATCH, IDLE

MAX_THREAD_RERUNS = 3  # times an item runs again after crashes in threads it did not start, before it fails


@dataclass(frozen=True)
class Map:
    """The map a worker ran when it died, as a thread's record refers to it: its steps' node names,
    in order, and when it began (`time.monotonic()`; a thread started before was an earlier map's)."""

    steps: Sequence[str] = ()
    began: float = 0.0


@dataclass(frozen=True)
class Elsewhere:
    """A death in a thread the work in flight did not start: `first`, the item the worker held
    first, was spared so `times` times now; `warning`, what the run logs as its items run again,
    none blamed ("" once `times` passes `MAX_THREAD_RERUNS`: then `first` is charged)."""

    first: int
    times: int
    warning: str

    @property
    def rerun(self) -> bool:
        """The worker's items run again, none blamed; else `first` is charged (`verdict.charge`)."""
        return self.times <= MAX_THREAD_RERUNS


def started_by(thread: Mapping[str, Any], run: Map) -> str:
    """Who started a thread, as `lines.thread_line` noted it: `started by item 0, in node 'f'` of
    `run`; of an earlier map or run, item and node are that one's, so the node is not named."""
    item, step, _, when = thread.get("started") or [IDLE, -1, 0.0, 0.0]
    steps = run.steps if when >= run.began else ()
    node = f", in node {steps[int(step)]!r}" if 0 <= step < len(steps) else ""
    earlier = "" if when >= run.began else " of an earlier map or run on this worker"
    if item >= 0:
        return f"started by item {int(item)}{earlier}{node}"
    if item == BATCH:
        return f"started by a batch call{earlier}{node}"
    return "started outside any item (while the worker loaded a pipeline, or between items)"


def elsewhere(end: Ending, item: int, step_start: float, unsent: Sequence[int], blamed: Mapping[int, int],
              run: Map) -> Elsewhere | None:
    """Whether the worker, running `item` (a status word: `doing.BATCH` for a batched call, whose
    step began at `step_start`) with the items `unsent` not answered yet, died in a Python thread
    that work did not start; `blamed`: the times each item was spared so before. None when the
    crash is the work's own: in the main thread, a thread running the plan's code, a native thread
    (none of which the record names), or a thread the item in flight (or the batch call) started."""
    thread = end.record.thread
    if thread is None or end.killed_for or not unsent:
        return None
    started = thread.get("started") or [IDLE, -1, 0.0, 0.0]
    if started[3] >= run.began and (item >= 0 and started[0] == item or item == BATCH and started[0] == item
                                    and started[2] == step_start):
        return None
    first = item if item in unsent else unsent[0]
    times = blamed.get(first, 0) + 1
    if times > MAX_THREAD_RERUNS:
        return Elsewhere(first, times, "")
    step = int(started[1]) if started[3] >= run.began else -1
    death = examine(end.record, end.signal, end.reason, run.steps[step] if 0 <= step < len(run.steps) else "?",
                    end.record.threads)
    return Elsewhere(first, times, (
        f"a worker died in thread {thread['name']!r} ({started_by(thread, run)}), not in the work in flight: "
        f"{death.reason}. Item(s) {', '.join(map(str, unsent))} run again, not blamed ({times} of "
        f"{MAX_THREAD_RERUNS})" + (f"\nnative stack:\n{death.native_stack}" if death.native_stack else "")))


def thread_clause(end: Ending, run: Map, times: int) -> str:
    """What an item's crash says of the Python thread it died in (`, in thread 'x' (started by
    ...)`), with the `times` it was spared so before; "" for the plan's own threads or a kill."""
    thread = end.record.thread if not end.killed_for else None
    if thread is None:
        return ""
    return f", in thread {thread['name']!r} ({started_by(thread, run)})" + (
        f", {times} time(s) while this item ran" if times else "")  # its own, or one that kept coming


def after_return(end: Ending, run: Map) -> str:
    """What a fault record says of a death outside any item, as lines to add to a warning: the
    thread it died in and who started it, the diagnosis (a crash at exit, in which library) and the
    native stack."""
    death = examine(end.record, end.signal, end.reason, "?", "", after_return=True)
    thread = end.record.thread
    return (f"\nin thread {thread['name']!r} ({started_by(thread, run)})" if thread else "") + "".join(
        f"\ndiagnosis: {d}" for d in death.diagnosis) + (
        f"\nnative stack:\n{death.native_stack}" if death.native_stack else "")
