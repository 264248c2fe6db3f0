"""A node's error, made ready to travel back to the caller (`portable`): its cause's traceback kept
as text and as frames that become a real traceback again on the other side (`hardy.tracebacks`),
and a cause that pickle cannot carry replaced by a recipe that rebuilds it on the other side
(`rebuilt`), so a failure is never lost on the way, nor reads differently.
"""

from __future__ import annotations

import pickle
from typing import Any

from ..errors import NodeError, stand_in, text_of
from ..tracebacks import group_frames, travelling
from .pickling import dumps


def portable(err: NodeError) -> NodeError:
    """The error, ready to cross a process: its cause's traceback kept as text in `stack` and as
    frames in `cause_frames` (a traceback does not pickle; `errors` rebuilds one from them), and a
    cause that would not come back whole (an exception whose constructor takes other arguments
    than it passes to Exception, or builds its message from them, or holding an unpicklable
    attribute: pickle rebuilds an exception by calling its class with its `args`) replaced by a
    copy that rebuilds it on the other side (`rebuilt`)."""
    cause = err.__cause__
    if cause is not None and not getattr(err, "stack", ""):
        import traceback
        err.stack = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))
    if cause is not None and cause.__traceback__ is not None and not getattr(err, "cause_frames", None):
        err.cause_frames = travelling(cause.__traceback__)  # the cause's traceback, rebuilt where it lands
    if cause is not None and err.cause_chain is None:
        err.cause_chain = _chain(cause)
    if cause is not None and getattr(err, "cause_groups", None) is None:
        err.cause_groups = group_frames(cause)  # (an exception group's exceptions' tracebacks)
    if not _survives(err) or cause is not None and not _survives(cause):
        err.__cause__ = _CauseCopy(cause) if cause is not None else None
    return err


def travelling_exception(exc: BaseException) -> tuple[Any, ...]:
    """`exc` ready to cross a process on its own (a log record's `exc_info`), as `portable` makes a
    node's error's cause: itself or a copy that rebuilds it, and what pickle leaves out (its
    frames, the exceptions it was raised from, its group's frames), for `tracebacks.landed`."""
    tb = exc.__traceback__
    return (exc if _survives(exc) else _CauseCopy(exc), travelling(tb) if tb is not None else None, _chain(exc),
            group_frames(exc))


def _survives(value: Any) -> bool:
    """Whether `value` comes back from a pickle (unpickling is where such exceptions fail), and an
    exception as the same class with the same arguments: `ApiError(503)`, whose constructor makes
    its message "API returned HTTP 503", is called again with that message by pickle, and would
    say "API returned HTTP API returned HTTP 503". (Not its text: one that shows an object's
    address, or a time, reads differently in every copy.)"""
    try:
        copy = pickle.loads(dumps(value))
    except Exception:
        return False
    if isinstance(value, BaseException):
        return type(copy) is type(value) and _alike(copy.args, value.args)
    return True


def _alike(copied: tuple[Any, ...], given: tuple[Any, ...]) -> bool:
    """The same arguments, as far as a copy can be: plain values equal, others of the same type."""
    return len(copied) == len(given) and all(
        a == b if isinstance(b, (str, bytes, int, float, bool, type(None))) else type(a) is type(b)
        for a, b in zip(copied, given))


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
        return rebuilt, self.recipe


def rebuilt(module: str, qualname: str, base: str, message: str, args: tuple[Any, ...],
            state: dict[str, Any]) -> BaseException:
    """An exception that pickle could not carry (`_CauseCopy`), rebuilt where it lands: of its own
    class, by its constructor if that accepts its `args` and says the same, else without calling
    it, with its `args` and picklable attributes; or, if its class cannot be found here or the copy
    would say something else, its `errors.stand_in`, which says the original's message and keeps
    its `args` and attributes (those that did not pickle as their repr)."""
    import importlib
    try:
        cls: Any = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            for made in (_constructed, _unconstructed):
                exc = made(cls, args)
                if exc is not None:
                    exc.__dict__.update(state)
                    if text_of(exc) == message:
                        return exc
    except Exception:  # not importable here, or a class that will not be made this way
        pass
    exc = stand_in(module, qualname, base, message)
    exc.said, exc.args = message, args
    exc.__dict__.update((k, v) for k, v in state.items() if k not in vars(type(exc)))
    return exc


def _constructed(cls: type[BaseException], args: tuple[Any, ...]) -> BaseException | None:
    """As pickle would make it: its constructor sets what it sets (SystemExit's code)."""
    try:
        return cls(*args)
    except Exception:
        return None


def _unconstructed(cls: type[BaseException], args: tuple[Any, ...]) -> BaseException | None:
    """Made without its constructor, which takes other arguments or builds its message from them."""
    try:
        exc = cls.__new__(cls, *args)
        exc.args = args
        return exc
    except Exception:
        return None


def _travelling(value: Any) -> Any:
    """`value` if it survives pickling there and back, else its repr."""
    if _survives(value):
        return value
    try:
        return repr(value)
    except Exception:
        return f"<{type(value).__name__}>"
