"""The worker process: receive a plan once, run chunks of items, report each result.

Kept import-light because it is imported in the fork server: each worker forks from there already
holding this module (and whatever `preload` named), so it starts in milliseconds. The parts:
this module sets the process up and answers the parent's messages (`messages.py`); `chunks.py`
runs a chunk's items; `replies.py` sends their results (a result that cannot be pickled here, or
unpickled in the parent, fails its own item and nothing else); `status.py` holds the status
words the parent reads, even after a death.
"""

from __future__ import annotations

import faulthandler
import functools
import multiprocessing.reduction  # noqa: F401  # (in the fork server: every worker's setup uses it, `main_by_value_in_pools`)
import os
import pickle
import select
import signal
import sys
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from importlib.machinery import ModuleSpec, PathFinder
from typing import TYPE_CHECKING, Any

from ..crash import handler as native_handler
from ..crash.containment import POISON, mark_contained
from ..crash.signals import FATAL_SIGNALS, on_fatal_signal
from ..crash.stacks import allow_tracing
from ..errors import ReplicaError
from ..observe.nodelog import LOG
from ..plan.compiled import Plan
from ..safety.environment import cap_loaded_runtimes, install_numba_guard
from ..shipping import build_plan, synced, transport
from ..shipping.context import Filter, loaded_warning, take_settings
from ..shipping.pickling import main_by_value_in_pools
from ..shipping.replica import Fetch, Refusal, Synced
from .breakpoints import no_terminal
from .chunks import Span, names_steps, run_chunk
from .lifeline import become_subreaper, end_descendants, end_worker, watch_peer
from .messages import Chunk, Context, Header, PlanSpec, Resend, Setup, Stop, Values
from .replies import REPLIES
from .status import IDLE, LOADING, READING, RETIRED, StatusWords, marked, marks, open_status

if TYPE_CHECKING:
    from ..model.node import Node


def run(fd: int) -> None:
    """A worker's life, however it was started: `fd` is its socket to the parent process.

    The first message says where its status words and faulthandler file are, and gives the
    parent's current environment (plus thread caps), sys.path, working directory and sys.argv: the
    worker imports the user's modules as the parent does (and a node reads the script's arguments),
    but never re-runs the parent's `__main__`.
    """
    conn = transport.Channel(fd)
    try:
        setup = Setup(*pickle.loads(conn.recv_bytes()))
        status_fd, fault_fd = transport.receive_fds(conn, 2)
    except (EOFError, OSError):
        os._exit(0)
    watch_peer(fd, end_worker)  # the parent died: so do we and our children
    become_subreaper()  # a node's processes stay under this worker, new sessions too (lifeline.py)
    _take_setup(setup)
    _install_crash_handlers(conn, fault_fd, fd)
    status = _open_status_words(status_fd)
    REPLIES.start(conn, status)  # and the worker's log records go to the parent
    mark_contained(functools.partial(_post_deadline, status))  # nested pipelines run here: a crash costs one item
    sys.breakpointhook = no_terminal  # no terminal here: breakpoint() fails its item saying how to debug
    code = 0
    try:
        code = _serve(conn, status)
    finally:
        for stream in (sys.stdout, sys.stderr):  # (None where the caller's was closed, start_method="fork")
            if stream is not None:
                stream.flush()
        _close_sqlite()
        end_descendants(os.getpid())  # the processes its nodes started end with it
        # Leave without running atexit handlers or native destructors: a library that crashes
        # while tearing down (as torch beside cuML did) cannot take results with it: they were sent.
        os._exit(code)


def _take_setup(setup: Setup) -> None:
    """The parent's environment (with thread caps), sys.path (and where its modules came from:
    `Pinned`), argv and working directory."""
    Pinned.take(setup.origins)
    os.environ.clear()
    os.environ.update(setup.environ)
    time.tzset()  # the C library reads TZ only when told to
    cap_loaded_runtimes()  # runtimes loaded before these variables (a forked parent's) read them now
    sys.path[:] = setup.sys_path
    sys.argv[:] = setup.argv  # a node reading its script's arguments reads the parent's, as in-process
    os.umask(setup.umask)
    take_settings(setup.settings)
    _take_filters(setup.settings.warning_filters)
    try:
        os.chdir(setup.cwd)
    except OSError:
        pass
    install_numba_guard()
    main_by_value_in_pools()  # a node's own process pool finds the script's functions
    if setup.preload_libs:  # dependencies first, so each library finds what it needs
        from ..native.libs import preload
        preload(packages=[p for p in setup.preload_libs if not os.path.isdir(p)],
                paths=[p for p in setup.preload_libs if os.path.isdir(p)])


