"""A worker's fault record: its format, written by the dying worker, read once by the parent.

The record is the worker's faulthandler file (a memfd the parent reads by path after a death).
What the worker writes there, in this order:

    hardy-native: signal 0xb                  the native handler (`handler.py`), first: the crashing
    hardy-native: <addr> <base> <saddr> <sym> <library>    thread's return addresses, then
    hardy-native: end
    hardy-mapped: / hardy-symbol:             which file each library was mapped from (`mapped.py`)
    hardy-nesting: [[node, item, on_error, timeout], ...]  the chain of nested plans (`nesting_line`)
    hardy-thread: {"name": ..., "started": [...]}          a Python thread that is not the plan's
    hardy-exit: the node called os._exit(3)   how it left on its own (`exit_line`)
    Fatal Python error: ... / Thread 0x...    faulthandler's Python stack of every thread

The parent opens it once (`read`) into a `FaultRecord`; the scheduler, `NodeCrashed`'s message
and the diagnosis all read that record. `hardy replay` and `hardy repeat` parse a child's stderr,
where the same handler writes the same lines, into the same record (`from_stderr`).
"""

from __future__ import annotations

import functools
import json
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import mapped
from .containment import nesting
from .frames import MARK, name_frames

if TYPE_CHECKING:
    from types import FrameType

    from .symbols import Frame

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
# (`blame.elsewhere`). A native thread (an OpenMP team, a library's own pool) works for the call
# running now, and a thread running the plan's code (an async plan's sync nodes) is the node's.

_THREAD = "hardy-thread: "
_EXIT = "hardy-exit: "
_INTERRUPTED = "hardy-interrupted: "


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


def interrupted_line(exc: KeyboardInterrupt) -> str:
    """`hardy-interrupted: <its text>`: the worker left because a node raised KeyboardInterrupt,
    which in-process interrupts the call (the parent does the same: `FaultRecord.interrupted`)."""
    return f"{_INTERRUPTED}{json.dumps(str(exc))}\n"


_MACHINERY = ("/hardy/workers/", "/hardy/integrations/", "/multiprocessing/", "/site-packages/daft/",
              "<frozen runpy>", "<hardy plan", 'File "<string>"')
STACK_LIMIT = 4000  # characters of the Python stack an error keeps (its last ones: the innermost frames)


@dataclass(frozen=True)
class FaultRecord:
    """Everything a dead worker's fault record holds, parsed once. `stack`: the Python stack of the
    threads that ran the user's code (hardy's worker loop and multiprocessing dropped); `threads`:
    every thread's; `nesting`: the chain of nested plans it died in (outermost first, empty unless
    one plan was nested in another); `thread`: the Python thread it died in when not the plan's;
    `exit_how`: what it said of an exit of its own; `interrupted`: the text of the KeyboardInterrupt
    a node raised, which ended it (None if none did); `native`: the crashing thread's native frames
    as written (`frames`: named, on first use: naming reads the libraries' symbol tables)."""

    stack: str = ""
    threads: str = ""
    nesting: tuple[tuple[Any, ...], ...] = ()
    thread: dict[str, Any] | None = None
    exit_how: str = ""
    interrupted: str | None = None
    native: tuple[mapped.Native, ...] = ()
    libraries: Mapping[str, mapped.Mapped] = field(default_factory=dict)
    symbols: Mapping[int, tuple[str, int]] = field(default_factory=dict)

    @functools.cached_property
    def frames(self) -> list[Frame]:
        """The native frames, innermost first, named (`frames.name_frames`)."""
        return name_frames(list(self.native), self.libraries, self.symbols)


def read(path: str) -> FaultRecord:
    """The record in the file at `path`, opened once (an empty record when it cannot be read)."""
    try:
        with open(path, errors="replace") as f:
            return parse(f.read())
    except OSError:
        return FaultRecord()


def parse(text: str) -> FaultRecord:
    """The record a worker wrote, from its text."""
    lines = text.strip().splitlines()
    thread, how, chain, interrupted = None, "", "", None
    for ln in lines:
        if ln.startswith(_THREAD):
            thread = _json(ln[len(_THREAD):], thread)
        elif ln.startswith(_EXIT):
            how = ln[len(_EXIT):].strip()
        elif ln.startswith(_INTERRUPTED):
            interrupted = str(_json(ln[len(_INTERRUPTED):], ""))
        elif ln.startswith(_NESTING) and not chain:
            chain = ln[len(_NESTING):]
    libraries, symbols = mapped.read(text)
    return FaultRecord(stack=_python(_busy_threads(lines)), threads=_python(lines),
                       nesting=_chain(chain),
                       thread=thread, exit_how=how, interrupted=interrupted, native=tuple(mapped.native_lines(text)),
                       libraries=libraries, symbols=symbols)


def from_stderr(stderr: str) -> FaultRecord:
    """The record in the stderr of a process that had the native handler and faulthandler write
    there (`hardy repeat`'s runs, `hardy replay --py-spy`'s): the last native record (a process
    that ran before, such as a contained hardy worker, may have left one too); its `stack`, the
    Python stack from its "Fatal Python error" on."""
    start = stderr.rfind(MARK + "signal ")
    native = stderr[start:] if start >= 0 else ""
    libraries, symbols = mapped.read(native)
    fatal = stderr.rfind("Fatal Python error: ")
    python = "" if fatal < 0 else "\n".join(
        ln for ln in stderr[fatal:].splitlines() if not ln.startswith(MARK)).strip()[:STACK_LIMIT]
    return FaultRecord(stack=python, native=tuple(mapped.native_lines(native)), libraries=libraries,
                       symbols=symbols)


def _json(text: str, otherwise: Any) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return otherwise


def _chain(text: str) -> tuple[tuple[Any, ...], ...]:
    chain = _json(text, []) if text else []
    if not isinstance(chain, list) or not all(isinstance(level, list) for level in chain):
        return ()
    return tuple(tuple(level) for level in chain)


def _python(lines: list[str]) -> str:
    """faulthandler's lines without the frames of hardy's machinery and the lines hardy wrote."""
    kept = [ln for ln in lines if not any(m in ln for m in _MACHINERY) and not ln.startswith(_NOT_STACK)]
    return "\n".join(kept)[-STACK_LIMIT:]


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

