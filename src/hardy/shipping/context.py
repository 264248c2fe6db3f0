"""The calling process's state that a node can read besides its inputs and modules: environment
variables, working directory, `sys.argv` and `sys.path`, and the interpreter's settings that change
what code computes (`Settings`: the warning filters, the recursion limit, decimal's context,
numpy's error handling, torch's grad mode). A worker takes them at each call, as the caller has
them then (docs/same-answer.md), so a node reading `os.environ["MODE"]` or a relative path, or
dividing by zero under `np.seterr(divide="raise")`, computes what it would compute in the caller.

`current()` is on every call's path, so it answers from the snapshot it made last whenever nothing
changed: a few comparisons, about a microsecond, and the same object, which a worker that already
has it recognises by identity.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple


class Settings(NamedTuple):
    """The interpreter's settings a node's result can depend on (`settings()`); a library's part
    only where the caller loaded the library and changed it from its default (else None, and a
    worker that never loads it pays nothing)."""

    recursion_limit: int
    int_max_str_digits: int  # (0 before Python 3.11: no limit)
    warning_filters: tuple[Any, ...]  # `warnings.filters`, those a worker can unpickle
    decimal: tuple[Any, ...] | None  # decimal's context: (prec, rounding, Emin, Emax, capitals, clamp, traps)
    numpy_errors: dict[str, str] | None  # `np.geterr()`
    torch_modes: tuple[bool, bool] | None  # grad enabled, deterministic algorithms


NUMPY_ERRORS = {"divide": "warn", "over": "warn", "under": "ignore", "invalid": "warn"}  # numpy's defaults


def settings() -> Settings:
    """The calling thread's settings now (see `Settings`)."""
    int_digits = getattr(sys, "get_int_max_str_digits", None)
    return Settings(sys.getrecursionlimit(), int_digits() if int_digits else 0,
                    tuple(f for f in warnings.filters if _findable(f[2])), _decimal(), _numpy_errors(), _torch_modes())


def settings_key() -> tuple[Any, ...]:
    """What tells cheaply that `settings()` may have changed (`Snapshot.holds`): the limits, the
    filters' list, its length and first entry (`filterwarnings` puts one first, `catch_warnings`
    swaps the list), decimal's context and its precision and rounding, numpy's error state (one
    object, replaced by `np.seterr`) and torch's modes; about 0.3 us, 0.7 with torch loaded."""
    filters = warnings.filters
    modules = sys.modules
    key: tuple[Any, ...] = (sys.getrecursionlimit(), id(filters), len(filters), id(filters[0]) if filters else 0)
    if "decimal" in modules:
        context = modules["decimal"].getcontext()
        key += (id(context), context.prec, context.rounding)
    if "numpy" in modules:
        key += (_numpy_state(),)
    if "torch" in modules:
        torch = modules["torch"]
        key += (torch.is_grad_enabled(), torch.are_deterministic_algorithms_enabled())
    int_digits = getattr(sys, "get_int_max_str_digits", None)
    return key + (int_digits() if int_digits else 0,)


def take_settings(theirs: Settings) -> None:
    """Make this process's settings the caller's (a worker, at each call that changed them). A
    library loaded here whose setting the caller left at its default is set back to it."""
    sys.setrecursionlimit(theirs.recursion_limit)
    if theirs.int_max_str_digits and hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(theirs.int_max_str_digits)
    warnings.filters[:] = theirs.warning_filters  # type: ignore[index]  # (typeshed: a Sequence; it is a list)
    warnings._filters_mutated()  # type: ignore[attr-defined]  # (the C part caches what the filters said)
    if theirs.decimal is not None or "decimal" in sys.modules:
        import decimal
        if theirs.decimal:
            prec, rounding, emin, emax, capitals, clamp, traps = theirs.decimal
            made = decimal.Context(prec, rounding, emin, emax, capitals, clamp, traps=traps)
        else:
            made = decimal.Context()  # (a copy of the default)
        decimal.setcontext(made)
    if theirs.numpy_errors is not None or "numpy" in sys.modules:
        import numpy
        numpy.seterr(**(theirs.numpy_errors or NUMPY_ERRORS))  # type: ignore[arg-type]  # (numpy's own names)
    if theirs.torch_modes is not None or "torch" in sys.modules:
        import torch
        grad, deterministic = theirs.torch_modes or (True, False)
        torch.set_grad_enabled(grad)
        torch.use_deterministic_algorithms(deterministic)


def thread_modes() -> Callable[[], Any]:
    """What of the calling thread's settings another thread must take to compute the same (the
    threaded executor's chunks): torch's grad mode is the thread's own. (Decimal's context and
    numpy's error state live in context variables: a copied `contextvars` context carries them.)"""
    torch = sys.modules.get("torch")
    if torch is None:
        return _no_modes
    grad = torch.is_grad_enabled()
    return lambda: torch.set_grad_enabled(grad)


def _no_modes() -> None:
    """Nothing to take: torch is not loaded."""


def _findable(category: Any) -> bool:
    """Whether another process finds a warning category where its module and name say (a
    script's own class does not travel: its filter stays here)."""
    module = sys.modules.get(getattr(category, "__module__", ""))
    found: Any = module if category.__module__ != "__main__" else None
    for part in getattr(category, "__qualname__", "?").split("."):
        found = getattr(found, part, None)
    return found is category


