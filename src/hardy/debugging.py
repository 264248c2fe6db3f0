"""Debugging a failed item: run it again here under pdb, and `breakpoint()` where no terminal is.

`post_mortem` is what `NodeError.debug()` and `hardy replay REPORT --item N --pdb` do: the item
runs again in this process, on the sequential executor (isolated nodes and nested pipelines
included), and pdb opens where it fails, in the frame of the user's code that raised, with its
live locals. `no_terminal` is `breakpoint()` inside a worker process, which has no terminal to
talk to: instead of pdb reading an empty stdin and quitting (`BdbQuit`, with no hint), the item
fails with a message naming the two ways to debug it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from .errors import DebuggerUnavailable, NodeError, user_traceback

HOW = ("to debug a node, run its item again in your own process under pdb: err.debug() on the NodeError "
       "(or failed.error.debug() on a Failed, map_error.debug() on a MapError), or `hardy replay REPORT --item N "
       "--pdb` from a run report; or run the pipeline with Engine(map_executor=\"sequential\")")


def post_mortem(call: Callable[[], Any], what: str) -> bool:
    """Run `call()` (one item, in this process); if it fails, print its traceback and open pdb
    at the innermost frame of the user's code that raised it (Ctrl-C in a hung item: where it
    was). True if it failed."""
    import pdb
    import traceback
    try:
        call()
    except (NodeError, KeyboardInterrupt) as err:
        tb = user_traceback(err) if isinstance(err, NodeError) else err.__traceback__
        traceback.print_exception(err)
        if tb is None:
            print(f"hardy: {what} failed again, with no Python frame to debug", file=sys.stderr)
            return True
        print(f"hardy: {what} failed again in this process; pdb is at the frame that raised, with its live "
              "locals ('up' walks out, 'q' quits)", file=sys.stderr, flush=True)
        pdb.post_mortem(tb)
        return True
    print(f"hardy: {what} did not fail when run again in this process (it may depend on what ran before it "
          "in its worker, on its worker's environment, or on chance)", file=sys.stderr)
    return False


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
