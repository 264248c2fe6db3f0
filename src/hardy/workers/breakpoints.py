"""Debuggers and worker processes: `breakpoint()` in a node that runs in a worker process, which
has no terminal to talk to, and breakpoints a debugger set in the caller, which a worker never hits.

Instead of pdb reading the worker's empty stdin and quitting (`BdbQuit`, with no hint), the item
fails with one message saying how to debug it: run it again in the caller's process under pdb, in
the words of how the pipeline was run (`how`): from Python, the error's `debug()`, `hardy replay`
or the sequential executor; from the shell by `hardy run`, which has no error object to call and
whose reports keep no inputs to replay, its `--executor sequential`. A map started under pdb or
an IDE's debugger (`python -m pdb script.py`, VS Code's debugpy) says
once that its breakpoints in nodes will not stop there (`warn_if_debugged`).
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

from ..errors import DebuggerUnavailable
from ..tracebacks import outside_hardy

HOW = ("to debug a node, run its item again in your own process under pdb: err.debug() on the NodeError "
       "(or failed.error.debug() on a Failed, map_error.debug() on a MapError), or `hardy replay REPORT --item N "
       "--pdb` from a run report; or run the pipeline with Engine(map_executor=\"sequential\")")
SHELL = ("to debug a node, run the same `hardy run` command again with `--executor sequential`: its nodes then run in "
         "the command's own process, where breakpoint() opens pdb on your terminal (an --inputs file of the failed "
         "item's line alone stops at that item only)")
_HARDY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def how() -> str:
    """How to debug a node, in the words of how its pipeline was run: `SHELL` under `hardy run`
    (`hardy`, `python -m hardy` or `python -m hardy.cli`: the caller's argv, which a worker
    takes at each call), else `HOW`'s Python objects."""
    argv = sys.argv
    command = len(argv) > 1 and argv[1] == "run" and (
        os.path.basename(argv[0]) == "hardy" or os.path.abspath(argv[0]).startswith(_HARDY + os.sep))
    return SHELL if command else HOW


def no_terminal(*args: Any, **kwargs: Any) -> Any:
    """`sys.breakpointhook` in a worker process: a debugger other than pdb (PYTHONBREAKPOINT
    naming a remote debugger) is started as usual, PYTHONBREAKPOINT=0 still turns it off, and
    plain pdb, which would read the worker's empty stdin, fails the item saying how to debug."""
    wanted = os.environ.get("PYTHONBREAKPOINT", "")
    if wanted == "0":
        return None
    if wanted not in ("", "pdb.set_trace", "pdb"):
        return sys.__breakpointhook__(*args, **kwargs)
    raise DebuggerUnavailable(f"breakpoint() was called in a worker process, which has no terminal for pdb; {how()}")


_WARNED: list[bool] = []


def warn_if_debugged() -> None:
    """Once per process, when a debugger traces the caller (pdb's `Bdb`, debugpy's pydevd): the
    breakpoints it holds are this process's, and a node running in a worker passes them by
    without a word. (A coverage tracer or a profiler is no debugger: said nothing.) About 60 ns."""
    trace = sys.gettrace()
    if _WARNED or trace is None and (_MONITORING is None or _MONITORING.get_tool(_MONITORING.DEBUGGER_ID) is None):
        return
    owner = getattr(trace, "__self__", None)
    bdb = sys.modules.get("bdb")
    where = getattr(type(owner) if owner is not None else trace, "__module__", None) or ""
    if (bdb is not None and isinstance(owner, bdb.Bdb)) or "pydevd" in where or trace is None:
        _WARNED.append(True)
        warnings.warn("a debugger is tracing this process, but its breakpoints in nodes are not hit: nodes run in "
                      f"hardy's worker processes; {how()}", UserWarning, stacklevel=outside_hardy())


# Python 3.12 on: a debugger may hold `sys.monitoring`'s debugger slot instead of a trace function
# (debugpy does, and pdb from 3.14)
_MONITORING: Any = getattr(sys, "monitoring", None)

