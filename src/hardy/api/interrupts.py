"""An uncaught `MapInterrupted` ends a script as Ctrl-C does: exit code 130, and what it held.

CPython exits with 130 (killing itself with SIGINT) only when the uncaught exception is exactly
`KeyboardInterrupt`; `MapInterrupted`, its subclass carrying the map's results, would end the
script with 1, and the results with it, silently. So the first `MapInterrupted` installs a
`sys.excepthook` that prints the traceback as before, then how many finished results the
interrupt held and where the run report is, and raises SystemExit(130): raised from the hook,
it ends the interpreter cleanly (atexit handlers run, workers stop) with that code.
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any

from ..errors import MapInterrupted, NodeError
from ..tracebacks import where_interrupted

_BEFORE: list[Any] = []  # the excepthook hardy's replaced, once installed


def interrupted(results: list[Any], failures: dict[int, NodeError], report_dir: Any,
                interrupt: BaseException) -> MapInterrupted:
    """The `MapInterrupted` of a map, with the hook installed that gives it exit code 130. Raised
    from `interrupt` where it landed in the user's code (a node running in this process), with
    hardy's frames between theirs left out; where it landed in hardy's wait for the workers, its
    frames (hardy's, or the standard library's in a `threaded` map's wait) say nothing about the
    user's code, and it is left out (`raise` it with no `from`), unless it says something: a
    node's own `KeyboardInterrupt("stop here")` in a worker process, which the caller raises
    again (`Results.raise_ending`) from the text the worker sent (a Ctrl-C says nothing). Its
    message is then the cause, as in-process, without hardy's frames."""
    if not _BEFORE:
        _BEFORE.append(sys.excepthook)
        sys.excepthook = _exit_as_interrupted
    err = MapInterrupted(results, failures, report_dir)
    frames = where_interrupted(interrupt.__traceback__)
    err.__cause__ = interrupt.with_traceback(frames) if frames is not None or interrupt.args else None
    err.__suppress_context__ = True
    return err


def _exit_as_interrupted(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    _BEFORE[0](kind, value, tb)
    if not isinstance(value, MapInterrupted):
        return
    where = f"; its run report in {value.report_dir}" if value.report_dir else ""
    print(f"hardy: interrupted; the map's {value.done} finished result(s) were in MapInterrupted.results, which an "
          f"uncaught interrupt discards (catch it to keep them){where}", file=sys.stderr)
    if not (sys.flags.interactive or hasattr(sys, "ps1")):  # an interactive session goes on
        raise SystemExit(130)