class Pinned:
    """First on a worker's `sys.meta_path`: each top-level module or package its caller has loaded
    from a file is found in the folder the caller loaded it from, and nowhere else (`origins`, sent
    with the setup and each context: `messages.Origins`). So a `numpy.py` or `helpers.py` in a folder the caller
    changed to since (`''` first on sys.path: `python -`, `python -c`, a notebook's `%cd`), another
    user's in a shared one, is never imported in its place (docs/security.md). A package's
    submodules follow its `__path__`; a name the caller has not loaded follows sys.path, as the
    caller's own import would (`''`: the working directory, the caller's)."""

    origins: dict[str, tuple[str, ...]] = {}

    @classmethod
    def take(cls, origins: object) -> None:
        """The caller's table, as sent (`messages.Origins`): taken before anything here imports."""
        cls.origins = origins if isinstance(origins, dict) else {}
        if cls not in sys.meta_path:
            sys.meta_path.insert(0, cls)

    @classmethod
    def find_spec(cls, name: str, path: Sequence[str] | None = None, target: Any = None) -> ModuleSpec | None:
        folders = cls.origins.get(name) if path is None else None
        if folders is None:
            return None
        spec = PathFinder.find_spec(name, list(folders), target)
        if spec is None:  # (removed since: the plan's loading falls back to the caller's objects)
            raise ModuleNotFoundError(f"No module named {name!r} in {os.pathsep.join(folders)}, where the "
                                      "calling process loaded it from (a worker imports it from there alone)",
                                      name=name)
        return spec


def _install_crash_handlers(conn: transport.Channel, fault_fd: int, fd: int) -> None:
    """What a dying worker leaves behind, in order: its native frames, its unsent results (its
    last words), then faulthandler's Python stack, all in the crash file the parent reads. A
    process a node forks inherits these handlers; there they stand aside (`native_handler.remember`,
    `_helpers_faulthandler`)."""
    signals = (*FATAL_SIGNALS, "SIGUSR1")
    put_back = native_handler.remember(signals)  # (first: before any of hardy's)
    os.register_at_fork(after_in_child=functools.partial(_helpers_faulthandler, faulthandler.is_enabled(), signals))
    fault_file = open(fault_fd, "w")  # noqa: SIM115 - faulthandler writes here until the process ends
    faulthandler.enable(file=fault_file, all_threads=True)
    # The parent sends SIGUSR1 before killing a hung or oversized worker: the stack of a loop in C too.
    # Then the worker waits for the kill (`chain` to `hold`): the call the signal interrupted (a
    # `sleep()` in C, which does not restart) must not return and send its result.
    native_handler.hold(signal.SIGUSR1)
    faulthandler.register(signal.SIGUSR1, file=fault_file, all_threads=True, chain=True)
    # Before faulthandler writes the stack: results not sent yet go now, so those items never run again.
    on_fatal_signal(lambda signum: REPLIES.last_words(fault_file.fileno()), signals, elsewhere=put_back)
    native_handler.install(fault_file.fileno())  # in front of both: the native frames, written first
    REPLIES.guard_exits(fault_file.fileno())  # os._exit, exit() from C: the same last words
    allow_tracing(fd)  # py-spy, started by the parent, may read a hung worker's stacks


def _helpers_faulthandler(was_on: bool, signals: tuple[str, ...]) -> None:
    """In a process a node forks (from Python), faulthandler as it would be there without hardy:
    on, writing to stderr, if it was on before the worker's (PYTHONFAULTHANDLER); else off; and
    the worker's SIGUSR1 registration gone. So the helper's own `faulthandler.enable()` or
    `register()` installs its handlers (hardy's, on, would leave them behind the handlers in
    front). Turning them off puts back the handlers from before them, over any a node installed
    since: the dispositions as they are are kept."""
    put_back = native_handler.kept(signals)
    if was_on:
        faulthandler.enable(file=2, all_threads=True)  # (on: only its file changes)
    else:
        faulthandler.disable()
    faulthandler.unregister(signal.SIGUSR1)  # (the worker's: the helper may register its own)
    put_back()


