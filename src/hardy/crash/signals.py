"""Fatal signals: a callback between a signal and faulthandler's stack, and the sentence a crash of
this very process prints during an in-process map.

A worker's last words (`workers/replies.py`) run through `on_fatal_signal`; so does the report of a
crash of the calling process while a sequential, threaded or async map runs (`reported_crashes`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from .containment import contained

if TYPE_CHECKING:
    from types import FrameType

HINTS = {  # what each fatal signal most often means
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


# --- last words: a callback between a fatal signal and faulthandler's stack ---------------------

FATAL_SIGNALS = ("SIGSEGV", "SIGFPE", "SIGABRT", "SIGBUS", "SIGILL")
LAST_WORDS_LIMIT = 2  # seconds: a callback that hangs in a corrupted process is ended by SIGALRM


def on_fatal_signal(callback: Callable[[int], None], signals: Sequence[str] = FATAL_SIGNALS,
                    elsewhere: Callable[[int], None] | None = None) -> Callable[[], None]:
    """Call `callback(signum)` when one of `signals` arrives, then hand the signal to the handler
    installed before (faulthandler's: it prints the stack; for a fatal signal the process then dies
    of it), with its flags as they were (`crash.sigaction`): a fault by returning, so that it
    happens again with its own details, a signal sent by sending it again. Python cannot do this itself: its
    handlers run between bytecodes, after the process is dead. `elsewhere`: in a process forked
    from this one, which inherits the handler, it calls neither the callback nor the previous
    handler but `elsewhere(signum)`, which puts back what should handle the signal there (a
    worker's last words and its crash record are the worker's own); a fault then faults again,
    with its own details. Returns the function that puts the previous handlers back."""
    from . import sigaction  # (ctypes: loaded when a handler is installed, not with hardy)
    libc = sigaction.libc()
    previous: dict[int, Any] = {}
    owner = os.getpid()

    def handler(signum: int, siginfo: int, context: int) -> None:
        if elsewhere is not None and os.getpid() != owner:
            elsewhere(signum)
            if sigaction.sent(siginfo):
                getattr(libc, "raise")(signum)  # (blocked in this handler: delivered as it returns)
            return
        libc.alarm(LAST_WORDS_LIMIT)
        try:
            callback(signum)
        finally:
            libc.alarm(0)
            sigaction.put(signum, previous[signum])
            if sigaction.sent(siginfo):  # blocked in this handler: delivered to the previous one as it returns
                getattr(libc, "raise")(signum)  # (a fault faults again, its details whole for that handler)

    c_handler = sigaction.HANDLER(handler)
    action = sigaction.handling(c_handler)
    for name in signals:
        signum = int(getattr(signal, name))
        previous[signum] = sigaction.put(signum, action)

    def undo() -> None:
        for signum, old in previous.items():
            sigaction.put(signum, old)
        _alive.pop(id(c_handler), None)
    _alive[id(c_handler)] = (c_handler, action)
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
    """Around an in-process map: a fatal signal prints node, item, the stack and the remedy. Not in
    a worker (a nested pipeline's map), whose faulthandler speaks instead: a Python handler in front
    of its compiled one would make a process a node forks from C enter Python (`crash.handler`)."""
    with _guard:
        if not _installed and not contained():
            _installed.append(on_fatal_signal(_last_words))
            _guard_exits()
        _maps["running"] += 1
        _maps["executor"] = executor
        _maps["pid"] = os.getpid()
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
    what = f"{name} ({HINTS.get(name, name)})"
    text = (f"\nhardy: {where} crashed this process with {what}.\n" if where else
            f"\nhardy: this process crashed with {what} while a map was running.\n")
    os.write(2, text.encode(errors="replace"))
    os.write(2, _stack().encode(errors="replace"))
    os.write(2, _remedy("crash"))


# The settings the remedy names, in the caller's words: the library's arguments, or a command's
# options (`hardy run` sets `REMEDY_WORDS["executor"] = "--executor {}"`); "{}" is the executor.
REMEDY_WORDS = {"executor": "map_executor={!r}", "contains": 'map_executor="process" or @node(isolate=True)'}


def _remedy(what: str) -> bytes:
    """The line that says why `what` ends this process and what would contain it."""
    return (f"hardy: {REMEDY_WORDS['executor'].format(_maps['executor'])} runs nodes in this process, so the "
            f"{what} ends it; {REMEDY_WORDS['contains']} contains it: only that item would fail.\n").encode()


def _guard_exits() -> None:
    """`os._exit` replaced by one that, called by a node during an in-process map, first says which
    node on which item ended the process, as a crash does (`os._exit` runs no handler, atexit or
    finally: without this the script ended silently, its exit code the node's). Only from the
    node's own thread and process: a process the node forked (multiprocessing's children leave by
    `os._exit`) and code outside nodes exit as before, and every call exits as `os._exit` did.
    Installed once, like the signal handler; code that took `os._exit` before (`from os import
    _exit`), and `_exit` from C, are not seen; nor a thread the node started, which is no node's."""
    leave = os._exit

    def _exit(status: int) -> NoReturn:
        if _maps["running"] and _maps.get("pid") == os.getpid():
            where = _node_of(sys._getframe(1))
            if where:
                try:
                    os.write(2, f"\nhardy: {where} called os._exit({status}), which ends this process.\n".encode())
                    os.write(2, _remedy("exit"))
                except OSError:  # (stderr closed): the exit goes on
                    pass
        leave(status)

    os._exit = _exit


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
    return "; ".join(filter(None, (_node_of(frame) for frame in frames)))


def _node_of(frame: FrameType | None) -> str:
    """'node N on item I' for the plan function `frame` runs in (or calls from), '' for none."""
    while frame is not None and not frame.f_code.co_filename.startswith("<hardy plan"):
        frame = frame.f_back
    if frame is None:
        return ""
    plan = getattr(frame.f_globals.get("_fail"), "__self__", None)  # the generated code's namespace holds it
    step, item = frame.f_locals.get("_s"), frame.f_locals.get("_item")
    node = plan.steps[step].node.name if plan is not None and isinstance(step, int) else "?"
    return f"node {node!r}" + (f" on item {item}" if item is not None else "")
