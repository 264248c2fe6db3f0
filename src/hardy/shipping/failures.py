"""A node's error, made ready to travel back to the caller (`portable`): its cause's traceback kept
as text and as frames that become a real traceback again on the other side (`hardy.tracebacks`),
and a cause that pickle cannot carry replaced by a recipe that rebuilds it on the other side
(`rebuilt`), so a failure is never lost on the way, nor reads differently.
"""

from __future__ import annotations

import io
import pickle
import types
from typing import Any

from ..errors import EXCEPTION_GROUP, NodeError, stand_in, text_of
from ..tracebacks import GroupFrames, travelling, with_group_frames
from .pickling import ByValuePickler, dumps


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
    seen = {id(cause)}  # (the exceptions on their way: each travels once, as Python prints each once)
    if cause is not None and err.cause_chain is None:
        err.cause_chain = _chain(cause, seen)
    if cause is not None and getattr(err, "cause_groups", None) is None:
        err.cause_groups = _groups(cause, seen)  # (an exception group's exceptions' tracebacks and chains)
    if cause is not None:
        shipped = _shipped(cause)
        err.__cause__ = _CauseCopy(cause) if shipped is cause and not _survives(err) else shipped
    return err


def travelling_exception(exc: BaseException) -> tuple[Any, ...]:
    """`exc` ready to cross a process on its own (a log record's `exc_info`), as `portable` makes a
    node's error's cause: itself or a copy that rebuilds it, and what pickle leaves out (its
    frames, the exceptions it was raised from, its group's frames and chains), for `tracebacks.landed`."""
    tb, seen = exc.__traceback__, {id(exc)}
    return _shipped(exc), travelling(tb) if tb is not None else None, _chain(exc, seen), _groups(exc, seen)


def _shipped(exc: BaseException, seen: set[int] | None = None) -> BaseException:
    """`exc` as it travels: itself, or a copy that rebuilds it (`_CauseCopy`) where pickle would not
    bring it back whole; in a `_Landing` where its class must be named again, or, given `seen` (an
    exception another was raised from, whose group's frames and chains travel with no other), where
    it is a group whose exceptions need their tracebacks."""
    shipped = exc if _survives(exc) else _CauseCopy(exc)
    tree = _groups(exc, seen) if seen is not None else None
    return _Landing(shipped, type(exc).__qualname__, tree) if tree or _loses_name(type(exc)) else shipped


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
        return _same(copy, value)
    return True


def _same(copy: BaseException, value: BaseException) -> bool:
    """Whether `copy` is `value` again: its class and arguments, the members pickle leaves out
    (`_members`: an OSError subclass's `errno` and `filename`, an AttributeError's `name` and `obj`;
    the values in its `__slots__`), and a group's exceptions each so (pickle calls `ApiError` inside
    a group as outside)."""
    if type(copy) is not type(value) or not _alike(copy.args, value.args):
        return False
    members = (*_members(value), *_slot_names(type(value)))
    if not _alike(tuple(getattr(copy, m, None) for m in members), tuple(getattr(value, m, None) for m in members)):
        return False
    inner, copied = _inner(value), _inner(copy)
    if inner is None or copied is None:
        return inner is copied
    return len(inner) == len(copied) and all(_same(a, b) and not _loses_name(type(b)) for a, b in zip(copied, inner))


def _members(exc: BaseException) -> tuple[str, ...]:
    """What an exception holds outside its `args` and `__dict__`, which pickle leaves out: the
    file an OSError names (and its errno, which a subclass's own constructor sets), the name and
    object of an AttributeError and the name of a NameError, from which Python prints "Did you
    mean: 'text'?" (a NameError's from the names of the frame it was raised in, which the rebuilt
    frame has: its locals' stand-ins, the script's globals)."""
    if isinstance(exc, OSError):
        return ("errno", "strerror", "filename", "filename2")
    if isinstance(exc, AttributeError):
        return ("name", "obj")
    if isinstance(exc, NameError):
        return ("name",)
    return ()


def _slot_names(kind: type) -> tuple[str, ...]:
    """The attribute names the `__slots__` of `kind` and its bases declare (mangled where Python
    mangles them: `__x` in `Cls` is `_Cls__x`), which pickle leaves out as it leaves out
    `_members`: an exception made again without them raises AttributeError where code reads them."""
    names: list[str] = []
    for cls in kind.__mro__:
        declared = vars(cls).get("__slots__", ())
        for name in (declared,) if isinstance(declared, str) else declared:
            if name in ("__dict__", "__weakref__") or not isinstance(name, str):
                continue
            private = name.startswith("__") and not name.endswith("__")
            names.append(f"_{cls.__name__.lstrip('_')}{name}" if private else name)
    return tuple(dict.fromkeys(names))


