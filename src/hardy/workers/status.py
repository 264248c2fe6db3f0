"""A worker's status words: what it is doing, readable by the parent at any moment, even after
the worker died.

A small shared mapping of doubles, written by the worker and read by the parent after a death
(which item, which step, since when) or for deadlines. Doubles, because the step's start is
`time.monotonic()`, the clock of the node log (observe/nodelog.py); the item and the step are
small integers, exact in a double. READY turns 1 once the worker is set up (so a death before is
its setup's: preload_libs, the environment; a death after never is). Between items, ITEM says
what the worker does: IDLE, READING a message (a chunk's items are unpickled then), or SENDING
results (pickled then), and STEP how many results that batch holds. DEADLINE: the deadline of a
node nested in a step (crash.containment.deadlined), for the parent to enforce.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable
from typing import Any

from ..observe.nodelog import LOG
from ..observe.nodelog import STEP as STEP_NAMED

ITEM, STEP, STEP_START, READY, DEADLINE, SLOTS = 0, 1, 2, 3, 4, 5
IDLE, READING, SENDING, LOADING = -1, -3, -4, -5  # LOADING: the pipeline, its nodes' modules
BATCH = -2  # ITEM while a batched node's call runs: the parent splits the batch if the worker dies
OPENING = -2  # STEP while a sealed item's input k is unpickled: OPENING - k (ITEM is the item)
STATUS_SIZE = 8 * SLOTS
FLUSH_EVERY = 0.005  # seconds: fast items are batched, slow items are reported one by one
RETIRED = 75  # the exit code of a worker that left after a sticky CUDA error (or a GPU OOM to retry)


def open_status(fd: int) -> tuple[mmap.mmap, Any]:
    """The status words in the memfd `fd`, as doubles (a memoryview: the cheapest store Python has)."""
    mm = mmap.mmap(fd, STATUS_SIZE)
    return mm, memoryview(mm).cast("d")


def marked(status: Any, k: int, func: Callable[..., Any], log: list[float] | None = None,
           named: bool = False, dated: bool = True) -> Callable[..., Any]:
    """`func`, naming its step in the status words at each call (for the parent's crash reports)
    and, `dated`, when it began (for its deadlines and stall reports: a plan with a timeout, or a
    pool with `stall_report`); `log`: also noted in the node log (observe/nodelog.py), with the
    same clock read, as a bare start time (the item's next step) or, `named`, with its step.
    A plain plan names its steps in its own code instead (`inline`)."""
    clock = time.monotonic

    if log is None and not dated:
        def named_only(*args: Any, **kwargs: Any) -> Any:
            status[STEP] = k
            return func(*args, **kwargs)
        return named_only
    if log is None:
        def call(*args: Any, **kwargs: Any) -> Any:
            status[STEP] = k
            status[STEP_START] = clock()
            return func(*args, **kwargs)
        return call
    note: Callable[[float], None] = log.append
    if named:
        def note(now: float) -> None:
            log.extend((STEP_NAMED, k, now))

    def logged(*args: Any, **kwargs: Any) -> Any:
        status[STEP] = k
        status[STEP_START] = now = clock()
        note(now)
        try:
            return func(*args, **kwargs)
        except BaseException as exc:  # an attempt its node's policy may retry: the log says it raised
            LOG.raised(exc)
            raise
    return logged
