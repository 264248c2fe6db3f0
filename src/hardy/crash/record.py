"""A worker's fault record: its format, written by the dying worker (`lines.py` and the native
handler), read once by the parent.

The record is the worker's faulthandler file (a memfd the parent reads by path after a death).
What the worker writes there, in this order:

    hardy-native: signal 0xb                  the native handler (`handler.py`), first: the crashing
    hardy-native: <addr> <base> <saddr> <sym> <library>    thread's return addresses, then
    hardy-native: end
    hardy-mapped: / hardy-symbol:             which file each library was mapped from (`mapped.py`)
    hardy-nesting: [[node, item, on_error, timeout], ...]  the chain of nested plans (`lines.nesting_line`)
    hardy-thread: {"name": ..., "started": [...]}          a Python thread that is not the plan's
    hardy-interrupted: ["stop here", "<base64>"]  a node's KeyboardInterrupt (`lines.interrupted_line`)
    hardy-exit: the node called os._exit(3)   how it left on its own (`lines.exit_line`)
    Fatal Python error: ... / Thread 0x...    faulthandler's Python stack of every thread

The parent opens it once (`read`) into a `FaultRecord`; the scheduler, `NodeCrashed`'s message
and the diagnosis all read that record. `hardy replay` and `hardy repeat` parse a child's stderr,
where the same handler writes the same lines, into the same record (`from_stderr`).
"""

from __future__ import annotations

import base64
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import mapped
from .frames import MARK, name_frames, python_frames
from .lines import EXIT, INTERRUPTED, NESTING, THREAD

if TYPE_CHECKING:

    from .symbols import Frame

_NOT_STACK = "hardy-"  # lines of a crash file that hardy wrote (`hardy-native: `...), not faulthandler


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
    a node raised, which ended it (None if none did), and `interrupt` that exception as it travels,
    pickled (`shipping.failures.travelling_exception`; empty where it did not pickle); `native`:
    the crashing thread's native frames as written (`frames`: named, on first use: naming reads the
    libraries' symbol tables)."""

    stack: str = ""
    threads: str = ""
    nesting: tuple[tuple[Any, ...], ...] = ()
    thread: dict[str, Any] | None = None
    exit_how: str = ""
    interrupted: str | None = None
    interrupt: bytes = b""
    native: tuple[mapped.Native, ...] = ()
    libraries: Mapping[str, mapped.Mapped] = field(default_factory=dict)
    symbols: Mapping[int, tuple[str, int]] = field(default_factory=dict)

    @functools.cached_property
    def frames(self) -> list[Frame]:
        """The native frames, innermost first, named (`frames.name_frames`)."""
        return name_frames(list(self.native), self.libraries, self.symbols)

    def python_frames(self) -> list[tuple[str, str, int]]:
        """The Python frames (file, function, line) of the thread that ran the node, outermost first."""
        return python_frames(self.stack)


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
    thread, how, chain, interrupted, interrupt = None, "", "", None, b""
    for ln in lines:
        if ln.startswith(THREAD):
            thread = _json(ln[len(THREAD):], thread)
        elif ln.startswith(EXIT):
            how = ln[len(EXIT):].strip()
        elif ln.startswith(INTERRUPTED):
            interrupted, interrupt = _interrupted(ln[len(INTERRUPTED):])
        elif ln.startswith(NESTING) and not chain:
            chain = ln[len(NESTING):]
    libraries, symbols = mapped.read(text)
    return FaultRecord(stack=_python(_busy_threads(lines)), threads=_python(lines),
                       nesting=_chain(chain),
                       thread=thread, exit_how=how, interrupted=interrupted, interrupt=interrupt,
                       native=tuple(mapped.native_lines(text)), libraries=libraries, symbols=symbols)


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


def _interrupted(text: str) -> tuple[str, bytes]:
    """A node's KeyboardInterrupt as `lines.interrupted_line` wrote it: its text, and its pickle."""
    said = _json(text, "")
    if not (isinstance(said, list) and len(said) == 2):
        return str(said), b""
    try:
        return str(said[0]), base64.b64decode(str(said[1]), validate=True)
    except ValueError:  # (not base64, or not ASCII)
        return str(said[0]), b""


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

