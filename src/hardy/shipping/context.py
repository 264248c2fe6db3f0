"""The calling process's state that a node can read besides its inputs and modules: environment
variables, working directory, `sys.argv` and `sys.path`, and the interpreter's settings that change
what code computes (`Settings`: the warning filters, the recursion limit, decimal's context,
numpy's error handling (its callback too) and print options, torch's modes (`torch_modes`),
scikit-learn's configuration (`sklearn_config`), the log levels and `logging.disable`). A worker
takes them at each call, as the caller has them then (docs/same-answer.md), so a node reading
`os.environ["MODE"]` or a relative path, or dividing by zero under `np.seterr(divide="raise")`,
computes what it would compute in the caller.

`current()` is on every call's path, so it answers from the snapshot it made last whenever nothing
changed: a few comparisons, about a microsecond, and the same object, which a worker that already
has it recognises by identity.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

from ..cache.keys import settings_from
from ..errors import ReplicaError
from ..hashing import hash_value
from .decimal_context import decimal_contexts, decimal_key, take_decimal
from .pickling import dumps
from .sklearn_config import sklearn_config, sklearn_now, sklearn_thread_config, take_sklearn_config
from .torch_modes import (
    TORCH_DEFAULTS,
    TorchModes,
    take_torch_modes,
    torch_key,
    torch_keyed,
    torch_modes,
    torch_thread_modes,
)


class Settings(NamedTuple):
    """The interpreter's settings a node's result can depend on (`settings()`), in plain values
    (names, not classes: unpickling a class imports its module, which a worker may not have or
    need); a library's part only where the caller loaded the library and changed it from its
    default (else None, and a worker that never loads it pays nothing)."""

    recursion_limit: int
    int_max_str_digits: int | None  # (None before Python 3.11; 0: no limit)
    warning_filters: tuple[Filter, ...]  # `warnings.filters`, each category by (module, name)
    decimal: tuple[Any, ...] | None  # decimal's context: (prec, rounding, Emin, Emax, capitals, clamp, traps' names)
    numpy_errors: dict[str, str] | None  # `np.geterr()`
    numpy_print: dict[str, Any] | None  # `np.get_printoptions()` but its functions (`NUMPY_PRINT`)
    torch_modes: TorchModes | None
    log_levels: tuple[int, tuple[tuple[str, int], ...]]  # the root's effective level, each logger's own set
    # `np.geterrcall()` where a mode of `np.seterr` calls it, pickled as a node's code is (a script's
    # function by value); where it does not pickle, why (`Uncarried`)
    numpy_callback: bytes | str | None
    log_disable: int  # `logging.disable(level)`'s level (`logging.root.manager.disable`; 0: none)
    sklearn: dict[str, Any] | None = None  # `sklearn.get_config()` where not what a new thread starts with
    # `decimal.DefaultContext` (what a new thread and `decimal.Context()` start from), as `decimal`
    decimal_default: tuple[Any, ...] | None = None


Filter = tuple[str, Any, tuple[str, str], Any, int]  # action, message, category (module, name), module, line
NUMPY_ERRORS = {"divide": "warn", "over": "warn", "under": "ignore", "invalid": "warn"}  # numpy's defaults
# numpy's default print options, but `formatter` and `override_repr` (functions, which travel by
# plain pickle only by reference: they stay the caller's, docs/same-answer.md)
NUMPY_PRINT = {"edgeitems": 3, "threshold": 1000, "floatmode": "maxprec", "precision": 8, "suppress": False,
               "linewidth": 75, "nanstr": "nan", "infstr": "inf", "sign": "-", "legacy": False}


def settings() -> Settings:
    """The calling thread's settings now (see `Settings`)."""
    filters = tuple((action, message, _named(category), module, line)
                    for action, message, category, module, line in warnings.filters)
    context, default = decimal_contexts()
    return Settings(sys.getrecursionlimit(), _INT_DIGITS(), filters, context, _numpy_errors(), _numpy_print(),
                    torch_modes(), _log_levels(), _numpy_callback(), logging.root.manager.disable, sklearn_config(),
                    default)