def _held(exc: BaseException) -> dict[str, Any]:
    """What `exc` holds outside its `args` and `__dict__`, as it travels: its members (`_members`,
    an AttributeError's `obj` as `_object` makes it) and the values in its slots that are set
    (`_slot_names`), each itself where it pickles, else its repr, as its attributes travel."""
    held = {m: _object(v) if m == "obj" else _travelling(v) for m in _members(exc)
            if (v := getattr(exc, m, None)) is not None}
    for name in _slot_names(type(exc)):
        if name not in held and hasattr(exc, name):
            held[name] = _travelling(getattr(exc, name))
    return held


def _inner(exc: BaseException) -> tuple[BaseException, ...] | None:
    """The exceptions of an exception group (`asyncio.TaskGroup`'s), None for another exception."""
    return exc.exceptions if isinstance(exc, EXCEPTION_GROUP) else None


def _loses_name(kind: type) -> bool:
    """Whether pickle sends this class by value (defined in a function, or in the script's
    `__main__`), which makes it again without its `__qualname__`: `case.<locals>.Local` would
    print as `Local`."""
    name = kind.__qualname__
    return "." in name and ("<locals>" in name or kind.__module__ == "__main__")


def _alike(copied: tuple[Any, ...], given: tuple[Any, ...]) -> bool:
    """The same arguments, as far as a copy can be: plain values equal, others of the same type."""
    return len(copied) == len(given) and all(
        a == b if isinstance(b, (str, bytes, int, float, bool, type(None))) else type(a) is type(b)
        for a, b in zip(copied, given))


CHAIN_LIMIT = 100  # links of an exception chain that travel (Python prints every one: a chain that long is rare)


def _chain(exc: BaseException, seen: set[int]) -> list[tuple[BaseException, bool, bool, bool, Any]]:
    """The exceptions `exc` was raised from or while handling (which pickle leaves out), each as
    (the exception, or a copy that travels; whether it is the `__cause__` of the one before, and
    whether its `__context__` (`raise ... from e` in an `except` makes it both); that one's
    `__suppress_context__`; its traceback's frames), for `tracebacks.relinked` to hang them back on
    the cause, as Python prints them. It ends at one in `seen` (on its way already: a cycle, or one
    printed elsewhere), and at `CHAIN_LIMIT` links; a group's exceptions' chains travel alike
    (`_groups`)."""
    links: list[tuple[BaseException, bool, bool, bool, Any]] = []
    seen.add(id(exc))
    while len(links) < CHAIN_LIMIT:
        nxt = exc.__cause__ if exc.__cause__ is not None else exc.__context__
        if nxt is None or id(nxt) in seen:
            return links
        seen.add(id(nxt))
        frames = travelling(nxt.__traceback__) if nxt.__traceback__ is not None else None
        links.append((_shipped(nxt, seen), exc.__cause__ is nxt, exc.__context__ is nxt,
                      exc.__suppress_context__, frames))
        exc = nxt
    return links


def _groups(exc: BaseException, seen: set[int]) -> GroupFrames | None:
    """The frames of every exception an exception group holds (`asyncio.TaskGroup`'s, `except*`'s),
    nested groups' too, and the exceptions each was raised from or while handling (`_chain`, which
    stops at those in `seen`, the group's own exceptions among them, as Python prints none of them
    twice): pickle carries a group's exceptions without their tracebacks, causes and contexts, and a
    lone exception's chain comes back. None for no group."""
    inner = _inner(exc)
    if inner is None:
        return None
    seen.update(map(id, inner))
    return [(travelling(e.__traceback__) if e.__traceback__ is not None else None, _groups(e, seen), _chain(e, seen))
            for e in inner]


class _CauseCopy(Exception):
    """What travels for an exception pickle cannot carry: where its class lives, its built-in base,
    message, `args` and attributes (those that pickle, the others as their repr), its members and
    slots (`_held`), and a group's exceptions each as it travels on its own (`_shipped`)."""

    def __init__(self, exc: BaseException):
        super().__init__(text_of(exc))
        kind = type(exc)
        base = next((c.__name__ for c in kind.__mro__ if c.__module__ == "builtins"), "Exception")
        inner = _inner(exc)
        args = tuple(_travelling(a) for a in exc.args) if inner is None else (
            exc.message, [_shipped(e) for e in inner])  # type: ignore[attr-defined]
        self.recipe = (kind.__module__, kind.__qualname__, base, text_of(exc), args,
                       {k: _travelling(v) for k, v in getattr(exc, "__dict__", {}).items()}, _held(exc))

    def __reduce__(self) -> tuple[Any, ...]:
        return rebuilt, self.recipe


