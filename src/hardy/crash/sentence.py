"""The sentence a death is told in: what killed the worker, where, and from which node.

`describe_exit` says what an exit status means (a signal by name and its usual cause);
`crash_line` names the native frame the crash is in and the line of the node that called it:
`worker died from SIGSEGV in libfoo.so (crash_here+0x12), called from node 'embed' (x.py:8)`.
"""

from __future__ import annotations

import signal

from .frames import culprit, format_frames, overflowed, python_site
from .record import from_stderr
from .signals import HINTS
from .symbols import Frame


def describe_exit(exitcode: int | None) -> tuple[str | None, str]:
    """(signal name or None, explanation) for a worker's exit code."""
    if exitcode is None:
        return None, "the worker vanished without an exit status"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = HINTS.get(name)
        return name, f"worker died from {name}" + (f" ({hint})" if hint else "")
    if exitcode > 128 and exitcode - 128 < 65:  # a shell's way of saying "killed by signal N"
        return describe_exit(128 - exitcode)
    return None, f"worker exited with code {exitcode} (sys.exit or os._exit inside a node?)"


def crash_line(signame: str | None, reason: str, frames: list[Frame], node: str, stack: str) -> str:
    """`worker died from SIGSEGV in libfoo.so (crash_here+0x12), called from node 'embed' (x.py:8)`;
    `reason` (the exit's plain description) when no native frame was recorded."""
    frame = culprit(frames)
    if frame is None or signame is None:
        return reason
    site = python_site(stack, node)
    hint = reason.partition(" (")[2].rstrip(")")  # describe_exit's explanation of the signal
    deep = overflowed(frames)
    if deep is not None:
        hint = f"stack overflow: {deep.function or deep.short()} recursed until the native stack ran out"
    return (f"worker died from {signame} in {frame.short()}, called from node {node!r}"
            + (f" ({site})" if site else "") + (f": {hint}" if hint else ""))


def crash_report(stderr: str) -> tuple[str, str, str]:
    """(the frame a crash is named by, the native stack, faulthandler's Python stack) in the stderr
    of a process that had the native handler and faulthandler write there (`record.from_stderr`)."""
    record = from_stderr(stderr)
    named = culprit(record.frames)
    return (named.short() if named else ""), format_frames(record.frames) if record.frames else "", record.stack

