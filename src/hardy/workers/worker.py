"""The worker process: receive a plan once, run chunks of items, report each result.

Kept import-light because it is imported in the fork server: each worker forks from there already
holding this module (and whatever `preload` named), so it starts in milliseconds. A result that
cannot be pickled here, or unpickled in the parent, fails its own item and nothing else (`_send`).
"""

from __future__ import annotations

import ctypes
import faulthandler
import functools
import logging
import mmap
import os
import pickle
import signal
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from .. import transport
from ..batching import Batched, batched
from ..crash import FATAL_SIGNALS, POISON, mark_contained, nesting_line, on_fatal_signal
from ..errors import CudaError, NodeError
from ..forensics import handler as native_handler
from ..forensics.stacks import allow_tracing
from ..observe.nodelog import BATCHED, CACHED, FAILED, LOG, RAISED, SPAN, WAIT, NodeLogBatch, row_logs
from ..observe.nodelog import ITEM as BEGINS
from ..observe.nodelog import STEP as STEP_NAMED
from ..plan import Plan
from ..safety.environment import cap_loaded_runtimes, install_numba_guard
from ..shipping import build_plan, dumps, open_input, out_of_band, portable, unopened
from .lifeline import kill_group, watch_peer
from .messages import Chunk, Header, PlanSpec, Resend, Setup

# Shared status words, written by the worker, read by the parent after a death or for deadlines:
# doubles, because the step's start is `time.monotonic()`, the clock of the node log (nodelog.py);
# the item and the step are small integers, exact in a double. READY turns 1 once the worker is set
# up (so a death before is its setup's: preload_libs, the environment; a death after never is).
# Between items, ITEM says what the worker does: IDLE, READING a message (a chunk's items are
# unpickled then), or SENDING results (pickled then), and STEP how many results that batch holds.
# DEADLINE: the deadline of a node nested in a step (crash.deadlined), for the parent to enforce.
ITEM, STEP, STEP_START, READY, DEADLINE, SLOTS = 0, 1, 2, 3, 4, 5
IDLE, READING, SENDING, LOADING = -1, -3, -4, -5  # LOADING: the pipeline, its nodes' modules
BATCH = -2  # ITEM while a batched node's call runs: the parent splits the batch if the worker dies
OPENING = -2  # STEP while a sealed item's input k is unpickled: OPENING - k (ITEM is the item)
STATUS_SIZE = 8 * SLOTS
FLUSH_EVERY = 0.005  # seconds: fast items are batched, slow items are reported one by one
RETIRED = 75  # the exit code of a worker that left after a sticky CUDA error (or a GPU OOM to retry)


def open_status(fd: int) -> tuple[mmap.mmap, Any]:
    mm = mmap.mmap(fd, STATUS_SIZE)
    return mm, (ctypes.c_double * SLOTS).from_buffer(mm)


def _marked(status: Any, k: int, func: Callable[..., Any], log: list[float] | None = None,
            named: bool = False) -> Callable[..., Any]:
    """`func`, dating each call in the status words (for the parent's deadlines and crash
    reports); `log`: also noted in the node log (observe/nodelog.py), with the same clock read,
    as a bare start time (the item's next step) or, `named`, with its step."""
    clock = time.monotonic

    if log is None:
        def call(*args: Any, **kwargs: Any) -> Any:
            status[STEP] = k
            status[STEP_START] = clock()
            return func(*args, **kwargs)
        return call
    note: Callable[[float], None] = log.append
    if named:
        def note(now: float) -> None:
            log.extend((STEP_NAMED, k, now))

    def logged(*args: Any, **kwargs: Any) -> Any:
        status[STEP] = k
        status[STEP_START] = now = clock()
        note(now)
        try:
            return func(*args, **kwargs)
        except BaseException as exc:  # an attempt its node's policy may retry: the log says it raised
            LOG.raised(exc)
            raise
    return logged