def settings_key() -> tuple[Any, ...]:
    """What tells cheaply that `settings()` may have changed (`Snapshot.holds`): the limits, the
    filters' list, its length and first entry (`filterwarnings` puts one first, `catch_warnings`
    swaps the list), decimal's context and its fields, numpy's error state and print options (one
    object each, replaced by `np.seterr`, `np.seterrcall` and `np.set_printoptions`), torch's modes,
    scikit-learn's configuration (a copy: `set_config` changes its dict in place) and the log levels
    (`_log_token`). The objects themselves, not their ids: an object freed since could leave its id
    to the next one. About 0.3 us, 1.5 with pandas and torch loaded, 0.5 more with sklearn."""
    filters = warnings.filters
    modules = sys.modules
    decimal, numpy, torch = modules.get("decimal"), modules.get("numpy"), modules.get("torch")
    return (_RECURSION_LIMIT(), _INT_DIGITS(), filters, len(filters), filters[0] if filters else None,
            decimal_key(decimal) if decimal is not None else None,
            (_numpy_state(numpy), _numpy_print_state(numpy)) if numpy is not None else None,
            torch_key(torch._C, torch.get_default_dtype) if torch is not None else None, _log_token(),
            sklearn_now() if "sklearn" in modules else None)


_RECURSION_LIMIT = sys.getrecursionlimit
_INT_DIGITS: Callable[[], int | None] = getattr(sys, "get_int_max_str_digits", lambda: None)


def take_settings(theirs: Settings) -> None:
    """Make this process's settings the caller's (a worker, at each call that changed them), but
    the warning filters (`workers.worker`, which may hold stand-ins for their categories). A
    library loaded here whose setting the caller left at its default is set back to it."""
    sys.setrecursionlimit(theirs.recursion_limit)
    if theirs.int_max_str_digits is not None and hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(theirs.int_max_str_digits)
    take_decimal(theirs.decimal, theirs.decimal_default)
    if theirs.numpy_errors is not None or theirs.numpy_print is not None or "numpy" in sys.modules:
        import numpy
        numpy.seterr(**(theirs.numpy_errors or NUMPY_ERRORS))  # type: ignore[arg-type]  # (numpy's own names)
        callback = theirs.numpy_callback
        numpy.seterrcall(pickle.loads(callback) if isinstance(callback, bytes) else
                         None if callback is None else Uncarried(callback))
        if _numpy_print() != theirs.numpy_print:
            numpy.set_printoptions(**(theirs.numpy_print or NUMPY_PRINT))
    if theirs.torch_modes is not None or "torch" in sys.modules:
        import torch
        take_torch_modes(torch, theirs.torch_modes or TORCH_DEFAULTS)
    take_sklearn_config(theirs.sklearn)
    _take_log_levels(*theirs.log_levels)
    if logging.root.manager.disable != theirs.log_disable:  # (a node asking `log.isEnabledFor(INFO)`)
        logging.disable(theirs.log_disable)


def thread_modes() -> Callable[[], Any]:
    """What of the calling thread's settings another thread must take to compute the same (the
    threaded executor's chunks): torch's grad, inference and autocast modes and default device, and
    scikit-learn's configuration, are the thread's own. (Decimal's context and numpy's error state
    and print options live in context variables, which a copied `contextvars` context carries; the
    other settings are the process's.)"""
    takes = [take for take in (torch_thread_modes(), sklearn_thread_config()) if take is not None]
    if not takes:
        return _no_modes
    if len(takes) == 1:
        return takes[0]

    def take_both() -> None:
        for take in takes:
            take()
    return take_both


def _no_modes() -> None:
    """Nothing to take: neither torch nor sklearn is loaded."""


def _log_levels() -> tuple[int, tuple[tuple[str, int], ...]]:
    """The root logger's effective level and each logger's own level where one was set on it (a
    `myproject` logger at INFO under a root at WARNING): a worker then sends the records that are
    handled here and no others (every library's DEBUG, built, pickled and thrown away)."""
    own = tuple(sorted((name, lg.level) for name, lg in logging.Logger.manager.loggerDict.items()
                       if isinstance(lg, logging.Logger) and lg.level != logging.NOTSET))
    return logging.getLogger().getEffectiveLevel(), own


