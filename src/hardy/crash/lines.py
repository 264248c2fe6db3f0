"""What a dying worker writes into its fault record, beside the native handler's lines: the chain
of nested plans, the Python thread it died in, how it left on its own (`record.py` holds the
format and reads it). Apart from the reader so that a worker imports only what it writes: each
line is made by the dying worker itself, so all it needs is imported before anything can die.
"""

from __future__ import annotations

import base64
import json
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from .containment import nesting

if TYPE_CHECKING:
    from types import FrameType

NESTING = "hardy-nesting: "


def nesting_line() -> str:
    """The deepest chain of nested plans among this process's threads, as the first line of a
    worker's crash file (`hardy-nesting: [...]`); empty when no plan is nested in another."""
    chains = [nesting(f) for f in sys._current_frames().values()]
    deepest = max(chains, key=len, default=[])
    return f"{NESTING}{json.dumps(deepest)}\n" if len(deepest) > 1 else ""



# --- which thread died, and how a worker left ----------------------------------------------------
#
# A worker runs its items in its main thread. A crash in another Python thread (a prefetch or I/O
# thread that an earlier item's node started) is not the fault of the item in flight: the parent
# reads which thread it was (`thread_line`, written by the dying thread itself) and what was in
# flight when that thread was started (`watch_threads`), and runs the item in flight again
# (`blame.elsewhere`). A native thread (an OpenMP team, a library's own pool) works for the call
# running now, and a thread running the plan's code (an async plan's sync nodes) is the node's.

THREAD = "hardy-thread: "
EXIT = "hardy-exit: "
INTERRUPTED = "hardy-interrupted: "


def watch_threads(now: Callable[[], tuple[float, ...]]) -> None:
    """Note on each thread started from now on what was in flight as it started (`now()`: the
    worker's item, step and the step's start, from its status words) and when (monotonic: which
    map it was), for `thread_line`."""
    import time
    start = threading.Thread.start

    def started(self: threading.Thread) -> None:
        self._hardy_started = (*now(), time.monotonic())  # type: ignore[attr-defined]
        start(self)
    threading.Thread.start = started  # type: ignore[method-assign]


def thread_line() -> str:
    """`hardy-thread: {"name": ..., "started": [item, step, step start, when]}` for the thread this
    runs in (a crashing one, in its fatal-signal handler), when it is a Python thread other than the
    one running the plan; empty for the main thread, a thread running the plan's code, and a native
    thread (not started by Python), all of which work for the node running now."""
    ident = threading.get_ident()
    if ident == threading.main_thread().ident:
        return ""
    thread = next((t for t in threading.enumerate() if t.ident == ident), None)
    if thread is None or type(thread).__name__ == "_DummyThread":  # a native thread calling into Python
        return ""
    f: FrameType | None = sys._getframe(1)
    while f is not None:
        if f.f_code.co_filename.startswith("<hardy plan") or f.f_code.co_name == "_thread_call":
            return ""
        f = f.f_back
    started = getattr(thread, "_hardy_started", None)
    return f"{THREAD}{json.dumps({'name': thread.name, 'started': started})}\n"


def exit_line(how: str) -> str:
    """`hardy-exit: the node called os._exit(3)`: how a worker left on its own."""
    return f"{EXIT}{how}\n"


def interrupted_line(exc: KeyboardInterrupt, shipped: bytes = b"") -> str:
    """`hardy-interrupted: [<its text>, <shipped, base64>]`: the worker left because a node raised
    KeyboardInterrupt, which in-process interrupts the call (the parent does the same:
    `FaultRecord.interrupted`). `shipped`: the exception pickled as other exceptions travel
    (`shipping.failures.travelling_exception`, the worker's caller makes it), for the caller to
    raise it again with its class and frames (empty where it did not pickle: its text goes alone)."""
    return f"{INTERRUPTED}{json.dumps([str(exc), base64.b64encode(shipped).decode()])}\n"