def run(fd: int) -> None:
    """A worker's life, however it was started: `fd` is its socket to the parent process.

    The first message says where its status words and faulthandler file are, and gives the
    parent's current environment (plus thread caps), sys.path, working directory and sys.argv: the
    worker imports the user's modules as the parent does (and a node reads the script's arguments),
    but never re-runs the parent's `__main__`.
    """
    conn = Connection(fd)
    try:
        setup = Setup(*pickle.loads(conn.recv_bytes()))
        status_fd, fault_fd = transport.receive_fds(conn, 2)
    except (EOFError, OSError):
        os._exit(0)
    watch_peer(fd, lambda: kill_group(os.getpgid(0)))  # the parent died: so do we and our children
    _take_setup(setup)
    sent: list[Sent] = []  # the last chunk's batches of results, until the next chunk
    _install_crash_handlers(conn, sent, fault_fd, fd)
    status = _open_status_words(status_fd)
    mark_contained(functools.partial(_post_deadline, status))  # nested pipelines run here: a crash costs one item
    _forward_logs(status)
    code = 0
    try:
        code = _serve(conn, status, sent)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        _close_sqlite()
        # Leave without running atexit handlers or native destructors: a library that crashes
        # while tearing down (as torch beside cuML did) cannot take results with it: they were sent.
        os._exit(code)


def _take_setup(setup: Setup) -> None:
    """The parent's environment (with thread caps), sys.path, argv and working directory."""
    os.environ.clear()
    os.environ.update(setup.environ)
    cap_loaded_runtimes()  # runtimes loaded before these variables (a forked parent's) read them now
    sys.path[:] = setup.sys_path
    sys.argv[:] = setup.argv  # a node reading its script's arguments reads the parent's, as in-process
    try:
        os.chdir(setup.cwd)
    except OSError:
        pass
    install_numba_guard()
    if setup.preload_libs:  # dependencies first, so each library finds what it needs
        from ..native.libs import preload
        preload(packages=[p for p in setup.preload_libs if not os.path.isdir(p)],
                paths=[p for p in setup.preload_libs if os.path.isdir(p)])


def _install_crash_handlers(conn: Connection, sent: list[Sent], fault_fd: int, fd: int) -> None:
    """What a dying worker leaves behind, in order: its native frames, its unsent results (its
    last words), then faulthandler's Python stack, all in the crash file the parent reads."""
    fault_file = open(fault_fd, "w")  # noqa: SIM115 - faulthandler writes here until the process ends
    faulthandler.enable(file=fault_file, all_threads=True)
    # The parent sends SIGUSR1 before killing a hung or oversized worker: the stack of a loop in C too.
    faulthandler.register(signal.SIGUSR1, file=fault_file, all_threads=True)
    # Before faulthandler writes the stack: results not sent yet go now, so those items never run again.
    on_fatal_signal(lambda signum: _last_words(conn, sent, fault_file.fileno()), (*FATAL_SIGNALS, "SIGUSR1"))
    native_handler.install(fault_file.fileno())  # in front of both: the native frames, written first
    allow_tracing(fd)  # py-spy, started by the parent, may read a hung worker's stacks


def _open_status_words(status_fd: int) -> Any:
    _, status = open_status(status_fd)
    os.close(status_fd)  # (the mapping stays)
    status[ITEM] = IDLE
    status[STEP] = status[DEADLINE] = -1
    status[READY] = 1.0
    _status[0] = status
    return status


def _post_deadline(status: Any, t: float) -> float:
    """A nested node's deadline, for the parent to enforce (`crash.deadlined`); the one before."""
    before, status[DEADLINE] = status[DEADLINE], t
    return float(before)


