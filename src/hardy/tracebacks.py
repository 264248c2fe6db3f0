"""A node's traceback as its author reads it: their own frames, wherever the node ran.

Used on the failure path only, three steps:

- `own_frames`: the traceback without hardy's frames in front of the user's (the plan's
  generated `_run`, a retry loop, an event wrapper, the threaded executor's call) nor the
  standard library's before them (`concurrent.futures` handing a thread's exception back), so a
  bug two calls deep in a helper reads `node -> helper`, on every executor.
- `travelling`: those frames as data that pickles, made in the process that ran the node: file,
  line, function, the column range Python 3.11+ underlines, and the locals that can travel
  (plain values as themselves, the others as `LeftBehind` stand-ins holding their type and repr).
- `rebuilt`: a real traceback again, in the caller, whose frames have that file, line, function
  and column range: Python prints it as it would have printed the worker's, and pdb, `%debug`
  and `python -m pdb` walk it, showing the source and the locals that came back.

Why not tblib (which Dask uses): its rebuilt frames carry the column range of its own stub
(`raise __traceback_maker`), so on Python 3.11+ every remote line is underlined wrongly, and no
locals unless asked. A stub that raises at exactly the original columns is what matters.
"""

from __future__ import annotations

import functools
import itertools
import os
import sys
import types
from typing import Any, TypeVar

_HARDY = os.path.dirname(os.path.abspath(__file__)) + os.sep
_PLAN = "<hardy plan "
_PLAIN = (type(None), bool, int, float, complex)
_CONTAINERS = (tuple, list, dict, set, frozenset)
MAX_LOCALS = 64  # per frame: the rest are left out (a frame with more is rare, and pdb shows what came)
MAX_TEXT = 10_000  # a str or bytes local longer than this travels as a stand-in
REPR_BUDGET = 1.0  # seconds the local reprs of one traceback may take together (`_Budget`)
NOT_TAKEN = "<repr not taken: slow>"  # the text of a local whose repr ran past the budget, or came after it
Parameters = tuple[tuple[str, ...], int, int, int, int]  # names; positional-only, positional, keyword-only; flags
Frames = list[tuple[str, str, str, int, "tuple[int, int, int] | None", dict[str, Any], int, "Parameters | None"]]
_OPTIMIZED, _VARARGS, _VARKEYWORDS = 1, 4, 8  # a code's flags: a function's, its *args, its **kwargs (`inspect`'s)


def is_hardy(filename: str) -> bool:
    """Whether a frame of this file is hardy's own: its package or a plan's generated code."""
    return filename.startswith(_PLAN) or filename.startswith(_HARDY)