def _open_status_words(status_fd: int) -> StatusWords:
    _, status = open_status(status_fd)
    os.close(status_fd)  # (the mapping stays)
    status.item = IDLE
    status.step = status.deadline = -1
    status.ready = 1.0
    return status


def _post_deadline(status: StatusWords, t: float) -> float:
    """A nested node's deadline, for the parent to enforce (`crash.containment.deadlined`); the one before."""
    before, status.deadline = status.deadline, t
    return float(before)


def _serve(conn: transport.Channel, status: StatusWords) -> int:
    """Answer the parent's messages until it says stop or goes away; the exit code."""
    plans: dict[int, list[Any]] = {}  # id -> [spec, loaded plan, the logged one once asked for, its replica, dated]
    backlog: deque[Any] = deque()  # messages that came while a plan's load waited for the caller's objects
    fetch = functools.partial(_fetch, conn, status, backlog)
    fd = conn.fileno()
    readable = select.poll()
    readable.register(fd, select.POLLIN)
    spin = False  # one item was answered (a call): the caller's next may come within microseconds
    while True:
        if backlog:
            msg = backlog.popleft()
        else:
            if spin:
                transport.spin_for(readable, transport.SPIN)
            try:
                data = transport.read_frame(fd)
            except EOFError:
                return 0
            msg = _read(conn, data, status)
        kind, spin = type(msg), False
        if kind is tuple:  # a chunk in its short form: nothing but items (`Chunk.wire`), maybe consecutive ones
            if POISON:
                POISON.clear()
            entry = plans[msg[0]]
            replica = entry[3]
            items = _pairs(msg)
            current = (replica is None or replica.current()) and not _PENDING  # (`_current` takes the rest)
            if not run_chunk(entry[1] if current else _current(entry, status, fetch), items, status, False):
                return RETIRED
            spin = _one_item(items)
        elif kind is Chunk:
            POISON.clear()
            POISON.update(msg.poison or {})
            entry = plans[msg.plan_id]
            loaded = _current(entry, status, fetch)
            if not run_chunk(_plan(loaded, entry, msg.log, status, fetch), msg.items, status, msg.log, msg.sealed,
                             msg.singly):
                return RETIRED
        elif msg is None:
            continue
        elif kind is PlanSpec:
            loaded, replica = _load_plan(msg.spec, status, fetch, dated=msg.dated)
            plans[msg.plan_id] = [msg.spec, loaded, None, replica, msg.dated]
        elif kind is Context:
            _take_context(msg)
        elif isinstance(msg, Resend):
            REPLIES.resend(msg.items)
        elif isinstance(msg, Stop):
            return 0
        # (else: an answer to a question no longer asked, `Values` of a plan that has loaded since)


def _pairs(msg: tuple[Any, ...]) -> Iterable[tuple[int, dict[str, Any]]] | Span:
    """The items of a chunk in its short form (`Chunk.wire`): (plan_id, pairs), (index, inputs)
    pairs; or consecutive items from the first one's index (a `Span`): (plan_id, first, inputs),
    or (plan_id, first, constants, name, values) for a map over one input (`columns.Items`)."""
    if len(msg) == 2:
        pairs: Iterable[tuple[int, dict[str, Any]]] = msg[1]
        return pairs
    if len(msg) == 3:
        return Span(msg[1], {}, None, msg[2])
    return Span(*msg[1:])


def _one_item(items: Iterable[tuple[int, dict[str, Any]]] | Span) -> bool:
    """Whether a chunk in its short form held one item: `run()`'s call, or a small map's."""
    return len(items.values if isinstance(items, Span) else items) == 1  # type: ignore[arg-type]


def _take_context(context: Context) -> None:
    """The caller's environment, working directory, argv, sys.path and settings at this call (as `_take_setup`)."""
    os.environ.update(context.environ)
    for name in context.unset:
        os.environ.pop(name, None)
    if "TZ" in context.environ or "TZ" in context.unset:
        time.tzset()  # the C library reads TZ only when told to (the caller called it, or started with it)
    os.umask(context.umask)
    sys.argv[:] = context.argv
    Pinned.take(context.origins)
    sys.path[:] = context.sys_path
    take_settings(context.settings)
    _take_filters(context.settings.warning_filters)
    try:
        os.chdir(context.cwd)
    except OSError:  # gone, or not readable here: the node fails as it would there
        pass