def _serve(conn: Connection, status: Any, sent: list[Sent]) -> int:
    """Answer the parent's messages until it says stop or goes away; the exit code."""
    plans: dict[int, list[Any]] = {}  # id -> [spec, loaded plan, the logged one once asked for]
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:
            return 0
        msg = _read(conn, data, status)
        if msg is None:
            continue
        if isinstance(msg, PlanSpec):
            plans[msg.plan_id] = [msg.spec, _load_plan(msg.spec, status), None]
        elif isinstance(msg, Chunk):
            POISON.clear()
            POISON.update(msg.poison or {})
            loaded = _plan(plans[msg.plan_id], msg.log, status)
            if not _run_chunk(conn, loaded, msg.items, status, sent, msg.log, msg.sealed, msg.singly):
                return RETIRED
        elif isinstance(msg, Resend):
            _resend(conn, sent, msg.items)
        else:  # Stop
            return 0


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


def _read(conn: Any, data: bytes, status: Any) -> Any:
    """The message in `data`; None if it could not be unpickled here (a chunk's item whose class
    this process cannot import, or whose rebuilding raises): the parent is told, and sends the
    chunk again sealed (`_open`). Should the unpickling crash the process instead, the status
    words say it died READING, with the same outcome."""
    status[ITEM] = READING
    try:
        return transport.unpack(conn, memoryview(data))
    except EOFError:  # the parent died while passing the message's segments
        raise
    except Exception as exc:  # whatever a __setstate__ raises (an OSError too) costs its item alone
        why = pickle.dumps(f"{type(exc).__name__}: {exc}")
        conn.send_bytes(Header(True, False, False, True, False, 0.0).pack() + why)
        return None
    finally:
        status[ITEM] = IDLE


def _plan(entry: list[Any], log: bool, status: Any) -> tuple[Plan, dict[str, str]] | str:
    """The plain plan, or (when the parent listens to node events) the logged one, built once.
    A plan whose steps may start out of order (a cache looks its hits up before its misses run;
    async nodes are gathered; a batched node's items wait for each other) names each step in the log."""
    plain: tuple[Plan, dict[str, str]] | str = entry[1]
    if not log or isinstance(plain, str):
        return plain
    if entry[2] is None:
        entry[2] = _load_plan(entry[0], status, log="named" if _named(plain[0]) else "bare")
    logged: tuple[Plan, dict[str, str]] | str = entry[2]
    return logged


def _named(plan: Plan) -> bool:
    """Whether the log of `plan` names its steps and its items: in a bare log, a start time is
    the item's next step, and the first one the item's beginning (observe/nodelog.py)."""
    return plan.cache is not None or not plan.steps or any(s.node.is_async or s.node.batch for s in plan.steps)


def _load_plan(spec: bytes, status: Any, log: str = "") -> tuple[Plan, dict[str, str]] | str:
    """The plan and which node produces each output; or why it cannot be loaded here. `log`: the
    plan notes its node calls (observe/nodelog.py), "bare" or "named" (see `_plan`)."""
    steps: dict[str, int] = {}  # its node names by step, for its cache hits' log entries

    def marked(k: int, n: Any) -> Callable[..., Any]:
        if not log:
            return _marked(status, k, n.func)
        steps[n.name] = k
        if n.is_async:  # its calls may overlap: the log notes each whole (and the status its creation)
            return LOG.note(k, n, _marked(status, k, n.func))
        return _marked(status, k, LOG.note(k, n, n.func), LOG.data, named=log == "named")
    marked.observes = bool(log)  # type: ignore[attr-defined]  # (hardy.batching: else it only dates calls)
    before, status[ITEM] = status[ITEM], LOADING
    try:
        plan = build_plan(spec, wrap=marked, on_cached=LOG.cache_hook(steps) if log else None)
    except Exception as exc:
        return (f"the pipeline could not be loaded in the worker process ({type(exc).__name__}: {exc}); "
                "its nodes must come from the script or a module importable from the parent's sys.path "
                "(a module loaded from elsewhere can be sent by value with "
                "cloudpickle.register_pickle_by_value)")
    finally:
        status[ITEM] = before
    return plan, {o: s.node.name for s in plan.steps for o in s.node.outputs}


