"""Python's garbage collector paused around work that makes many objects and no garbage.

Importing modules, building a first call's machinery, or turning a worker's batch of outputs
into result dicts: each object made counts toward the next collection, none of them can be
garbage, and each collection walks them all. Paused, one collection runs after the work, when the
objects that were temporary are gone.

Only while this is the process's one thread: another could switch the collector off meanwhile
(for its own reasons, for good), and would find it on again after. Only hardy's own work runs in
a pause (a signal handler or an at-fork hook aside).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused() -> Iterator[None]:
    """The collector off for the block, if it was on and no other thread runs."""
    pause = threading.active_count() == 1 and gc.isenabled()
    try:  # (the disable inside: a Ctrl-C between it and the `try` would leave the collector off for good)
        if pause:
            gc.disable()
        yield
    finally:
        if pause:
            gc.enable()