_PROBE = logging.getLogger("hardy.levels")  # a logger nothing logs to: its cache says whether levels changed
_TOKEN = [0]


def _log_token() -> int:
    """A number that changes when a log level may have changed (`settings_key`): every
    `setLevel`, `logging.disable` and `basicConfig(level=...)` empties the level cache of every
    logger (`Manager._clear_cache`), this probe's too, which `isEnabledFor` fills again. About 50
    ns, where reading every logger's level costs tens of microseconds."""
    if not getattr(_PROBE, "_cache", True):  # (a logging without the cache: levels as at the last snapshot)
        _PROBE.disabled = False  # (`dictConfig` disables the loggers it does not name: one disabled fills no cache)
        _PROBE.isEnabledFor(logging.DEBUG)
        _TOKEN[0] += 1
    return _TOKEN[0]


_LEVELS_SET: set[str] = set()  # the loggers this worker set a level on for its caller


def _take_log_levels(root: int, own: tuple[tuple[str, int], ...]) -> None:
    """The caller's log levels (`_log_levels`), at each call that changed them: a level raised in a
    notebook between two maps applies to the next one. A logger the caller no longer sets a level
    on is given none here either."""
    logging.getLogger().setLevel(root)
    levels = dict(own)
    for name in _LEVELS_SET - levels.keys():
        logging.getLogger(name).setLevel(logging.NOTSET)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    _LEVELS_SET.clear()
    _LEVELS_SET.update(levels)


def _named(category: Any) -> tuple[str, str]:
    """A warning category as (module, name): how a worker finds it again (`loaded_warning`)."""
    return (category.__module__, category.__qualname__) if isinstance(category, type) else ("", "")


def loaded_warning(module: str, name: str) -> type[Warning] | None:
    """The warning category `name` of `module` where this process has loaded that module (never
    imported for it: a library's warning is the library's business once it is loaded here)."""
    found: Any = sys.modules.get(module)
    for part in name.split("."):
        found = getattr(found, part, None)
    return found if isinstance(found, type) and issubclass(found, Warning) else None


def _numpy_errors() -> dict[str, str] | None:
    numpy = sys.modules.get("numpy")
    errors = numpy.geterr() if numpy is not None else None
    return None if errors is None or errors == NUMPY_ERRORS else errors


def _numpy_callback() -> bytes | str | None:
    """`np.seterrcall`'s function (or object with a `write` method) where a mode of `np.seterr`
    uses it ("call", "log"), pickled as a node's code is: a worker given the mode without it fails
    every item that divides by zero (numpy finds no function). Where it does not pickle (it holds
    a lock, an open file), the refusal a worker raises in its place (`Uncarried`)."""
    numpy = sys.modules.get("numpy")
    callback = numpy.geterrcall() if numpy is not None else None
    if numpy is None or callback is None:
        return None
    modes = {mode for mode in numpy.geterr().values() if mode in ("call", "log")}
    if not modes:
        return None
    try:
        return dumps(callback)
    except Exception as exc:
        name = getattr(callback, "__qualname__", None) or f"a {type(callback).__qualname__}"
        return (f"numpy's floating-point error callback in the calling process ({name} of "
                f"{getattr(callback, '__module__', None) or type(callback).__module__}, set with np.seterrcall "
                f"and used by np.seterr's {' and '.join(sorted(modes))!r} mode) cannot be sent to a worker "
                f"({type(exc).__name__}: {exc}): hardy will not run a node without it. Give np.seterrcall "
                "a function (or an object with a write method) that pickles, set it inside the node, or run "
                "the pipeline with map_executor=\"sequential\" or \"threaded\".")