_unsent: list[tuple[Any, ...]] = []  # results of the current chunk not sent yet
Sent = tuple[list[tuple[Any, ...]], NodeLogBatch | None]  # a batch of results sent, with its node log
_producers: dict[str, str] = {}  # output -> node, of the plan running now
_names: list[tuple[str, ...] | None] = [None]  # its nodes by step, while its calls are logged
_sending = [False]
_status: list[Any] = [None]  # the status words, for `_send`


def _run_chunk(conn: Any, loaded: tuple[Plan, dict[str, str]] | str,
               items: list[tuple[int, dict[str, Any]]], status: Any, sent: list[Sent], log: bool,
               sealed: int = 0, singly: bool = False) -> bool:
    """Run the items; `log`: their node calls are logged and each batch carries its log
    (observe/nodelog.py); `sealed`: the chunk is sent again after it could not be unpickled whole,
    so each item's inputs are opened one by one (`_open`), and, 2, after its results could not be
    pickled without a crash: each result is then sent alone; `singly`: a batched node is called
    for one item at a time. False when the worker must retire: after a sticky CUDA error every
    later CUDA call here would fail, so the rest of the chunk goes back to the parent unrun."""
    sent.clear()
    _names[0] = None
    if isinstance(loaded, str):
        _send(conn, [(i, False, NodeError("<pipeline>", None, i, loaded)) for i, _ in items], {}, True, 0.0, sent)
        return True
    plan, producers = loaded
    _producers.clear()
    _producers.update(producers)
    _names[0] = tuple(s.node.name for s in plan.steps) if log else None
    group = batched(plan)
    if group is not None:
        if sealed:  # opened first; an input that cannot be fails its item (sent with the first results)
            items = _open_all(plan, items, status)
        return _run_batched(conn, group, plan, items, status, sent, 1 if singly else group.group, log)
    named = log and _named(plan)
    note, clock = LOG.data.extend if named else None, time.monotonic  # bare: items begin with a node call
    start = last = clock()
    batch = _unsent
    for i, item in items:
        now = clock()  # one clock read: when the last batch went, and when this item began
        if batch and (sealed == 2 or now - last >= FLUSH_EVERY):
            _send(conn, batch, producers, False, 0.0, sent)
            last = now = clock()
        status[STEP] = -1
        status[ITEM] = i
        if sealed:
            item = _open(plan, i, item, status)
            if isinstance(item, NodeError):
                batch.append((i, False, item))
                continue
        if note:
            note((BEGINS, now))  # an item begins (nodelog.py)
        try:
            batch.append((i, True, plan.run(item, i)))
        except NodeError as err:  # a node's call that raised logged it (an error between calls is no node's)
            if log:
                LOG.failed(None if named or status[STEP] >= 0 else now)
            batch.append((i, False, portable(err)))
            if isinstance(err, CudaError) and err.retires_worker:
                status[ITEM] = IDLE
                _send(conn, batch, producers, False, 0.0, sent)
                return False
        status[ITEM] = IDLE
    if plan.cache is not None:
        plan.cache.report()  # the cache faults of this batch, in one warning
    _send(conn, batch, producers, True, clock() - start, sent)
    return True


def _open_all(plan: Plan, items: list[tuple[int, dict[str, Any]]], status: Any) -> list[tuple[int, Any]]:
    """A sealed chunk's items opened before a batched plan runs them; one that cannot be opened
    fails alone (its error goes with the first results)."""
    opened = []
    for i, item in items:
        status[ITEM] = i
        value = _open(plan, i, item, status)
        if isinstance(value, NodeError):
            _unsent.append((i, False, value))
        else:
            opened.append((i, value))
    status[ITEM] = IDLE
    return opened