def _decimal() -> tuple[Any, ...] | None:
    decimal = sys.modules.get("decimal")
    if decimal is None:
        return None
    c = decimal.getcontext()
    traps = [t for t, on in c.traps.items() if on]
    made = (c.prec, c.rounding, c.Emin, c.Emax, c.capitals, c.clamp, traps)
    fresh = decimal.Context()  # (the default context, as a thread starts with it)
    default = (fresh.prec, fresh.rounding, fresh.Emin, fresh.Emax, fresh.capitals, fresh.clamp,
               [t for t, on in fresh.traps.items() if on])
    return None if made == default else made


def _numpy_errors() -> dict[str, str] | None:
    numpy = sys.modules.get("numpy")
    errors = numpy.geterr() if numpy is not None else None
    return None if errors is None or errors == NUMPY_ERRORS else errors


def _numpy_state() -> Any:
    """numpy's error state as one object (numpy 2: its context variable's value), else its settings."""
    numpy = sys.modules["numpy"]
    config = sys.modules.get("numpy._core._ufunc_config")
    state = getattr(config, "_extobj_contextvar", None)
    return id(state.get()) if state is not None else tuple(sorted(numpy.geterr().items()))


def _torch_modes() -> tuple[bool, bool] | None:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    modes = (bool(torch.is_grad_enabled()), bool(torch.are_deterministic_algorithms_enabled()))
    return None if modes == (True, False) else modes


class Snapshot:
    """The process state at one moment; compared by identity (`current` reuses one while it holds)."""

    __slots__ = ("environ", "cwd", "argv", "sys_path", "umask", "settings", "_raw", "_key")

    def __init__(self) -> None:
        self._raw: Any = dict(_raw_environ())
        self.environ: dict[str, str] = dict(os.environ)
        self.cwd = _cwd()
        self.argv: list[str] = list(sys.argv)
        self.sys_path: list[str] = list(sys.path)
        self.umask = _umask()
        self._key = settings_key()
        self.settings = settings()

    def travelling(self) -> Travelling:
        """What of this state goes to an engine's worker on another machine (`arrived`): the
        variables this process set or removed since it started (not the machine's own; a variable
        set at an earlier call and removed since counts as removed), its working directory, argv,
        umask and sys.path (its entries that exist there, ahead of that machine's own)."""
        started = _started_with()
        changed, unset = environ_delta(started, self.environ)
        _SET.update(changed)
        unset += [name for name in _SET if name not in self.environ and name not in started]
        return Travelling(changed, unset, self.cwd, self.argv, self.umask, self.sys_path, self.settings)

    def holds(self) -> bool:
        return (self.sys_path == sys.path and self.argv == sys.argv and self._raw == _raw_environ()
                and self.cwd == _cwd() and self._key == settings_key())


def _raw_environ() -> Any:
    """os.environ's own mapping (encoded keys and values on POSIX): comparing it is the cheap way
    to learn that nothing was set or removed (the public mapping decodes every item)."""
    return getattr(os.environ, "_data", os.environ)


def _cwd() -> str:
    try:
        return os.getcwd()
    except OSError:  # removed under us: a worker keeps its own
        return ""


_LAST: list[Snapshot] = []


def current() -> Snapshot:
    """The process state now: the last snapshot while nothing changed, else a new one."""
    last = _LAST[0] if _LAST else None
    if last is not None and last.holds():
        return last
    snapshot = Snapshot()
    _LAST[:] = [snapshot]
    return snapshot


class Travelling(NamedTuple):
    """The caller's state as it travels to an engine's worker (`Snapshot.travelling`)."""

    environ: dict[str, str]
    unset: list[str]
    cwd: str
    argv: list[str]
    umask: int
    sys_path: list[str]
    settings: Settings

    def arrived(self) -> Snapshot:
        """This process's state with the caller's on top: its variables, its argv, and its working
        directory where that exists here (on another machine it may not: the worker keeps its own)."""
        here = Snapshot()
        for name in self.unset:
            here.environ.pop(name, None)
        here.environ.update(self.environ)
        here.argv = list(self.argv)
        here.umask = self.umask
        here.settings = self.settings
        here.sys_path = self.import_path()
        if self.cwd and os.path.isdir(self.cwd):
            here.cwd = self.cwd
        return here

    def import_path(self) -> list[str]:
        """The caller's sys.path entries that exist here, in its order, then this process's others:
        what an engine's worker imports the caller's modules with (`take_import_path`)."""
        theirs = [p for p in self.sys_path if not p or os.path.isdir(p)]  # ('': the working directory)
        return theirs + [p for p in sys.path if p not in theirs]

    def take_import_path(self) -> None:
        """Make this process's sys.path `import_path()`: an engine's worker process, before it loads
        a plan whose modules the caller may have imported from a folder it added at run time. (In
        the caller's own process, an engine running tasks in threads, it is the same list.)"""
        if sys.path != self.sys_path:
            sys.path[:] = self.import_path()


_SET: set[str] = set()  # the variables this process set since it started, as far as calls saw them


def _umask() -> int:
    """This process's umask, read where reading does not mean setting it (os.umask would change it
    for the other threads meanwhile). Read as a snapshot is made, not at every call: a umask set
    between two calls that change nothing else is not seen (docs/same-answer.md)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def _started_with() -> dict[str, str]:
    """The environment this process was started with (Linux keeps it in /proc/self/environ;
    elsewhere, none: every variable counts as set)."""
    try:
        with open("/proc/self/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    pairs = (entry.split(b"=", 1) for entry in raw.split(b"\0") if b"=" in entry)
    return {os.fsdecode(k): os.fsdecode(v) for k, v in pairs}


def environ_delta(before: dict[str, str], after: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """(variables set or changed, variables removed) from `before` to `after`."""
    changed = {k: v for k, v in after.items() if before.get(k) != v}
    return changed, [k for k in before if k not in after]
