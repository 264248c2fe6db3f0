"""A worker's status words: what it is doing, readable by the parent at any moment, even after
the worker died.

A small shared record of doubles (`StatusWords`), written by the worker and read by the parent
after a death (which item, which step, since when) or for deadlines. Doubles, because the step's
start is `time.monotonic()`, the clock of the node log (observe/nodelog.py); the item and the step
are small integers, exact in a double. `ready` turns 1 once the worker is set up (so a death before
is its setup's: preload_libs, the environment; a death after never is). Outside items, `item` says
what the worker does: IDLE, READING a message (a chunk's items are unpickled then), or SENDING
results (pickled then), and `step` how many results that batch holds (a plain plan's own loop
leaves an item named until the next begins: `Plan.each`). Those words are defined in
`crash/doing.py`, beside the crash package that reads them after a death to decide what it
means. `deadline`: the deadline of a node nested in a step (crash.containment.deadlined), for the
parent to enforce.
"""

from __future__ import annotations

import ctypes
import mmap
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from ..crash.doing import BATCH as BATCH  # what `item` says between items: the crash package reads them
from ..crash.doing import IDLE as IDLE
from ..crash.doing import LOADING as LOADING
from ..crash.doing import OPENING as OPENING
from ..crash.doing import READING as READING
from ..crash.doing import SENDING as SENDING
from ..observe.nodelog import LOG
from ..observe.nodelog import STEP as STEP_NAMED

NO_STEP = -1.0  # `step` between steps
FLUSH_EVERY = 0.005  # seconds: fast items are batched, slow items are reported one by one
RETIRED = 75  # the exit code of a worker that left after a sticky CUDA error (or a GPU OOM to retry)


class StatusWords(ctypes.Structure):
    """The words, by name, over the shared memory itself: a field read or written is one double
    there (a C descriptor, about as cheap as indexing a memoryview: they are written per item
    and per step, on the hot path). -1 in each before the worker sets it."""

    _fields_ = [("item", ctypes.c_double), ("step", ctypes.c_double), ("step_start", ctypes.c_double),
                ("ready", ctypes.c_double), ("deadline", ctypes.c_double)]
    item: float
    """The item being run (its index in the chunk's map), or IDLE, READING, SENDING, LOADING, BATCH."""
    step: float
    """The step (node) of the plan running, -1 between steps, OPENING - k, or a batch's size (SENDING)."""
    step_start: float
    """When the step began, `time.monotonic()` (for deadlines and stall reports)."""
    ready: float
    """1 once the worker is set up."""
    deadline: float
    """A nested node's deadline, monotonic (crash.containment.deadlined), -1 when none."""


SLOTS = len(StatusWords._fields_)
STATUS_SIZE = ctypes.sizeof(StatusWords)


class Marks(NamedTuple):
    """What a plain plan's own code writes in the status words (`Plan.marks`, `Plan.each`): the
    words as doubles, where the item and the step are, and what `step` says between steps. A
    store through a memoryview of doubles costs about 10 ns, a ctypes field's 20 to 25, and a
    chunk of fast items makes one per item and one per step."""

    words: memoryview[float]
    item: int
    step: int
    no_step: float


def marks(status: StatusWords) -> Marks:
    """The `Marks` of `status`: its words, the same memory seen as doubles."""
    words = memoryview(status).cast("B").cast("d")
    size = ctypes.sizeof(ctypes.c_double)
    item, step = (getattr(StatusWords, name).offset // size for name in ("item", "step"))
    return Marks(words, item, step, NO_STEP)


def open_status(fd: int) -> tuple[mmap.mmap, StatusWords]:
    """The status words in the memfd `fd`, and the mapping they live in."""
    mm = mmap.mmap(fd, STATUS_SIZE)
    return mm, StatusWords.from_buffer(mm)


def marked(status: StatusWords, k: int, func: Callable[..., Any], log: list[float] | None = None,
           named: bool = False, dated: bool = True) -> Callable[..., Any]:
    """`func`, naming its step in the status words at each call (for the parent's crash reports)
    and, `dated`, when it began (for its deadlines and stall reports: a plan with a timeout, or a
    pool with `stall_report`); `log`: also noted in the node log (observe/nodelog.py), with the
    same clock read, as a bare start time (the item's next step) or, `named`, with its step.
    A plain plan names its steps in its own code instead (`inline`)."""
    clock, step = time.monotonic, float(k)

    if log is None and not dated:
        def named_only(*args: Any, **kwargs: Any) -> Any:
            status.step = step
            return func(*args, **kwargs)
        return named_only
    if log is None:
        def call(*args: Any, **kwargs: Any) -> Any:
            status.step = step
            status.step_start = clock()
            return func(*args, **kwargs)
        return call
    note: Callable[[float], None] = log.append
    if named:
        def note(now: float) -> None:
            log.extend((STEP_NAMED, k, now))

    def logged(*args: Any, **kwargs: Any) -> Any:
        status.step = step
        status.step_start = now = clock()
        note(now)
        try:
            return func(*args, **kwargs)
        except BaseException as exc:  # an attempt its node's policy may retry: the log says it raised
            LOG.raised(exc)
            raise
    return logged