def _run_batched(conn: Any, group: Batched, plan: Plan, items: list[tuple[int, dict[str, Any]]], status: Any,
                 sent: list[Sent], size: int, log: bool) -> bool:
    """`_run_chunk` for a plan with batched nodes (`hardy.batching`): the status words name the
    item running, or BATCH and the node while a batch call runs; a group's results are sent as
    soon as they exist, so a crash in a later batch costs none of them. `log`: node events are
    logged (`_Arranged`)."""
    clock = time.monotonic
    start = last = clock()
    batch = _unsent
    arranged = _Arranged() if log else None

    def at(i: int, span: tuple[float, float] | None = None) -> None:
        status[STEP] = -1
        status[ITEM] = i
        if arranged is not None:
            arranged.at(i, span)

    def calling(k: int) -> None:
        if arranged is not None:
            arranged.flush()
        status[ITEM] = BATCH
        status[STEP] = k
        status[STEP_START] = clock()

    if arranged is not None:
        for row in batch:  # sealed items that could not be opened: logged first, as their rows are sent
            arranged.ended(row[0])
    try:
        for i, ok, value in group.run(items, at, calling, size=size,
                                      called=arranged.called if arranged is not None else None):
            if arranged is not None:
                arranged.ended(i)
            batch.append((i, True, value) if ok else (i, False, portable(value)))
            if not ok and isinstance(value, CudaError) and value.retires_worker:
                status[ITEM] = -1
                _send(conn, batch, _producers, False, 0.0, sent)
                return False
            now = clock()
            if now - last >= FLUSH_EVERY:
                _send(conn, batch, _producers, False, 0.0, sent)
                last = clock()
            if arranged is not None:
                arranged.mark = _complete[0] = len(LOG.data)
    finally:
        _complete[0] = None
    status[ITEM] = -1
    if plan.cache is not None:
        plan.cache.report()
    _send(conn, batch, _producers, True, clock() - start, sent)
    return True


def _details(entries: list[float], base: int) -> list[tuple[int, Any]]:
    """(where, the detail) of each entry of a logged part naming one of `LOG.details` (what a
    node raised, a cache hit's signature), `base` added to where: an item's entries wait for its
    end, and the details they name are taken with each batch of results sent meanwhile."""
    found, p = [], 0
    while p < len(entries):
        code = entries[p]
        if code == RAISED:
            found.append((base + p + 2, LOG.details[int(entries[p + 2])]))
        elif code == CACHED:
            found.append((base + p + 1, LOG.details[int(entries[p + 1])]))
        elif code == SPAN and entries[p + 2]:
            found.append((base + p + 2, LOG.details[int(entries[p + 2]) - 1]))
        p += 1 if code >= 0 else 3 if code in (STEP_NAMED, RAISED) else 5 if code == SPAN else 2
    return found


_complete: list[int | None] = [None]  # where the node log's complete items end, while a batched plan logs