class Uncarried:
    """In a worker, in place of the caller's `np.seterrcall` callback that could not be sent
    (`_numpy_callback`): where numpy would call it (a division by zero under
    `np.seterr(divide="call")`, or "log"'s `write`), the node fails with the refusal, which names
    the fix, rather than compute without it. Engines whose workers are elsewhere (Dask, Ray, Daft)
    refuse the call before sending anything (`Snapshot.travelling`); hardy's own worker processes
    take the state as a call starts, so it is refused there, where numpy reaches for the callback."""

    def __init__(self, refusal: str):
        self.refusal = refusal

    def __call__(self, kind: str, flag: int) -> None:
        raise ReplicaError(self.refusal)

    def write(self, message: str) -> None:
        raise ReplicaError(self.refusal)


def _numpy_state(numpy: Any) -> Any:
    """numpy's error state as one object (numpy 2: its context variable's value), else its settings."""
    config = sys.modules.get("numpy._core._ufunc_config")
    state = getattr(config, "_extobj_contextvar", None)
    return state.get() if state is not None else (tuple(sorted(numpy.geterr().items())), numpy.geterrcall())


def _numpy_print() -> dict[str, Any] | None:
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return None
    options = {name: value for name, value in numpy.get_printoptions().items() if name in NUMPY_PRINT}
    return None if options == NUMPY_PRINT else options


def _numpy_print_state(numpy: Any) -> Any:
    """numpy's print options as one object (numpy 2: its context variable's value), else a copy."""
    config = sys.modules.get("numpy._core.printoptions")
    state = getattr(config, "format_options", None)
    return state.get() if state is not None else numpy.get_printoptions()


class Snapshot:
    """The process state at one moment; compared by identity (`current` reuses one while it holds)."""

    __slots__ = ("environ", "cwd", "argv", "sys_path", "umask", "settings", "_raw", "_key", "_loaded")

    def __init__(self) -> None:
        self._raw: Any = dict(_raw_environ())
        self.environ: dict[str, str] = dict(os.environ)
        self.cwd = _cwd()
        self.argv: list[str] = list(sys.argv)
        self.sys_path: list[str] = list(sys.path)
        self._loaded = len(sys.modules)  # (one loaded since: the worker learns where from, `messages.loaded_from`)
        self.umask = _umask()
        self._key = settings_key()
        self.settings = settings()

    def travelling(self, set_back: bool = False) -> Travelling:
        """What of this state goes to an engine's worker on another machine (`arrived`): the
        variables this process set or removed since it started (not the machine's own; a variable
        set or removed at an earlier call and removed since counts as removed; one set back since to
        its start value is sent where `set_back`: to workers that keep the environment this process had
        as they started, a local Ray's), its working directory, argv,
        umask and sys.path (its entries that exist there, ahead of that machine's own). Refused
        (ReplicaError), before anything is sent, where a setting cannot travel (`Settings.numpy_callback`)."""
        if isinstance(self.settings.numpy_callback, str):
            raise ReplicaError(self.settings.numpy_callback)
        started = _started_with()
        changed, unset = environ_delta(started, self.environ)
        _SET.update(changed, unset)
        if set_back:  # workers that keep what this process had as they started (a local Ray's)
            changed.update((name, self.environ[name]) for name in _SET if name in self.environ)
        unset += [name for name in _SET if name not in self.environ and name not in unset]
        return Travelling(changed, unset, self.cwd, self.argv, self.umask, self.sys_path, self.settings)

    def holds(self) -> bool:
        return (self.sys_path == sys.path and self.argv == sys.argv and self._raw == _raw_environ()
                and self.cwd == _cwd() and self._loaded == len(sys.modules) and self._key == settings_key())


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


_SET: set[str] = set()  # the variables this process set or removed since it started, as far as calls saw them


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