def outside_hardy() -> int:
    """The `stacklevel`, for a warning its caller raises, of the first frame that is not hardy's:
    the user's call of map, imap or run that the warning is about (a report that could not be
    written, a debugger whose breakpoints nodes will not hit), not the line of hardy that noticed."""
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and is_hardy(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


def is_users(filename: str) -> bool:
    """Whether a frame of this file is the user's code: neither hardy's nor a library's."""
    return not is_hardy(filename) and not filename.startswith(_library())


def is_machinery(filename: str) -> bool:
    """Whether a frame of this file is hardy's or the standard library's (not an installed
    package's, where a node may live): where a Ctrl-C that landed says nothing of the code run."""
    return is_hardy(filename) or (filename.startswith(_folders("stdlib", "platstdlib"))
                                  and not filename.startswith(_folders("purelib", "platlib")))


def _library() -> tuple[str, ...]:
    """The standard library's and installed packages' folders."""
    return _folders("stdlib", "platstdlib", "purelib", "platlib")


@functools.lru_cache(maxsize=4)
def _folders(*kinds: str) -> tuple[str, ...]:
    """sysconfig's folders of these kinds (read on the first failure: `import hardy` stays fast)."""
    import sysconfig
    paths = sysconfig.get_paths()
    return tuple({paths[k] + os.sep for k in kinds if paths.get(k)})


@functools.lru_cache(maxsize=1)
def _repr() -> Any:
    import reprlib
    short = reprlib.Repr()
    short.maxstring = short.maxother = 240
    return short


def own_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """`tb` from the first frame of the user's code on, without hardy's frames between the
    user's. hardy's frames after the user's last stay (hardy raised the error: its frames say
    where); with no user frame at all, only hardy's leading frames go. The plan's code goes anywhere
    (a group `except*` raised again in a node starts at the caller's frame: the plan's)."""
    entries: list[types.TracebackType] = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    names = [t.tb_frame.f_code.co_filename for t in entries]
    first = next((k for k, n in enumerate(names) if is_users(n)), None)
    if first is None:
        first = next((k for k, n in enumerate(names) if not is_hardy(n)), 0)
    last_other = max((k for k, n in enumerate(names) if not is_hardy(n)), default=-1)
    kept = [k for k in range(first, len(entries))
            if (k > last_other or not is_hardy(names[k])) and not names[k].startswith(_PLAN)]
    if not kept:
        return None
    if kept == list(range(kept[0], len(entries))):
        return entries[kept[0]]  # a tail of the original: nothing to rebuild
    top = None
    for k in reversed(kept):
        t = entries[k]
        top = types.TracebackType(top, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return top


class LeftBehind:
    """In a frame that came back from another process, a local whose value stayed there (not
    plain data, or too big): its type and repr. Using it as its value fails, saying so."""

    __slots__ = ("kind", "text")

    def __init__(self, kind: str, text: str):
        self.kind, self.text = kind, text

    def __repr__(self) -> str:
        return f"<{self.kind} left in the worker process: {self.text}>"

    def __reduce__(self) -> tuple[Any, ...]:
        return LeftBehind, (self.kind, self.text)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"{name!r}: this local is a stand-in for a {self.kind} that stayed in the worker process (its repr: "
            f"{self.text}); NodeError.debug() runs the item again in this process, with every local live")


def travelling(tb: types.TracebackType | None) -> Frames:
    """The frames of `tb`, outermost first, as data that pickles: (file, function, module,
    line, (end line, column, end column) or None, locals, the function's first line, its
    parameters). The locals' reprs together take `REPR_BUDGET` seconds at most (`_Budget`)."""
    frames: Frames = []
    with _Budget(REPR_BUDGET) as budget:
        while tb is not None:
            frame, code = tb.tb_frame, tb.tb_frame.f_code
            frames.append((code.co_filename, code.co_name, str(frame.f_globals.get("__name__", "")), tb.tb_lineno,
                           _position(code, tb.tb_lasti, tb.tb_lineno), _locals(frame, budget), code.co_firstlineno,
                           _parameters(code)))
            tb = tb.tb_next
    return frames


class _Cut(BaseException):
    """Raised by `_Budget`'s timer into a repr that ran past the budget. A BaseException, so that
    a repr's own `except Exception` does not swallow it."""


class _Budget:
    """The seconds a traceback's local reprs may take together. Nothing calls `repr` on a failure
    in-process; a worker does, to send the locals' stand-ins, and a `__repr__` that waits (on a
    lock another thread holds, a client asking its connection, a lazy value computing) held the
    item until its timeout (a NodeTimeout in place of the node's own error) or forever. Once the
    budget is spent, the repr in progress is cut and the remaining locals are not taken
    (`NOT_TAKEN`): the failure comes back within about `seconds`, the user's error whole.

    How: an ITIMER_REAL timer, set at the first repr, and a SIGALRM handler that raises `_Cut`
    (while a repr runs; between reprs it only marks the budget spent). A Python signal handler runs
    between bytecodes and interrupts a blocking wait on Linux (a lock's acquire, a sleep, a socket
    read: PEP 475 retries only after the handler returned), in the main thread, where a worker runs
    its items and makes their failures ready to travel. Not a thread running the repr with a
    timeout: a repr that never returns would leave that thread running, and a repr that runs on
    another thread than its object's may not be safe. The previous handler and timer (the node's
    own `signal.alarm`) are put back, the time spent taken off what was left of it. Elsewhere (a
    node's thread logging an exception; a SIGALRM handler set from C, which Python cannot put
    back) the reprs are not timed, nor is a repr stuck in C code that never checks for signals."""

    def __init__(self, seconds: float):
        self.seconds, self.spent, self.running, self.armed = seconds, False, False, False
        self.previous: Any = None
        self.timer, self.started = (0.0, 0.0), 0.0

    def __enter__(self) -> _Budget:
        return self

    def _arm(self) -> None:
        """The timer, started with the first repr (a traceback of plain locals sets none)."""
        import signal
        import threading
        import time
        self.armed = True
        if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGALRM) is None:
            return
        self.started = time.monotonic()
        self.timer = signal.setitimer(signal.ITIMER_REAL, 0)  # (the node's own alarm, if any: put back at exit)
        self.previous = signal.signal(signal.SIGALRM, self._alarm)
        left = self.timer[0]
        signal.setitimer(signal.ITIMER_REAL, min(self.seconds, left) if left else self.seconds, 0.05)

    def _alarm(self, signum: int, frame: Any) -> None:
        self.spent = True  # (between reprs: the ones left are not taken)
        if self.running:  # (every 50 ms after: a repr that swallowed one and waits again is cut again)
            raise _Cut

    def take(self, value: Any) -> str | None:
        """`value`'s short repr, or None once the budget is spent."""
        if not self.armed:
            self._arm()
        if self.spent:
            return None
        try:
            try:
                self.running = True
                text: str = _repr().repr(value)
            finally:
                self.running = False
        except _Cut:  # (also one that came as the repr returned: the budget is spent either way)
            return None
        return text

    def __exit__(self, *exc: Any) -> None:
        import signal
        import time
        if self.previous is None:
            return
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.previous)
        left, interval = self.timer
        if left:  # the node's own timer, less the time spent here (at once if that has passed)
            signal.setitimer(signal.ITIMER_REAL, max(left - (time.monotonic() - self.started), 1e-6), interval)