class _Arranged:
    """The node log of a batched plan's chunk, item by item. Its items wait for each other at each
    batched node, so their node calls interleave; the log (observe/nodelog.py) wants each item's
    calls together, in the order the items' rows are sent. So what an item's plans log is moved
    aside as it runs (`at`, `flush`) and written whole when the item's outcome is (`ended`):
    `ITEM` its start, its steps named, `WAIT` where each part of it ends, the batch calls made
    since the last item written (`BATCH`: the node's step, its items, start and end), `FAILED`
    (ends the item, failed or not). The batched node's own step, for an item, lasts the item's
    share of the call that computed it (`hardy.batching`)."""

    def __init__(self) -> None:
        self.items: dict[int, list[float]] = {}
        self.kept: dict[int, list[tuple[int, Any]]] = {}  # per item: (where in its entries, a detail it names)
        self.current: int | None = None
        self.span: tuple[float, float] | None = None
        self.mark = _complete[0] = len(LOG.data)
        self.calls: list[tuple[int, int, float, float]] = []

    def flush(self) -> None:
        """What the item running logged since it began its part, moved to its own entries."""
        data, mark = LOG.data, self.mark
        entries = self.items.get(self.current) if self.current is not None else None
        if entries is not None and len(data) > mark:
            moved = data[mark:]
            if self.span is not None and moved[0] == STEP_NAMED:  # the batched node: its share of the call
                moved[2] = self.span[0]
                if len(moved) > 3 and moved[3] == RAISED:
                    moved[4] = self.span[1]
            self.kept.setdefault(self.current, []).extend(_details(moved, len(entries)))  # type: ignore[arg-type]
            entries += moved
            entries += (WAIT, self.span[1] if self.span is not None else time.monotonic())
        del data[mark:]
        self.current, self.span = None, None

    def at(self, i: int, span: tuple[float, float] | None) -> None:
        self.flush()
        if i not in self.items:
            self.items[i] = [BEGINS, time.monotonic()]
        self.current, self.span = i, span

    def called(self, k: int, n: int, start: float, end: float) -> None:
        self.calls.append((k, n, start, end))

    def ended(self, i: int) -> None:
        """Item i's outcome is out: its entries (and the calls made since the last) into the log."""
        self.flush()
        now = time.monotonic()
        entries = self.items.pop(i, None) or [BEGINS, now]
        for at, detail in self.kept.pop(i, ()):  # the log's details may have been sent since: kept again
            LOG.details.append(detail)
            entries[at] = len(LOG.details) - 1 + (entries[at - 2] == SPAN)
        data = LOG.data
        data += entries[:2]
        for k, n, start, end in self.calls:
            LOG.details.append(n)
            data += (BATCHED, k, len(LOG.details) - 1, start, end)
        self.calls.clear()
        data += entries[2:]
        data += (FAILED, now)
        self.mark = _complete[0] = len(data)


def _open(plan: Plan, i: int, item: Any, status: Any) -> Any:
    """A sealed item's inputs, each unpickled on its own (STEP says which, should one crash the
    worker); the error naming the input that cannot be."""
    parts = list(item.items()) if isinstance(item, dict) else [(None, item)]
    opened = {}
    for k, (name, value) in enumerate(parts):
        status[STEP] = OPENING - k
        try:
            value = open_input(value)
        except Exception as exc:  # whatever a __setstate__ raises
            return unopened(plan, i, name, item[name] if name is not None else item, exc)
        if name is None:  # a whole item, as an engine's task shipped it (`shipping.Pickled`)
            status[STEP] = -1
            return value
        opened[name] = value
    status[STEP] = -1
    return opened


class _Forward(logging.Handler):
    """The worker's log records, at the parent's level, sent to the parent with the next batch of
    results (`_send`) and handled there by its loggers: `logging.basicConfig(level=INFO)` in the
    parent shows a node's `log.info` as if it had run there. Each record says where it came
    from (`hardy_worker`: the pid, `hardy_item`: the item, None between items)."""

    def __init__(self, status: Any):
        super().__init__()
        self.status = status
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            record.msg, record.args = record.getMessage(), None  # the arguments may not pickle
            if record.exc_info:
                record.exc_text = logging.Formatter().formatException(record.exc_info)
                record.exc_info = None
            for key, value in record.__dict__.items():
                if not isinstance(value, (str, int, float, bool, type(None), tuple)):
                    record.__dict__[key] = repr(value)  # an `extra=` object: its text
            item = int(self.status[ITEM])
            record.hardy_worker, record.hardy_item = os.getpid(), item if item >= 0 else None
            self.records.append(record)
        except Exception:
            self.handleError(record)


FORWARD = _Forward(None)


def _forward_logs(status: Any) -> None:
    """NodeLogBatch at the parent's root level (passed as HARDY_LOG_LEVEL) go to the parent."""
    FORWARD.status = status
    root = logging.getLogger()
    root.handlers[:] = [FORWARD]
    root.setLevel(int(os.environ.get("HARDY_LOG_LEVEL", logging.WARNING)))
    logging.captureWarnings(True)  # a node's (or the cache's) warnings too, as `py.warnings` records


