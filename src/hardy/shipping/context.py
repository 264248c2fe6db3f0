"""The calling process's state that a node can read besides its inputs and modules: environment
variables, working directory, `sys.argv` and `sys.path`, and the interpreter's settings that change
what code computes (`Settings`: the warning filters, the recursion limit, decimal's context,
numpy's error handling and print options, torch's modes and default dtype). A worker takes them at
each call, as the caller has them then (docs/same-answer.md), so a node reading
`os.environ["MODE"]` or a relative path, or dividing by zero under `np.seterr(divide="raise")`,
computes what it would compute in the caller.

`current()` is on every call's path, so it answers from the snapshot it made last whenever nothing
changed: a few comparisons, about a microsecond, and the same object, which a worker that already
has it recognises by identity.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

from ..cache.keys import settings_from


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


class TorchModes(NamedTuple):
    """torch's settings that change what a node computes: its thread's grad and inference modes
    and the process's algorithms, default dtype and matmul precision (a `set_seed` helper's
    `cudnn.deterministic = True`), each as `torch.get_*` and `torch.backends.cudnn` read them."""

    grad: bool = True
    deterministic: bool = False
    warn_only: bool = False
    inference: bool = False
    default_dtype: str = "float32"
    matmul_precision: str = "highest"
    cudnn_deterministic: bool = False
    cudnn_benchmark: bool = False
    cudnn_allow_tf32: bool = True


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
    return Settings(sys.getrecursionlimit(), _INT_DIGITS(), filters, _decimal(), _numpy_errors(), _numpy_print(),
                    _torch_modes(), _log_levels())


def settings_key() -> tuple[Any, ...]:
    """What tells cheaply that `settings()` may have changed (`Snapshot.holds`): the limits, the
    filters' list, its length and first entry (`filterwarnings` puts one first, `catch_warnings`
    swaps the list), decimal's context and its fields, numpy's error state and print options (one
    object each, replaced by `np.seterr` and `np.set_printoptions`) and torch's modes. The objects
    themselves, not their ids: an object freed since could leave its id to the next one. About 0.3
    us, 1.1 with pandas and torch loaded."""
    filters = warnings.filters
    modules = sys.modules
    decimal, numpy, torch = modules.get("decimal"), modules.get("numpy"), modules.get("torch")
    return (_RECURSION_LIMIT(), _INT_DIGITS(), filters, len(filters), filters[0] if filters else None,
            _decimal_key(decimal) if decimal is not None else None,
            (_numpy_state(numpy), _numpy_print_state(numpy)) if numpy is not None else None,
            _torch_key(torch._C, torch.get_default_dtype) if torch is not None else None, _log_token())


_RECURSION_LIMIT = sys.getrecursionlimit
_INT_DIGITS: Callable[[], int | None] = getattr(sys, "get_int_max_str_digits", lambda: None)


def _decimal_key(decimal: Any) -> tuple[Any, ...]:
    """decimal's context (pandas loads the module) and its fields but the flags, in one call."""
    context = decimal.getcontext()
    fields = context.__reduce__()[1]
    return context, fields[:6], fields[7]


def take_settings(theirs: Settings) -> None:
    """Make this process's settings the caller's (a worker, at each call that changed them). A
    library loaded here whose setting the caller left at its default is set back to it."""
    sys.setrecursionlimit(theirs.recursion_limit)
    if theirs.int_max_str_digits is not None and hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(theirs.int_max_str_digits)
    warnings.filters[:] = [f for f in map(_loaded_filter, theirs.warning_filters) if f is not None]  # type: ignore[index]
    mutated = getattr(warnings, "_filters_mutated", None)  # (the C part caches what the filters said)
    if mutated is not None:
        mutated()
    if theirs.decimal is not None or "decimal" in sys.modules:
        import decimal
        if theirs.decimal:
            prec, rounding, emin, emax, capitals, clamp, traps = theirs.decimal
            made = decimal.Context(prec, rounding, emin, emax, capitals, clamp,
                                   traps=[getattr(decimal, name) for name in traps])
        else:
            made = decimal.Context()  # (a copy of the default)
        decimal.setcontext(made)
    if theirs.numpy_errors is not None or theirs.numpy_print is not None or "numpy" in sys.modules:
        import numpy
        numpy.seterr(**(theirs.numpy_errors or NUMPY_ERRORS))  # type: ignore[arg-type]  # (numpy's own names)
        if _numpy_print() != theirs.numpy_print:
            numpy.set_printoptions(**(theirs.numpy_print or NUMPY_PRINT))
    if theirs.torch_modes is not None or "torch" in sys.modules:
        import torch
        _take_torch_modes(torch, theirs.torch_modes or _TORCH_DEFAULTS)
    _take_log_levels(*theirs.log_levels)


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


def _take_torch_modes(torch: Any, theirs: TorchModes) -> None:
    """Set each of torch's settings that differs from the caller's (inference mode before grad
    mode: entering or leaving it sets grad mode too)."""
    now = _torch_now(torch)
    if now.inference != theirs.inference:
        _take_inference(torch, theirs.inference)
    if bool(torch.is_grad_enabled()) != theirs.grad:
        torch.set_grad_enabled(theirs.grad)
    if now[1:3] != theirs[1:3]:  # (its first call loads torch's compiler stack: a second)
        torch.use_deterministic_algorithms(theirs.deterministic, warn_only=theirs.warn_only)
    if now.default_dtype != theirs.default_dtype:
        torch.set_default_dtype(getattr(torch, theirs.default_dtype))
    if now.matmul_precision != theirs.matmul_precision:
        torch.set_float32_matmul_precision(theirs.matmul_precision)
    if now[6:] != theirs[6:]:
        cudnn = torch.backends.cudnn
        cudnn.deterministic, cudnn.benchmark, cudnn.allow_tf32 = theirs[6:]