def _position(code: types.CodeType, lasti: int, lineno: int) -> tuple[int, int, int] | None:
    positions = getattr(code, "co_positions", None)  # Python 3.11+
    if positions is None or lasti < 0:
        return None
    try:
        start, end, col, end_col = next(itertools.islice(positions(), lasti // 2, None))
    except StopIteration:
        return None
    if start != lineno or end is None or col is None or end_col is None:
        return None
    return end, col, end_col


def _parameters(code: types.CodeType) -> Parameters | None:
    """A frame's function's parameters (None: none, or a top level), where pdb's `a` and IPython's
    `f(x=1)` read its arguments: its rebuilt frame's code has them too (`_arguments`)."""
    star = code.co_flags & (_VARARGS | _VARKEYWORDS)
    count = code.co_argcount + code.co_kwonlyargcount + bin(star).count("1")
    return (code.co_varnames[:count], code.co_posonlyargcount, code.co_argcount, code.co_kwonlyargcount,
            star) if count else None


def _locals(frame: types.FrameType, budget: _Budget) -> dict[str, Any]:
    if frame.f_locals is frame.f_globals:  # a module's top level: its globals are not the frame's own
        return {}
    return {name: _local(value, budget) for name, value in itertools.islice(frame.f_locals.items(), MAX_LOCALS)}


def _local(value: Any, budget: _Budget) -> Any:
    if _plain(value, 2) or isinstance(value, LeftBehind):
        return value
    try:
        text = budget.take(value)
    except Exception:  # a broken __repr__ must not cost the traceback
        text = "(its repr failed)"
    if text is None:
        text = NOT_TAKEN
    kind = type(value)
    return LeftBehind(kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}",
                      text)


def _plain(value: Any, depth: int) -> bool:
    """Plain data, small: what travels as itself (anything else may be big, or not unpickle here)."""
    kind = type(value)
    if kind in _PLAIN:
        return True
    if kind is str or kind is bytes:
        return len(value) <= MAX_TEXT
    if kind in _CONTAINERS and depth > 0 and len(value) <= 100:
        items = itertools.chain.from_iterable(value.items()) if kind is dict else value
        return all(_plain(v, depth - 1) for v in items)
    return False


def with_frames(exc: BaseException, frames: Frames) -> None:
    """`exc` given a traceback made of the worker's frames (`rebuilt`), as if raised here."""
    try:
        exc.__traceback__ = rebuilt(frames)
    except Exception as failed:  # a traceback that cannot be made again must not cost the error: its text travelled too
        if debugger_quit(failed):
            raise


GroupFrames = list[tuple["Frames | None", Any, Any]]  # per exception of a group: its frames, its group's, its chain
# (`shipping.failures._groups`: pickle carries a group's exceptions without their tracebacks, causes and contexts)


def with_group_frames(exc: BaseException, tree: GroupFrames) -> None:
    """A group's exceptions given back their tracebacks and chains (`shipping.failures`), as if raised here."""
    for inner, (frames, below, chain) in zip(getattr(exc, "exceptions", ()), tree):
        if frames:
            with_frames(inner, frames)
        if below:
            with_group_frames(inner, below)
        relinked(inner, chain)


def landed(exc: BaseException, frames: Frames | None, chain: Any, groups: GroupFrames | None) -> BaseException:
    """An exception from a worker with what pickle left out hung back on it: its traceback of the
    worker's frames, the exceptions it was raised from (`relinked`) and its group's exceptions'
    frames (`with_group_frames`), as if raised here. (`shipping.failures.travelling_exception`.)"""
    if frames:  # (over one tblib rebuilt, in Dask: its columns are its stub's)
        with_frames(exc, frames)
    if groups:
        with_group_frames(exc, groups)
    relinked(exc, chain or ())
    return exc


def relinked(exc: BaseException, chain: Any) -> None:
    """The exceptions `exc` was raised from or while handling, hung back on it as they were in the
    worker (`shipping.failures._chain`), each with its frames: `raise ... from` and "during
    handling" print as in-process."""
    for link, is_cause, is_context, suppress, frames in chain:
        if is_cause:
            exc.__cause__ = link
        if is_context:
            exc.__context__ = link
        exc.__suppress_context__ = suppress
        if frames:
            with_frames(link, frames)
        exc = link


def rebuilt(frames: Frames) -> types.TracebackType | None:
    """A traceback whose frames read as `frames` did where they ran (`travelling`)."""
    top = None
    for filename, name, module, lineno, position, local, *more in reversed(frames):  # (a report's: no first)
        params, args, kwargs = _arguments(more[-1], local) if more and isinstance(more[-1], tuple) else (None, (), {})
        code = _stub(filename, name, lineno, position, more[0] if more else 1, params)
        frame, lasti = _stub_frame(code, filename, module, args, kwargs)
        frame.f_locals.update(local)  # (the arguments it was called with again, and the other locals)
        top = types.TracebackType(top, frame, lasti, lineno)
    return top


def debugger_quit(exc: BaseException) -> bool:
    """Whether `exc` is a debugger's quit (pdb's `q`: bdb's `BdbQuit`, an Exception), which must end
    the program as the user asked: no `except Exception` standing for a traceback or a value that
    could not be made (here, or where a worker's results are read) may swallow it. (bdb is not
    imported for it: no debugger ran where it is not loaded.)"""
    return isinstance(exc, getattr(sys.modules.get("bdb"), "BdbQuit", ()))


def _arguments(params: Parameters, local: dict[str, Any]) -> tuple[Parameters | None, tuple[Any, ...], dict[str, Any]]:
    """A rebuilt frame's parameters, and its arguments' locals that came back, to call it with (none where one did
    not: past `MAX_LOCALS`, deleted); a `*args` no tuple, a `**kwargs` no dict of other names, stays a local."""
    names, posonly, count, kwonly, star = params
    kept, flags = list(names[:count + kwonly]), 0
    if not all(n in local for n in kept):
        return None, (), {}
    args, kwargs = tuple(local[n] for n in names[:count]), {n: local[n] for n in names[count:count + kwonly]}
    if star & _VARARGS and isinstance(value := local.get(names[len(kept)]), tuple):
        args, flags = args + value, _VARARGS
        kept.append(names[len(kept)])
    varkw = local.get(names[-1]) if star & _VARKEYWORDS else None
    if isinstance(varkw, dict) and all(isinstance(k, str) and k not in names[posonly:count + kwonly] for k in varkw):
        kwargs, flags = {**kwargs, **varkw}, flags | _VARKEYWORDS
        kept.append(names[-1])
    return (tuple(kept), posonly, count, kwonly, flags), args, kwargs


def _stub_frame(code: types.CodeType, filename: str, module: str, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> tuple[types.FrameType, int]:
    """A frame of `code` that ended by raising, and the instruction it raised at: a function's
    called with `args` and `kwargs` (its parameters' values), a top level's run. Run with this
    thread's trace function off: the stub carries the user's file and line, so a debugger tracing
    the caller (`python -m pdb script.py`, a breakpoint on a node's line) would stop in it, a frame
    of hardy's with none of the node's locals, and its `q` would be lost there."""
    tracer = sys.gettrace()
    sys.settrace(None)
    try:
        if code.co_flags & _OPTIMIZED:
            types.FunctionType(code, _globals(module, filename))(*args, **kwargs)
        else:
            exec(code, _globals(module, filename), {})  # noqa: S102 - our own stub (`_stub`)
    except (NameError, TypeError) as exc:
        tb = exc.__traceback__
        assert tb is not None and tb.tb_next is not None
        return tb.tb_next.tb_frame, tb.tb_next.tb_lasti
    finally:
        sys.settrace(tracer)
    raise AssertionError("a traceback stub did not raise")


_HEAD = "def _():("  # a function stub's first line: its body, the raising code, inside the bracket (`_stub`)
_STUB_NAMES = frozenset({"iter", *("Q" * width for width in range(1, 6))})  # what a stub reads (`_stub`)


def _globals(module: str, filename: str) -> dict[str, Any]:
    """The globals of a rebuilt frame: the module's own where this process loaded it from the same
    file (pdb then reads `helper` or `np` there, as in the worker), else its name alone. Not where
    the module binds a name the stub reads: the stub must raise where it stands."""
    loaded = sys.modules.get(module)
    namespace = getattr(loaded, "__dict__", None)
    if isinstance(namespace, dict) and getattr(loaded, "__file__", None) == filename \
            and _STUB_NAMES.isdisjoint(namespace):
        return namespace
    return {"__name__": module, "__file__": filename}


@functools.lru_cache(maxsize=512)
def _stub(filename: str, name: str, lineno: int, position: tuple[int, int, int] | None,
          first: int = 1, params: Parameters | None = None) -> types.CodeType:
    """Code named `name` in `filename` that raises at `lineno`, at exactly the columns `position` says (a name of that
    width that is not defined, or `iter()` spread over those columns and lines), so that Python underlines the same
    part of the line as it did where it ran; it starts at the function's `first` line, where pytest and pdb's `ll`
    begin its source. With `params`, a function's (`_HEAD`), unless it raised left of where its body could start."""
    if position is None:
        end, col, end_col = lineno + 1, len(_HEAD), 1  # no columns known: a range over lines, which nothing underlines
    else:
        end, col, end_col = position
    if end == lineno:
        width = max(end_col - col, 1)
        text = "Q" * width if width < 6 else "iter(" + " " * (width - 6) + ")"
    else:
        text = "iter(" + "\n" * (end - lineno) + " " * max(end_col - 1, 0) + ")"
    first = max(1, min(first, lineno))  # (no indent at the top level: a bracket, from the first line)
    head = _HEAD if params and (lineno > first or col >= len(_HEAD)) else "(" if lineno > first or col else ""
    indent = col - len(head) if lineno == first else col
    code = compile(head + "\n" * (lineno - first) + " " * indent + text + ")" * bool(head), filename, "exec")
    if head == _HEAD and params:
        code = next(c for c in code.co_consts if isinstance(c, types.CodeType))
        names, posonly, count, kwonly, star = params
        code = code.replace(co_varnames=names, co_nlocals=len(names), co_argcount=count, co_posonlyargcount=posonly,
                            co_kwonlyargcount=kwonly, co_flags=code.co_flags | star)
    code = code.replace(co_name=name, co_firstlineno=first)
    return code.replace(co_qualname=name) if sys.version_info >= (3, 11) else code  # type: ignore[call-arg,unused-ignore]


def where_interrupted(tb: types.TracebackType | None) -> types.TracebackType | None:
    """A Ctrl-C's `tb` from the user's first frame on (`own_frames`), or None when it holds only
    hardy's and the standard library's: it landed in hardy's wait for its workers (or a `threaded`
    map's wait in `threading`), whose frames say nothing about where the user's code was."""
    frames = entry = own_frames(tb)
    while entry is not None and is_machinery(entry.tb_frame.f_code.co_filename):
        entry = entry.tb_next
    return frames if entry is not None else None


def landed_in_worker(interrupt: BaseException, frames: list[tuple[str, str, int]]) -> None:
    """Gives a Ctrl-C that landed here, in hardy's wait, the frames (file, function, line; from a
    worker's faulthandler stack, outermost first) of the user's code the worker was running when
    it came, after hardy's: its traceback then ends where the same script's in-process one would
    (a node stuck in `time.sleep`), and `where_interrupted` keeps those frames."""
    first = next((k for k, (file, _, _) in enumerate(frames) if not is_machinery(file)), None)
    if first is None:
        return
    tb = interrupt.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    theirs = rebuilt([(f, name, "", line, _whole_line(f, line), {}, 1, None) for f, name, line in frames[first:]])
    if tb is None:
        interrupt.__traceback__ = theirs
    else:
        tb.tb_next = theirs


def _whole_line(filename: str, lineno: int) -> tuple[int, int, int] | None:
    """The columns of line `lineno`'s code, all of it: what Python underlines nothing of (a stack
    names lines, not the expression on them)."""
    import linecache
    line = linecache.getline(filename, lineno).rstrip()
    return (lineno, len(line) - len(line.lstrip()), len(line)) if line.strip() else None


E = TypeVar("E", bound=BaseException)


def user_traceback(err: BaseException) -> types.TracebackType | None:
    """The traceback of `err`'s innermost cause: the frames of the user's code that raised it
    (rebuilt from the worker's, where it ran in one). hardy raises its errors with it, so that
    pdb.pm(), `python -m pdb` and `%debug` open in those frames."""
    seen = {id(err)}
    while err.__cause__ is not None and id(err.__cause__) not in seen:
        err = err.__cause__
        seen.add(id(err))
    return err.__traceback__


def at_user_frames(err: E) -> E:
    """`err` with its innermost cause's traceback (`user_traceback`), to be raised by hardy's API:
    Python adds the raising frames in front, so the traceback reads your call, hardy's one frame,
    then your node's frames."""
    return err.with_traceback(user_traceback(err))
