"""What crosses a process (or machine) boundary: a plan's spec, chunks of items, results.

A plan travels as its spec, compiled again on the other side (`plans.py`); items travel pickled, a
chunk at a time or one by one for an engine's task, sealed input by input when a chunk must be
opened that way (`items.py`); how values are pickled — by reference or by value, code keeping its
file and lines, big buffers out of band — is `pickling.py`, and the big buffers themselves travel
in memfd segments beside the pickle (`transport.py`); a node's error is made ready to travel back
(`failures.py`). Anything that cannot travel gets an error naming the node or the input and the
remedy, before anything is sent. Shared by the worker pool and the distributed engines, which
import these names from here.
"""

from . import context
from .failures import portable
from .items import (
    Pickled,
    Unshippable,
    check_constants,
    described,
    globals_in,
    item_error,
    open_input,
    readers,
    seal,
    ship_each,
    ship_items,
    unopened,
)
from .pickling import dumps, out_of_band
from .plans import build_plan, ship_plan, synced

__all__ = ["context", "ship_plan", "build_plan", "synced", "dumps", "out_of_band", "Pickled", "Unshippable",
           "ship_items", "ship_each", "check_constants", "item_error", "readers", "described", "globals_in", "seal",
           "open_input", "unopened", "portable"]