def _last_words(conn: Any, sent: list[Sent], fault: int) -> None:
    """Runs in the handler of a fatal signal (or of the parent's SIGUSR1 before a kill): where a
    nested pipeline was, for the parent to name (before faulthandler's stack), then the results."""
    try:
        os.write(fault, nesting_line().encode())
    except Exception:
        pass
    transport.WRITERS = 1  # no threads started in a dying process: segments are written by this one
    if _unsent and not _sending[0]:
        _send(conn, _unsent, _producers, False, 0.0, sent, dying=True)


def _send(conn: Any, batch: list[tuple[Any, ...]], producers: dict[str, str], done: bool,
          elapsed: float, sent: list[Sent], dying: bool = False) -> None:
    """A batch of results, pickled at once (fast), with the node log of its items when it is kept
    (the items that ended only, if `dying`). A value that cannot be pickled fails its item;
    if the parent cannot unpickle the batch, it asks for those items again one by one (`_resend`),
    so the chunk's batches are kept in `sent` until the next chunk. The batch is emptied. While
    this runs, last words stay silent: the batch is on its way already."""
    _sending[0] = True
    status = _status[0]
    if not dying:  # (a dying worker's status words name the item that killed it)
        status[ITEM], status[STEP] = SENDING, len(batch)
    try:
        names = _names[0]
        if dying and _complete[0] is not None:  # a batched plan's log: only its items written whole
            del LOG.data[_complete[0]:]
        records = LOG.take(names, ended=len(batch) if dying else None) if names is not None else None
        message: Any = batch if names is None else (batch, records)
        logs = bool(FORWARD.records)
        if logs:  # what the nodes logged since the last batch, for the parent's handlers
            message, FORWARD.records = (message, FORWARD.records), []
        try:
            packed = transport.pack(message, out_of_band)  # the parent has its own __main__: no need for dumps()
        except Exception:
            batch[:] = [_picklable(producers, *row) for row in batch]
            packed = transport.pack(message, dumps)
        sent.append((list(batch), records))
        transport.send(conn, Header(done, False, names is not None, False, logs, elapsed).pack(), packed)
        batch.clear()
    finally:
        _sending[0] = False
        if not dying:
            status[ITEM], status[STEP] = IDLE, -1


def _resend(conn: Any, sent: list[Sent], items: list[int]) -> None:
    """Items of the last chunk again, each pickled on its own, so that each is read on its own,
    with its own node log (None when not logged)."""
    outcomes: dict[int, tuple[bool, Any, NodeLogBatch | None]] = {}
    for rows, records in sent:
        for (i, ok, value), log in zip(rows, row_logs(records, len(rows))):
            outcomes[i] = (ok, value, log)
    data = pickle.dumps([(i, ok, dumps(value, buffer_callback=_in_band), log)
                         for i in items for ok, value, log in [outcomes[i]]], protocol=5)
    conn.send_bytes(Header(True, True, False, False, False, 0.0).pack() + data)


def _in_band(buf: Any) -> bool:
    """A buffer_callback keeping every buffer in the pickle: with one, `dumps` pickles values as
    `transport.pack` does (a memoryview stays a memoryview; without one, cloudpickle makes it bytes)."""
    return True


def _picklable(producers: dict[str, str], i: int, ok: bool, value: Any) -> tuple[int, bool, Any]:
    """(item, ok, value), the value replaced by an error naming node and type if it cannot travel."""
    try:
        dumps(value)
        return i, ok, value
    except Exception:
        pass
    for name, part in (value.items() if ok else ()):
        try:
            dumps(part)
        except Exception as exc:
            return i, False, NodeError(
                producers.get(name, name), None, i,
                f"its output {name!r} ({type(part).__module__}.{type(part).__qualname__}) cannot be "
                f"pickled back to the parent process ({type(exc).__name__}: {exc}); return plain data "
                "(numbers, arrays, dicts, paths) or make the type picklable")
    return i, False, NodeError("?", None, i, f"the result of item {i} cannot be pickled back to the parent")
