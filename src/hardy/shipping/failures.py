"""A node's error, made ready to travel back to the caller (`portable`): its cause's traceback kept
as text and as frames that become a real traceback again on the other side (`hardy.tracebacks`),
and a cause that pickle cannot carry replaced by a recipe that rebuilds it on the other side
(`errors.rebuilt_exception`), so a failure is never lost on the way.
"""

from __future__ import annotations

import pickle
from typing import Any

from ..errors import NodeError, rebuilt_exception, text_of
from ..tracebacks import travelling
from .pickling import dumps


def portable(err: NodeError) -> NodeError:
    """The error, ready to cross a process: its cause's traceback kept as text in `stack` and as
    frames in `cause_frames` (a traceback does not pickle; `errors` rebuilds one from them), and a
    cause that would not come back whole (an exception whose constructor takes other arguments
    than it passes to Exception, or holding an unpicklable attribute: pickle rebuilds an exception
    by calling its class with its `args`) replaced by a copy that rebuilds it on the other side
    (`errors.rebuilt_exception`)."""
    cause = err.__cause__
    if cause is not None and not getattr(err, "stack", ""):
        import traceback
        err.stack = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))
    if cause is not None and cause.__traceback__ is not None and not getattr(err, "cause_frames", None):
        err.cause_frames = travelling(cause.__traceback__)  # the cause's traceback, rebuilt where it lands
    if cause is not None and err.cause_chain is None:
        err.cause_chain = _chain(cause)
    if not _survives(err):
        err.__cause__ = _CauseCopy(cause) if cause is not None else None
    return err


def _survives(value: Any) -> bool:
    """Whether `value` comes back from a pickle: unpickling is where such exceptions fail."""
    try:
        pickle.loads(dumps(value))
        return True
    except Exception:
        return False


CHAIN_LIMIT = 100  # links of an exception chain that travel (Python prints every one: a chain that long is rare)


def _chain(exc: BaseException) -> list[tuple[BaseException, bool, bool, bool, Any]]:
    """The exceptions `exc` was raised from or while handling (which pickle leaves out), each as
    (the exception, or a copy that travels; whether it is the `__cause__` of the one before, and
    whether its `__context__` (`raise ... from e` in an `except` makes it both); that one's
    `__suppress_context__`; its traceback's frames), for `tracebacks.relinked` to hang them back on
    the cause, as Python prints them."""
    links: list[tuple[BaseException, bool, bool, bool, Any]] = []
    seen = {id(exc)}
    while len(links) < CHAIN_LIMIT:
        nxt = exc.__cause__ if exc.__cause__ is not None else exc.__context__
        if nxt is None or id(nxt) in seen:
            return links
        seen.add(id(nxt))
        frames = travelling(nxt.__traceback__) if nxt.__traceback__ is not None else None
        links.append((nxt if _survives(nxt) else _CauseCopy(nxt), exc.__cause__ is nxt, exc.__context__ is nxt,
                      exc.__suppress_context__, frames))
        exc = nxt
    return links


class _CauseCopy(Exception):
    """What travels for an exception pickle cannot carry: where its class lives, its built-in base,
    message, `args` and attributes (those that pickle, the others as their repr)."""

    def __init__(self, exc: BaseException):
        super().__init__(text_of(exc))
        kind = type(exc)
        base = next((c.__name__ for c in kind.__mro__ if c.__module__ == "builtins"), "Exception")
        self.recipe = (kind.__module__, kind.__qualname__, base, text_of(exc), tuple(_travelling(a) for a in exc.args),
                       {k: _travelling(v) for k, v in getattr(exc, "__dict__", {}).items()})

    def __reduce__(self) -> tuple[Any, ...]:
        return rebuilt_exception, self.recipe


def _travelling(value: Any) -> Any:
    """`value` if it survives pickling there and back, else its repr."""
    if _survives(value):
        return value
    try:
        return repr(value)
    except Exception:
        return f"<{type(value).__name__}>"