def rebuilt(module: str, qualname: str, base: str, message: str, args: tuple[Any, ...],
            state: dict[str, Any], members: dict[str, Any] | None = None) -> BaseException:
    """An exception that pickle could not carry (`_CauseCopy`), rebuilt where it lands: of its own
    class, by its constructor if that accepts its `args` and says the same, else without calling
    it, with its `args`, picklable attributes, members and slots' values; or, if its class cannot be
    found here or the copy would say something else, its `errors.stand_in`, which says the
    original's message and keeps its `args`, attributes (those that did not pickle as their repr),
    members and slots' values (as attributes), and a group's exceptions."""
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
                    _restore(exc, members)
                    if text_of(exc) == message:
                        return exc
    except Exception:  # not importable here, or a class that will not be made this way
        pass
    group = "ExceptionGroup" in base and len(args) == 2 and isinstance(args[1], list)
    exc = stand_in(module, qualname, base, *(args if group else (message,)))
    exc.said, exc.args = message, args
    exc.__dict__.update((k, v) for k, v in state.items() if k not in vars(type(exc)))
    _restore(exc, members)
    return exc


def _restore(exc: BaseException, members: dict[str, Any] | None) -> None:
    """Sets the members and slots' values pickle left out (`_held`) again."""
    for name, value in (members or {}).items():
        try:
            setattr(exc, name, value)
        except Exception:  # (a stand-in whose built-in base has no such member keeps it as an attribute)
            pass


class _Landing(Exception):
    """An exception as it travels (itself or its `_CauseCopy`) with what it needs where it lands:
    its class's `__qualname__`, which cloudpickle leaves out of a class it sends by value (the
    printed last line reads `__main__.case.<locals>.Local` as in-process), and a group's
    exceptions' frames and chains (`_groups`)."""

    def __init__(self, exc: BaseException, qualname: str, tree: GroupFrames | None):
        super().__init__(text_of(exc))
        self.landing = (exc, qualname, tree)

    def __reduce__(self) -> tuple[Any, ...]:
        return _landed, self.landing


def _landed(exc: BaseException, qualname: str, tree: GroupFrames | None) -> BaseException:
    """`exc`, its class named `qualname` again where the class made by value lost it, and its
    group's exceptions given their tracebacks."""
    kind = type(exc)
    if kind.__qualname__ != qualname and qualname.rpartition(".")[2] == kind.__name__:
        kind.__qualname__ = qualname
    if tree:
        with_group_frames(exc, tree)
    return exc


OBJECT_BYTES = 1 << 16  # an AttributeError's object pickled bigger than this stays in the worker (`_object`)


class _Attributes:
    """An AttributeError's `obj` that stays in the worker (big, or not picklable): its type and its
    attribute names, which are what Python reads (`dir(obj)`) to print "Did you mean: 'text'?"."""

    __slots__ = ("kind", "names")

    def __init__(self, kind: str, names: tuple[str, ...]):
        self.kind, self.names = kind, names

    def __dir__(self) -> list[str]:
        return list(self.names)

    def __repr__(self) -> str:
        return f"<{self.kind} left in the worker process>"

    def __reduce__(self) -> tuple[Any, ...]:
        return _Attributes, (self.kind, self.names)


class _Capped(io.BytesIO):
    """A pickle's file that stops it past `OBJECT_BYTES`: a 1 GB model whose attribute was
    misspelt is not pickled whole to learn that it is big."""

    def write(self, data: Any) -> int:
        if self.tell() + len(data) > OBJECT_BYTES:
            raise pickle.PicklingError("too big")
        return super().write(data)


def _object(obj: Any) -> Any:
    """An AttributeError's `obj` as it travels: itself where it is a module or a built-in value that
    pickles small, else its `_Attributes` (an object of the user's class may pickle and unpickle
    here, by value, and not in the caller, whose own class it resolves to: a slotted dataclass of
    the script; the whole error would be lost for a hint)."""
    if isinstance(obj, types.ModuleType) or type(obj).__module__ == "builtins":
        try:
            with _Capped() as file:
                ByValuePickler(file, protocol=5).dump(obj)
                pickle.loads(file.getvalue())
            return obj
        except Exception:
            pass
    try:
        names = tuple(n for n in dir(obj) if isinstance(n, str))
    except Exception:  # a broken __dir__: no hint, as in-process
        names = ()
    kind = type(obj)
    return _Attributes(kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}",
                       names)


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