def result_settings() -> bytes:
    """The settings that change the value a node returns for the same code and inputs, as cache
    key bytes (`cache.keys.result_settings`): decimal's context (`getcontext().prec = 5`) and
    `DefaultContext`, numpy's print options (an array's text) and error modes, torch's (`torch_keyed`
    too), scikit-learn's configuration (a DataFrame from `transform_output="pandas"`), the warning
    filters that make warnings errors (`except ConvergenceWarning`: not the others, which libraries
    add as they are imported, nor pytest's, which pytest makes errors in every test); each only
    where it is not its default (b"" while all are), so that keys made without it stay. Not the
    recursion and int-digit limits: they decide whether a call raises, and one that raised is never
    stored (and a library raises the recursion limit as it is imported). Kept with the snapshot it
    was read from: about 3 us a call."""
    snapshot = current()
    kept, made = _KEYED[0]  # (one tuple: another thread replaces it whole)
    if snapshot is kept:
        return made
    s = snapshot.settings
    modes = s.torch_modes or TORCH_DEFAULTS
    torch = (modes.default_dtype, modes.matmul_precision)
    default = (TORCH_DEFAULTS.default_dtype, TORCH_DEFAULTS.matmul_precision)
    parts: tuple[Any, ...] = (s.decimal, s.numpy_print, None if torch == default else torch)
    if modes.autocast is not None:  # (keys made without it stay as they were)
        parts += (modes.autocast,)
    if modes.default_device is not None:  # (likewise, and the next)
        parts += (("device", modes.default_device),)
    if s.sklearn is not None:
        parts += (("sklearn", sorted(s.sklearn.items())),)
    parts += torch_keyed(modes)
    if s.decimal_default is not None:
        parts += (("DefaultContext", s.decimal_default),)
    errors = _error_filters(s.warning_filters)
    if errors:
        parts += (("errors", errors),)
    if s.numpy_errors is not None:  # (and the callback a mode calls, by its code)
        parts += (("seterr", sorted(s.numpy_errors.items()), None if s.numpy_callback is None else _errcall_key()),)
    made = b"" if parts == (None, None, None) else repr(parts).encode()
    _KEYED[0] = (snapshot, made)
    return made


def _error_filters(filters: tuple[Filter, ...]) -> list[tuple[Any, ...]]:
    """The warning filters a key holds: every one that makes warnings errors, and each filter before
    one of them on an overlapping category (an `ignore` of `DeprecationWarning` before an `error` of
    every warning decides whether a warning raises). Nothing where no filter makes errors: libraries
    add filters as they are imported, and keys must not move with them. Left out, as the errors no
    node's code meets: pytest's (it makes them errors in every test) and IPython's completer warning
    (every notebook has it, and each import then moved the keys by the filters it put before it)."""
    kept = [(a, getattr(m, "pattern", m), c, getattr(w, "pattern", w), n) for a, m, c, w, n in filters
            if c[0].partition(".")[0] not in ("pytest", "_pytest") and c not in _TOOLS_OWN]
    errors = [k for k, entry in enumerate(kept) if entry[0] == "error"]
    return [entry[1:] if entry[0] == "error" else entry for k, entry in enumerate(kept)
            if entry[0] == "error" or any(_overlap(entry[2], kept[e][2]) for e in errors if e > k)]


_TOOLS_OWN = {("IPython.core.completer", "ProvisionalCompleterWarning")}


def _overlap(one: tuple[str, str], other: tuple[str, str]) -> bool:
    """Whether a warning can be of both categories: one is the other's subclass, or a class loaded
    here is of both (astropy's `AstropyPendingDeprecationWarning`); True where one is not loaded."""
    a, b = loaded_warning(*one), loaded_warning(*other)
    if a is None or b is None or issubclass(a, b) or issubclass(b, a):
        return True
    below = a.__subclasses__()
    while below:  # (a's descendants: few, for a library's own category; one met twice is tested twice)
        c = below.pop()
        if issubclass(c, b):
            return True
        below += c.__subclasses__()
    return False


def _errcall_key() -> str:
    """`np.seterrcall`'s function (or object) by its content, as a cache key holds a node's (its
    code); one without a content (an open log file) by its class."""
    callback = sys.modules["numpy"].geterrcall()
    try:
        return hash_value(callback).hex()
    except Exception:
        return f"{type(callback).__module__}.{type(callback).__qualname__}"


_KEYED: list[tuple[Any, bytes]] = [(None, b"")]  # the last snapshot `result_settings` read, and its answer
settings_from(result_settings)