def _take_filters(theirs: tuple[Filter, ...]) -> None:
    """The caller's warning filters, in its order, each category found among the modules this
    process has loaded, else a stand-in (`Unloaded`): a library's category before the plan imports
    the library, a user module's before a node imports it, the script's own (a worker's
    `__main__` is not the script's). No module is imported for a filter."""
    made = [(action, message, (loaded_warning(*category) if category[0] != "__main__" else None)
             or _stand_in(*category), module, line) for action, message, category, module, line in theirs]
    warnings.filters[:] = made  # type: ignore[index]
    mutated = getattr(warnings, "_filters_mutated", None)  # (the C part caches what the filters said)
    if mutated is not None:
        mutated()
    _TAKEN[:] = [theirs, made]
    _PENDING[:] = [category for (_, _, category, _, _), entry in zip(theirs, made)
                   if isinstance(entry[2], Unloaded) and category[0] != "__main__"]


_TAKEN: list[Any] = [(), []]  # the caller's filters as they came, and as `_take_filters` made them
_PENDING: list[tuple[str, str]] = []  # the categories (module, name) of its stand-ins whose module may load


def _filters_again() -> None:
    """The caller's filters made again where the modules loaded since changed them: after a plan
    is loaded, and before each chunk while a stand-in's module may still load (`_PENDING`). A
    module's import may put its own filters first (numpy's `RankWarning` "always"), ahead of the
    caller's; and a stand-in becomes its category, once that is loaded."""
    theirs, made = _TAKEN
    if warnings.filters != made or any(loaded_warning(*category) is not None for category in _PENDING):
        _take_filters(theirs)


class Unloaded(type):
    """The kind of a stand-in for a warning category this worker had not loaded when it took its
    caller's filters (`_take_filters`). `warnings` asks `issubclass(warned, filter's category)`:
    a stand-in answers by module and name along the warned category's bases, so the filter applies
    as soon as its category exists here, midway through a call too. It costs a call only where a
    warning reaches such a filter."""

    def __subclasscheck__(cls, sub: Any) -> bool:
        named = (cls.__module__, cls.__qualname__)
        return isinstance(sub, type) and any((k.__module__, k.__qualname__) == named for k in sub.__mro__)


@functools.cache
def _stand_in(module: str, name: str) -> type:
    """The one `Unloaded` stand-in (a `Warning` subclass) for the category `name` of `module`."""
    return Unloaded(name.rpartition(".")[2], (Warning,), {"__module__": module, "__qualname__": name})


def _fetch(conn: transport.Channel, status: StatusWords, backlog: deque[Any], replica_id: int,
           wanted: list[tuple[str, str]]) -> Any:
    """Ask the caller for the objects of its modules that this worker's copies lack (`shipping.replica`),
    and wait for them; messages that come meanwhile are kept for later, in order."""
    conn.send_bytes(Header(False, False, False, False, False, 0.0, need=True).pack()
                    + pickle.dumps((replica_id, wanted), protocol=5))
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:
            os._exit(0)
        before = status.item
        msg = _read(conn, data, status)
        status.item = before
        if isinstance(msg, Values) and msg.replica == replica_id:
            return msg.values
        if msg is not None:
            backlog.append(msg)


def _close_sqlite() -> None:
    """Close the SQLite connections this worker opened (a cache's index), as an interpreter's exit
    would: the last one to close folds the write-ahead log into the index, so a cache filled by
    workers reads whole where only the index file is read (a read-only mount). Nothing else is
    finalised."""
    sqlite3 = sys.modules.get("sqlite3")
    if sqlite3 is None:
        return
    import gc
    for obj in gc.get_objects():
        if type(obj) is sqlite3.Connection:
            try:
                obj.close()
            except Exception:
                pass


