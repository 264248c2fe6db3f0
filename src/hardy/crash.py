"""Turning a dead worker, or this process dying in a map, into a sentence a user can act on."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from types import FrameType

_HINTS = {
    "SIGSEGV": "segmentation fault in native code",
    "SIGABRT": "abort: a failed C/C++ assertion, std::terminate or os.abort()",
    "SIGKILL": "killed from outside, most often by the kernel's out-of-memory killer",
    "SIGBUS": "bus error: a truncated memory-mapped file or misaligned access",
    "SIGFPE": "arithmetic fault in native code",
    "SIGILL": "illegal instruction: a binary built for another CPU",
    "SIGTERM": "terminated from outside",
    "SIGALRM": "an alarm: the node's own signal.alarm, or a crash in a native thread that left hardy's "
               "crash handler no way to run (it gives up after LAST_WORDS_LIMIT seconds)",
}


# --- inside a worker: nested pipelines run here, and report where they were ----------------------

_CONTAINED: list[Any] = [False, None]  # in a crash-containing worker; its status words' deadline slot
POISON: dict[tuple[tuple[str, int | None], ...], dict[int | None, Any]] = {}  # see `poisoned_here`


def contained() -> bool:
    """Whether this process is one of hardy's crash-containing workers. A crash here costs only
    the item in flight, so everything a worker runs (nested pipelines, their maps, `run()`) runs
    in it, in-process, instead of starting workers of its own."""
    return bool(_CONTAINED[0])


def mark_contained(deadline: Callable[[float], float]) -> None:
    """This process is a worker; `deadline(t)` posts the monotonic time `t` by which the node
    running now must end (0: none) for the parent to enforce, and returns the one posted before."""
    _CONTAINED[:] = [True, deadline]


def deadlined(func: Callable[..., Any], timeout: float) -> Callable[..., Any]:
    """`func` of a node nested in a worker, posting its deadline while it runs: the parent kills
    the worker when it passes, as for the worker's own steps (a nested deadline inside an outer one
    keeps the earlier of the two)."""
    import time

    def call(*args: Any, **kwargs: Any) -> Any:
        post = _CONTAINED[1]
        end = time.monotonic() + timeout
        before = post(end)
        if 0 < before < end:
            post(before)
        try:
            return func(*args, **kwargs)
        finally:
            post(before)
    return call


BATCH = "batch"  # a level of `nesting` that is a batched node's call (its item: the call's only one, or None)


def nesting(frame: FrameType | None = None) -> list[tuple[str, int | None, str | None, float | None]]:
    """The plans running in this thread, outermost first: (node, item, the node's on_error when it
    maps a nested pipeline, or BATCH for a batched node's call, its timeout). Read from the
    generated functions' frames (`_s` the step, `_item` the item) and from a batch call's
    (`hardy.batching`: `_hardy_batch`, the innermost of its halves), so nothing is paid while
    nothing asks."""
    chain = []
    batch_seen = False
    f: FrameType | None = frame or sys._getframe(1)
    while f is not None:
        if f.f_code.co_filename.startswith("<hardy plan"):
            plan = getattr(f.f_globals.get("_fail"), "__self__", None)  # the generated code's namespace holds it
            step, item = f.f_locals.get("_s"), f.f_locals.get("_item")
            if plan is not None and isinstance(step, int) and step < len(plan.steps):
                node = plan.steps[step].node
                over = node.on_error if getattr(node, "map_over", None) else None
                chain.append((node.name, item, over, node.timeout))
            batch_seen = False
        elif not batch_seen and "_hardy_batch" in f.f_code.co_varnames:
            batch = f.f_locals.get("_hardy_batch")
            if batch is not None:
                name, rows, offset, timeout = batch  # rows: (item, its values), numbered from offset
                chain.append((name, offset + rows[0][0] if len(rows) == 1 else None, BATCH, timeout))
                batch_seen = True
        f = f.f_back
    chain.reverse()
    return chain


_NESTING = "hardy-nesting: "
_NOT_STACK = "hardy-"  # lines of a crash file that hardy wrote (`hardy-native: `...), not faulthandler


def nesting_line() -> str:
    """The deepest chain of nested plans among this process's threads, as the first line of a
    worker's crash file (`hardy-nesting: [...]`); empty when no plan is nested in another."""
    import json
    chains = [nesting(f) for f in sys._current_frames().values()]
    deepest = max(chains, key=len, default=[])
    return f"{_NESTING}{json.dumps(deepest)}\n" if len(deepest) > 1 else ""


# --- which thread died, and how a worker left ----------------------------------------------------
#
# A worker runs its items in its main thread. A crash in another Python thread (a prefetch or I/O
# thread that an earlier item's node started) is not the fault of the item in flight: the parent
# reads which thread it was (`thread_line`, written by the dying thread itself) and what was in
# flight when that thread was started (`watch_threads`), and runs the item in flight again
# (workers/deaths.py). A native thread (an OpenMP team, a library's own pool) works for the call
# running now, and a thread running the plan's code (an async plan's sync nodes) is the node's.

_THREAD = "hardy-thread: "
_EXIT = "hardy-exit: "


def watch_threads(now: Callable[[], tuple[float, ...]]) -> None:
    """Note on each thread started from now on what was in flight as it started (`now()`: the
    worker's item, step and the step's start, from its status words) and when (monotonic: which
    map it was), for `thread_line`."""
    import time
    start = threading.Thread.start

    def started(self: threading.Thread) -> None:
        self._hardy_started = (*now(), time.monotonic())  # type: ignore[attr-defined]
        start(self)
    threading.Thread.start = started  # type: ignore[method-assign]


def thread_line() -> str:
    """`hardy-thread: {"name": ..., "started": [item, step, step start, when]}` for the thread this
    runs in (a crashing one, in its fatal-signal handler), when it is a Python thread other than the
    one running the plan; empty for the main thread, a thread running the plan's code, and a native
    thread (not started by Python), all of which work for the node running now."""
    import json
    ident = threading.get_ident()
    if ident == threading.main_thread().ident:
        return ""
    thread = next((t for t in threading.enumerate() if t.ident == ident), None)
    if thread is None or type(thread).__name__ == "_DummyThread":  # a native thread calling into Python
        return ""
    f: FrameType | None = sys._getframe(1)
    while f is not None:
        if f.f_code.co_filename.startswith("<hardy plan") or f.f_code.co_name == "_thread_call":
            return ""
        f = f.f_back
    started = getattr(thread, "_hardy_started", None)
    return f"{_THREAD}{json.dumps({'name': thread.name, 'started': started})}\n"


def exit_line(how: str) -> str:
    """`hardy-exit: the node called os._exit(3)`: how a worker left on its own."""
    return f"{_EXIT}{how}\n"


def read_marked(path: str) -> tuple[dict[str, Any] | None, str]:
    """(the thread a worker died in, when `thread_line` named one; how it left, when `exit_line`
    said) from its crash file."""
    import json
    thread, how = None, ""
    try:
        with open(path, errors="replace") as f:
            for ln in f:
                if ln.startswith(_THREAD):
                    try:
                        thread = json.loads(ln[len(_THREAD):])
                    except ValueError:
                        pass
                elif ln.startswith(_EXIT):
                    how = ln[len(_EXIT):].strip()
    except OSError:
        pass
    return thread, how


def poisoned_here() -> dict[int | None, Any]:
    """Items of the nested map about to run here that crashed their worker before: the parent
    runs the enclosing item again, and those inner items fail as their crash did instead of
    running (so a nested map with on_error="continue" loses only them). Keyed by the chain of
    plans enclosing the map (`nesting`)."""
    if not POISON:
        return {}
    key = tuple((node, item) for node, item, _, _ in nesting(sys._getframe(1)))
    return POISON.get(key, {})


def describe_exit(exitcode: int | None) -> tuple[str | None, str]:
    """(signal name or None, explanation) for a worker's exit code."""
    if exitcode is None:
        return None, "the worker vanished without an exit status"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = _HINTS.get(name)
        return name, f"worker died from {name}" + (f" ({hint})" if hint else "")
    if exitcode > 128 and exitcode - 128 < 65:  # a shell's way of saying "killed by signal N"
        return describe_exit(128 - exitcode)
    return None, f"worker exited with code {exitcode} (sys.exit or os._exit inside a node?)"


_MACHINERY = ("/hardy/workers/", "/hardy/integrations/", "/multiprocessing/", "/site-packages/daft/",
              "<frozen runpy>", "<hardy plan", 'File "<string>"')


def read_stack(path: str, limit: int = 4000, every_thread: bool = False) -> str:
    """The Python stack faulthandler wrote when the worker crashed (empty if none).

    Frames of hardy's worker loop and of multiprocessing are dropped: the user's frames remain,
    of the threads that ran user code (`every_thread`: of all of them); so are the native frames
    the worker's handler wrote (hardy.forensics.frames reads those).
    """
    try:
        with open(path, errors="replace") as f:
            lines = f.read().strip().splitlines()
    except OSError:
        return ""
    if not every_thread:
        lines = _busy_threads(lines)
    kept = [ln for ln in lines if not any(m in ln for m in _MACHINERY) and not ln.startswith(_NOT_STACK)]
    return "\n".join(kept)[-limit:]


def read_nesting(path: str) -> list[list[Any]]:
    """The chain of nested plans a worker was in when it died (`nesting_line`), or []."""
    import json
    try:
        with open(path, errors="replace") as f:
            line = next((ln for ln in f if ln.startswith(_NESTING)), "")
    except OSError:
        return []
    try:
        chain: list[list[Any]] = json.loads(line[len(_NESTING):]) if line else []
        return chain
    except ValueError:
        return []


def _busy_threads(lines: list[str]) -> list[str]:
    """faulthandler's dump without the blocks of threads that ran nothing of the user's (hardy's
    watchdog, idle pool threads: only threading.py and machinery frames), so the stack shown is
    the node's; `NodeCrashed.threads` keeps every thread's."""
    kept: list[str] = []
    block: list[str] = []

    def flush() -> None:
        frames = [ln for ln in block[1:] if ln.strip().startswith("File ")]
        if not block or not frames or any("/threading.py" not in ln and not any(m in ln for m in _MACHINERY)
                                          for ln in frames):
            kept.extend(block)
    for ln in lines:
        if ln.startswith(_NOT_STACK):
            continue
        if ln.startswith(("Thread 0x", "Current thread 0x")):
            flush()
            block = [ln]
        elif block:
            block.append(ln)
        else:
            kept.append(ln)
    flush()
    while kept and not kept[-1].strip():
        kept.pop()
    return kept


# --- last words: a callback between a fatal signal and faulthandler's stack ---------------------

FATAL_SIGNALS = ("SIGSEGV", "SIGFPE", "SIGABRT", "SIGBUS", "SIGILL")
LAST_WORDS_LIMIT = 2  # seconds: a callback that hangs in a corrupted process is ended by SIGALRM


def on_fatal_signal(callback: Callable[[int], None], signals: Sequence[str] = FATAL_SIGNALS) -> Callable[[], None]:
    """Call `callback(signum)` when one of `signals` arrives, then hand the signal to the handler
    installed before (faulthandler's: it prints the stack; for a fatal signal the process then dies
    of it). Python cannot do this itself: its handlers run between bytecodes, after the process
    is dead. Returns the function that puts the previous handlers back."""
    import ctypes
    libc = ctypes.CDLL(None)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    previous: dict[int, Any] = {}

    def handler(signum: int) -> None:
        libc.alarm(LAST_WORDS_LIMIT)
        try:
            callback(signum)
        finally:
            libc.alarm(0)
            libc.signal(signum, previous[signum])
            getattr(libc, "raise")(signum)  # blocked in this handler: delivered to the previous one as it returns

    c_handler = ctypes.CFUNCTYPE(None, ctypes.c_int)(handler)
    for name in signals:
        signum = int(getattr(signal, name))
        previous[signum] = libc.signal(signum, ctypes.cast(c_handler, ctypes.c_void_p))

    def undo() -> None:
        for signum, old in previous.items():
            libc.signal(signum, old)
        _alive.pop(id(c_handler), None)
    _alive[id(c_handler)] = c_handler
    return undo


_alive: dict[int, Any] = {}  # installed C handlers must outlive the call that made them


# --- a crash of this process during an in-process map -------------------------------------------
#
# Sequential, threaded and async maps run nodes in this process: a segfault there ends the
# interpreter, without a word (rc 139) unless faulthandler is on. While such a map runs, a fatal
# signal first makes hardy name the node and the item (read from the frame of the plan's generated
# function: its `_s` is the step, `_item` the item, so nothing is paid per item), print the Python
# stack as faulthandler would, and say what would have contained the crash; then the process dies
# of the same signal. The handler is installed once, at the first in-process map, and is inert
# outside maps (it hands the signal straight to whatever handled it before): installing and
# removing C handlers around every map would cost a small map ~40x its time. A faulthandler the
# user turned on speaks instead of hardy.

_maps: dict[str, Any] = {"running": 0, "executor": ""}  # the in-process maps running now, and the executor's name
_installed: list[Callable[[], None]] = []
_guard = threading.Lock()


@contextlib.contextmanager
def reported_crashes(executor: str) -> Iterator[None]:
    """Around an in-process map: a fatal signal prints node, item, the stack and the remedy."""
    with _guard:
        if not _installed:
            _installed.append(on_fatal_signal(_last_words))
        _maps["running"] += 1
        _maps["executor"] = executor
    try:
        yield
    finally:
        with _guard:
            _maps["running"] -= 1


def _last_words(signum: int) -> None:
    import faulthandler
    if not _maps["running"] or faulthandler.is_enabled():
        return
    name = signal.Signals(signum).name
    where = _in_flight()
    what = f"{name} ({_HINTS.get(name, name)})"
    text = (f"\nhardy: {where} crashed this process with {what}.\n" if where else
            f"\nhardy: this process crashed with {what} while a map was running.\n")
    os.write(2, text.encode(errors="replace"))
    os.write(2, _stack().encode(errors="replace"))
    os.write(2, (f"hardy: map_executor={_maps['executor']!r} runs nodes in this process, so the crash ends it; "
                 "map_executor=\"process\" or @node(isolate=True) contains it: only that item would fail.\n"
                 ).encode())


def _stack() -> str:
    """faulthandler's dump of every thread, without the frames of this handler."""
    import faulthandler
    import tempfile
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        return "".join(ln for ln in f if __file__ not in ln)


def _in_flight() -> str:
    """'node N on item I' for each plan function running in this process, the crashing thread first."""
    frames = [sys._getframe()] + [f for t, f in sys._current_frames().items() if t != threading.get_ident()]
    found = []
    for frame in frames:
        f: FrameType | None = frame
        while f is not None and not f.f_code.co_filename.startswith("<hardy plan"):
            f = f.f_back
        if f is None:
            continue
        plan = getattr(f.f_globals.get("_fail"), "__self__", None)  # the generated code's namespace holds it
        step, item = f.f_locals.get("_s"), f.f_locals.get("_item")
        node = plan.steps[step].node.name if plan is not None and isinstance(step, int) else "?"
        found.append(f"node {node!r}" + (f" on item {item}" if item is not None else ""))
    return "; ".join(found)
