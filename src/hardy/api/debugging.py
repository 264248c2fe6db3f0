"""Debugging a failed item: run it again here, under pdb where it fails.

What `NodeError.debug()`, `Pipeline.debug()` and `hardy replay REPORT --item N --pdb` do: the
item runs again in this process on an engine that runs every node here (`Engine.in_process`:
isolated nodes and nested pipelines too, timeouts not enforced), and pdb opens where it fails, in
the frame of the user's code that raised, with its live locals. (`breakpoint()` in a worker
process, which has no terminal, is `breakpoints.no_terminal`.)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ..engine.core import Engine
from ..errors import NodeError
from ..tracebacks import own_frames, user_traceback

if TYPE_CHECKING:
    from ..engine.results import Results

R = TypeVar("R", bound="Results")


def with_reruns(results: R, pipeline: Any, items: Sequence[dict[str, Any]], outputs: Sequence[str]) -> R:
    """`results` (a map's sink), knowing how its item i runs again under pdb: what it gives
    that item's error (`NodeError.debug`), which keeps that item's inputs, not the map's."""
    results.rerun = lambda i: _rerun(pipeline, items[i], list(outputs))
    return results


def _rerun(pipeline: Any, item: dict[str, Any], outputs: list[str]) -> Callable[[str], bool]:
    return lambda what: run_again(pipeline, item, outputs, what)


def run_again(pipeline: Any, values: Mapping[str, Any], output_name: Any, what: str) -> bool:
    """`pipeline.run(values, output_name)` in this process, every node here, under pdb where it
    fails (`post_mortem`)."""
    engine = Engine(map_executor="sequential")
    engine.in_process = True
    with engine:
        return post_mortem(lambda: pipeline.run(dict(values), output_name, engine=engine), what)


def post_mortem(call: Callable[[], Any], what: str) -> bool:
    """Run `call()` (one item, in this process); if it fails, print its traceback and open pdb
    at the innermost frame of the user's code that raised it (Ctrl-C in a hung item: where it
    was). True if it failed."""
    import pdb
    import traceback
    handled = sys.exc_info()[1]  # `err.debug()` in `except NodeError as err:`, as the guide has it: that error
    stopped = _noting_breakpoints()
    try:
        call()
    except (NodeError, KeyboardInterrupt) as err:
        _apart(err, handled)
        root: BaseException = err
        while root.__cause__ is not None:
            root = root.__cause__
        tb = user_traceback(err) if isinstance(err, NodeError) else own_frames(err.__traceback__)
        traceback.print_exception(type(root), root, tb)  # the user's frames (hardy's own are the rerun's)
        if tb is None:
            print(f"hardy: {what} failed again: {err}; no Python frame to debug", file=sys.stderr)
            return True
        print(f"hardy: {what} failed again in this process: {str(err).splitlines()[0]}\npdb is at the frame that "
              "raised, with its live locals ('up' walks out, 'q' quits)", file=sys.stderr, flush=True)
        pdb.post_mortem(tb)
        return True
    finally:
        sys.breakpointhook = stopped.hook
    if stopped.called:
        print(f"hardy: {what} ran to its end in this process, where its breakpoint() stopped in pdb; in a worker "
              "process, which has no terminal, breakpoint() fails the item", file=sys.stderr)
    else:
        print(f"hardy: {what} did not fail when run again in this process (it may depend on what ran before it "
              "in its worker, on its worker's environment, or on chance)", file=sys.stderr)
    return False


def _apart(err: BaseException, handled: BaseException | None) -> None:
    """The rerun's exceptions without the error being handled as their context. Raised while the
    caller's `except` block handles the first failure, the rerun's exception has that failure as
    its `__context__`, and its traceback would print the whole first failure again, then "During
    handling of the above exception, another exception occurred:", which reads as a second error
    before pdb opens. The rerun's own chain (what its code raised from or while handling) stays."""
    if handled is None:
        return
    around = set(_chain(handled))
    for exc in _chain(err, stop=around).values():
        if exc.__context__ is not None and id(exc.__context__) in around:
            exc.__context__ = None


def _chain(exc: BaseException, stop: Collection[int] = ()) -> dict[int, BaseException]:
    """`exc` and every exception it was raised from or while handling, by id (a cycle ends it),
    short of those in `stop`."""
    found: dict[int, BaseException] = {}
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in found or id(e) in stop:
            continue
        found[id(e)] = e
        todo += [e.__cause__, e.__context__]
    return found


class _Noted:
    """`sys.breakpointhook` for one rerun: it notes that the item called breakpoint(), then calls
    the hook it replaced (`hook`, put back after the rerun)."""

    def __init__(self) -> None:
        self.hook, self.called = sys.breakpointhook, False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        wanted = os.environ.get("PYTHONBREAKPOINT", "")
        self.called = self.called or wanted != "0"  # (turned off: nothing stopped)
        if self.hook is sys.__breakpointhook__ and wanted in ("", "pdb.set_trace"):
            import pdb  # (as the default hook does, at the frame that called breakpoint(), not this one)
            return pdb.Pdb().set_trace(sys._getframe(1))
        return self.hook(*args, **kwargs)


def _noting_breakpoints() -> _Noted:
    noted = _Noted()
    sys.breakpointhook = noted
    return noted