_INFERENCE = threading.local()  # `held`: the inference-mode guard this thread entered for its caller


def _take_inference(torch: Any, wanted: bool) -> None:
    """Enter or leave inference mode on this thread as the caller has it. torch offers no setter,
    only a guard (`torch.inference_mode()` enters one): the guard this thread entered for an
    earlier call is left first, which restores the mode from before it, and a new one is entered
    only if that is not the caller's."""
    held = getattr(_INFERENCE, "held", None)
    _INFERENCE.held = None
    if held is not None:
        held.__exit__(None, None, None)
    if bool(torch.is_inference_mode_enabled()) != wanted:
        guard = torch._C._InferenceMode(wanted)
        guard.__enter__()
        _INFERENCE.held = guard


def _named(category: Any) -> tuple[str, str]:
    """A warning category as (module, name): how `_loaded_filter` finds it again."""
    return (category.__module__, category.__qualname__) if isinstance(category, type) else ("", "")


def _loaded_filter(entry: Filter) -> Any:
    """A caller's warning filter, its category found among the modules this process has loaded;
    None while its module is not (docs/same-answer.md)."""
    action, message, (module, name), where, line = entry
    category = loaded_warning(module, name)
    return None if category is None else (action, message, category, where, line)


def loaded_warning(module: str, name: str) -> type[Warning] | None:
    """The warning category `name` of `module` where this process has loaded that module (never
    imported for it: a library's warning is the library's business once it is loaded here)."""
    found: Any = sys.modules.get(module)
    for part in name.split("."):
        found = getattr(found, part, None)
    return found if isinstance(found, type) and issubclass(found, Warning) else None


def thread_modes() -> Callable[[], Any]:
    """What of the calling thread's settings another thread must take to compute the same (the
    threaded executor's chunks): torch's grad and inference modes are the thread's own. (Decimal's
    context and numpy's error state and print options live in context variables: a copied
    `contextvars` context carries them; torch's other settings are the process's.)"""
    torch = sys.modules.get("torch")
    if torch is None:
        return _no_modes
    grad, inference = bool(torch.is_grad_enabled()), bool(torch.is_inference_mode_enabled())

    def take() -> None:
        _take_inference(torch, inference)  # (nothing to do where this thread holds no guard and agrees)
        torch.set_grad_enabled(grad)
    return take


def _no_modes() -> None:
    """Nothing to take: torch is not loaded."""


def _decimal() -> tuple[Any, ...] | None:
    decimal = sys.modules.get("decimal")
    if decimal is None:
        return None
    made, default = _fields(decimal.getcontext()), _fields(decimal.Context())  # (as a thread starts with it)
    return None if made == default else made


def _fields(c: Any) -> tuple[Any, ...]:
    """A decimal context as `Settings.decimal` holds it."""
    return c.prec, c.rounding, c.Emin, c.Emax, c.capitals, c.clamp, [t.__name__ for t, on in c.traps.items() if on]


def _numpy_errors() -> dict[str, str] | None:
    numpy = sys.modules.get("numpy")
    errors = numpy.geterr() if numpy is not None else None
    return None if errors is None or errors == NUMPY_ERRORS else errors


def _numpy_state(numpy: Any) -> Any:
    """numpy's error state as one object (numpy 2: its context variable's value), else its settings."""
    config = sys.modules.get("numpy._core._ufunc_config")
    state = getattr(config, "_extobj_contextvar", None)
    return state.get() if state is not None else tuple(sorted(numpy.geterr().items()))


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


def _torch_modes() -> TorchModes | None:
    torch = sys.modules.get("torch")
    modes = _torch_now(torch) if torch is not None else _TORCH_DEFAULTS
    return None if modes == _TORCH_DEFAULTS else modes


def _torch_now(torch: Any) -> TorchModes:
    """torch's settings (`TorchModes`) as set now."""
    raw = list(_torch_key(torch._C, torch.get_default_dtype))
    raw[4] = str(raw[4]).rpartition(".")[2]  # (torch.float64: "float64")
    return TorchModes(*raw)


def _torch_key(c: Any, default_dtype: Callable[[], Any]) -> tuple[Any, ...]:
    """`TorchModes`' fields as torch's own calls return them (the dtype an object): about 0.6 us."""
    return (c.is_grad_enabled(), c._get_deterministic_algorithms(), c._get_deterministic_algorithms_warn_only(),
            c.is_inference_mode_enabled(), default_dtype(), c._get_float32_matmul_precision(),
            c._get_cudnn_deterministic(), c._get_cudnn_benchmark(), c._get_cudnn_allow_tf32())


_TORCH_DEFAULTS = TorchModes()


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


def result_settings() -> bytes:
    """The settings that change the value a node returns for the same code and inputs, as cache
    key bytes (`cache.keys.result_settings`): decimal's context (`getcontext().prec = 5`), numpy's
    print options (an array's text), torch's default dtype and float32 matmul precision; b""
    while each is its default. Kept with the snapshot it was read from: about 3 us a call."""
    snapshot = current()
    kept, made = _KEYED[0]  # (one tuple: another thread replaces it whole)
    if snapshot is kept:
        return made
    s = snapshot.settings
    modes = s.torch_modes or _TORCH_DEFAULTS
    torch = (modes.default_dtype, modes.matmul_precision)
    parts = (s.decimal, s.numpy_print, None if torch == _TORCH_DEFAULTS[4:6] else torch)
    made = b"" if parts == (None, None, None) else repr(parts).encode()
    _KEYED[0] = (snapshot, made)
    return made


_KEYED: list[tuple[Any, bytes]] = [(None, b"")]  # the last snapshot `result_settings` read, and its answer
settings_from(result_settings)
