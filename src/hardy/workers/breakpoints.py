"""`breakpoint()` in a node that runs in a worker process, which has no terminal to talk to.

Instead of pdb reading the worker's empty stdin and quitting (`BdbQuit`, with no hint), the item
fails with one message saying how to debug it: run it again in the caller's process under pdb.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ..errors import DebuggerUnavailable

HOW = ("to debug a node, run its item again in your own process under pdb: err.debug() on the NodeError "
       "(or failed.error.debug() on a Failed, map_error.debug() on a MapError), or `hardy replay REPORT --item N "
       "--pdb` from a run report; or run the pipeline with Engine(map_executor=\"sequential\")")


def no_terminal(*args: Any, **kwargs: Any) -> Any:
    """`sys.breakpointhook` in a worker process: a debugger other than pdb (PYTHONBREAKPOINT
    naming a remote debugger) is started as usual, PYTHONBREAKPOINT=0 still turns it off, and
    plain pdb, which would read the worker's empty stdin, fails the item saying how to debug."""
    wanted = os.environ.get("PYTHONBREAKPOINT", "")
    if wanted == "0":
        return None
    if wanted not in ("", "pdb.set_trace", "pdb"):
        return sys.__breakpointhook__(*args, **kwargs)
    raise DebuggerUnavailable(f"breakpoint() was called in a worker process, which has no terminal for pdb; {HOW}")