def _read(conn: Any, data: bytes, status: StatusWords) -> Any:
    """The message in `data`; None if it could not be unpickled here (a chunk's item whose class
    this process cannot import, or whose rebuilding raises): the parent is told, and sends the
    chunk again sealed (`chunks.open_item`). Should the unpickling crash the process instead, the status
    words say it died READING, with the same outcome."""
    status.item = READING
    try:
        if not transport.packed(data):
            return pickle.loads(data)
        return transport.unpack(conn, memoryview(data))
    except EOFError:  # the parent died while passing the message's segments
        raise
    except Exception as exc:  # whatever a __setstate__ raises (an OSError too) costs its item alone
        why = pickle.dumps(f"{type(exc).__name__}: {exc}")
        conn.send_bytes(Header(True, False, False, True, False, 0.0).pack() + why)
        return None
    finally:
        status.item = IDLE


def _current(entry: list[Any], status: StatusWords, fetch: Fetch) -> tuple[Plan, dict[str, str]] | str:
    """The entry's plain plan, with this worker's modules made its caller's again if another
    plan's sync changed them since (`shipping.replica.Synced`), and the caller's warning filters
    taken again while one's category was not loaded (`_filters_again`): before each chunk."""
    if _PENDING:
        _filters_again()
    loaded: tuple[Plan, dict[str, str]] | str = entry[1]
    replica: Synced | None = entry[3]
    if replica is not None and not isinstance(loaded, str) and not replica.current():
        before, status.item = status.item, LOADING
        try:
            replica.sync(fetch)
        except Exception as exc:
            return _unloadable(exc)
        finally:
            status.item = before
    return loaded


def _plan(plain: tuple[Plan, dict[str, str]] | str, entry: list[Any], log: bool, status: StatusWords,
          fetch: Fetch) -> tuple[Plan, dict[str, str]] | str:
    """The plain plan, or (when the parent listens to node events) the logged one, built once.
    A plan whose steps may start out of order (a cache looks its hits up before its misses run;
    async nodes are gathered; a batched node's items wait for each other) names each step in the log."""
    if not log or isinstance(plain, str):
        return plain
    if entry[2] is None:
        entry[2] = _load_plan(entry[0], status, fetch, log="named" if names_steps(plain[0]) else "bare",
                              dated=entry[4])[0]
    logged: tuple[Plan, dict[str, str]] | str = entry[2]
    return logged


def _load_plan(spec: bytes, status: StatusWords, fetch: Fetch, log: str = "",
               dated: bool = True) -> tuple[tuple[Plan, dict[str, str]] | str, Synced | None]:
    """The plan and which node produces each output, or why it cannot be loaded here; and its
    replica (`shipping.replica`). `log`: the plan notes its node calls (observe/nodelog.py),
    "bare" or "named" (see `_plan`); `dated`: the status words say when each call began (the
    parent enforces a timeout or reports stalls: `PlanSpec.dated`), else only which step runs,
    which a plain plan writes in its own code (`Plan.marks`)."""
    steps: dict[str, int] = {}  # its node names by step, for its cache hits' log entries

    def wrap(k: int, n: Node) -> Callable[..., Any]:
        if not log:
            return marked(status, k, n.func, dated=dated)
        steps[n.name] = k
        if n.is_async:  # its calls may overlap: the log notes each whole (and the status its creation)
            return LOG.note(k, n, marked(status, k, n.func))
        return marked(status, k, LOG.note(k, n, n.func), LOG.data, named=log == "named")
    wrap.observes = bool(log)  # type: ignore[attr-defined]  # (hardy.parts.batching: else it only dates calls)
    if not log and not dated:
        wrap.inline = marks(status)  # type: ignore[attr-defined]
    before, status.item = status.item, LOADING
    try:
        replica = synced(spec, fetch)[0]
        plan = build_plan(spec, wrap=wrap, on_cached=LOG.cache_hook(steps) if log else None)
        _filters_again()  # (the modules it imported may have put their filters first)
    except Exception as exc:
        return _unloadable(exc), None
    finally:
        status.item = before
    return (plan, {o: s.node.name for s in plan.steps for o in s.node.outputs}), replica


def _unloadable(exc: Exception) -> str:
    if isinstance(exc, ReplicaError):
        return Refusal(exc)
    return (f"the pipeline could not be loaded in the worker process ({type(exc).__name__}: {exc}); "
            "its nodes must come from the script or a module importable from the parent's sys.path "
            "(a module loaded from elsewhere can be sent by value with "
            "cloudpickle.register_pickle_by_value)")
