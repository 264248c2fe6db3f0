"""A worker's crash record, read by the parent: native frames, and the sentence that names them.

The record is the worker's faulthandler file: the native handler (`handler.py`) writes its
`hardy-native:` lines there first, then faulthandler the Python stack.
"""

from __future__ import annotations

import os
import re
import sysconfig
from dataclasses import dataclass

from . import mapped
from .symbols import Frame, demangle, symbolise

MARK = "hardy-native: "
# The C runtime and the interpreter: a crash "in" them is named by the first frame outside them
# (abort() is libc's, the assertion that called it is the library's), and a native stack is shown
# down to the interpreter, whose own frames the Python stack already tells.
_RUNTIME = re.compile(r"^(libc\.so|libpthread|ld-linux|libgcc_s|libstdc\+\+)")
_INTERPRETER = re.compile(r"^(libpython|python\d|_ctypes\.|libffi\.)")


def read_frames(text: str) -> list[Frame]:
    """The crashing thread's native frames in a crash record's text, innermost first, named: from
    each library's file on disk, unless the worker said that file is not the one it had mapped
    (`mapped.py`: then from the mapped copy, or not at all)."""
    libraries, named = mapped.read(text)
    frames: list[Frame] = []
    for address, base, saddr, exported, library in mapped.native_lines(text):
        said = libraries.get(library)
        if said is None or not said.replaced(library):
            frames.append(symbolise(address, base, library, exported, caller=bool(frames)))
        elif address in named:
            function, into = named[address]
            frames.append(Frame(address, library, address - base, demangle(function), into, replaced=True))
        elif exported != "?" and saddr:  # the mapped copy's own dynamic symbol, as dladdr found it there
            frames.append(Frame(address, library, address - base, demangle(exported), address - saddr, replaced=True))
        else:
            frames.append(Frame(address, library, address - base, replaced=True))
    return frames


def crash_report(stderr: str) -> tuple[str, str, str]:
    """(the frame a crash is named by, the native stack, faulthandler's Python stack) in the stderr of
    a process that had the native handler and faulthandler write there (`hardy repeat`'s runs,
    `hardy replay --py-spy`'s): the last native record (a process that ran before, such as a contained hardy worker,
    may have left one too), the Python stack from its "Fatal Python error" on."""
    start = stderr.rfind(MARK + "signal ")
    frames = read_frames(stderr[start:]) if start >= 0 else []
    named = culprit(frames)
    fatal = stderr.rfind("Fatal Python error: ")
    python = "" if fatal < 0 else "\n".join(
        ln for ln in stderr[fatal:].splitlines() if not ln.startswith(MARK)).strip()[:4000]
    return (named.short() if named else ""), format_frames(frames) if frames else "", python


def read_record(path: str) -> list[Frame]:
    """`read_frames` of the record file at `path` (no frames if it cannot be read)."""
    try:
        with open(path, errors="replace") as f:
            return read_frames(f.read())
    except OSError:
        return []


def own(frames: list[Frame]) -> list[Frame]:
    """The frames below the interpreter: the native code a node called (the rest the Python
    stack tells)."""
    for k, frame in enumerate(frames):
        if frame.library and _INTERPRETER.match(frame.name):
            return frames[:k]
    return frames


def culprit(frames: list[Frame]) -> Frame | None:
    """The frame a crash is named by: the first outside the C runtime (the caller of a
    crashing memcpy or of abort()), or the first frame when all are in the runtime; None when
    the interpreter raised the signal itself."""
    mine = own(frames)
    if mine and len(mine) < len(frames) and frames[len(mine)].name.startswith(("libpython", "python")) and all(
            f.library and _RUNTIME.match(f.name) for f in mine):
        return None  # the interpreter itself raised it (os.kill, os.abort): the Python stack says where
    mine = mine or frames
    return next((f for f in mine if not (f.library and _RUNTIME.match(f.name))), mine[0] if mine else None)


_PY_FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')


def python_site(stack: str, node: str = "") -> str:
    """`x.py:8`: where the node's own code was in the crashing thread of a faulthandler stack (the
    innermost frame outside the standard library, installed packages and hardy: the line of the
    node that called the library, not the library's wrapper); with none (a node that is itself
    part of an installed package, as the demo's are), the innermost frame of a function named as
    the `node` (its last part, for a nested `prep/tokenize`) is; else its innermost frame. When
    that thread runs no Python (a library's own thread), the main thread's (listed last)."""
    blocks = stack.split("\n\n")
    current = [b for b in blocks if "Current thread" in b]
    function = node.rpartition("/")[2]
    for block in current + blocks[::-1]:
        found = list(_PY_FRAME.finditer(block))  # faulthandler lists the innermost first
        if found:
            named = next((f for f in found if function and f.group(3) == function), found[0])
            mine = next((f for f in found if not f.group(1).startswith(_NOT_USER_CODE)), named)
            return f"{os.path.basename(mine.group(1))}:{mine.group(2)}"
    return ""


_NOT_USER_CODE = tuple({sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "platstdlib", "purelib", "platlib")}
                       | {os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep})


def crash_line(signame: str | None, reason: str, frames: list[Frame], node: str, stack: str) -> str:
    """`worker died from SIGSEGV in libfoo.so (crash_here+0x12), called from node 'embed' (x.py:8)`;
    `reason` (the exit's plain description) when no native frame was recorded."""
    frame = culprit(frames)
    if frame is None or signame is None:
        return reason
    site = python_site(stack, node)
    hint = reason.partition(" (")[2].rstrip(")")  # describe_exit's explanation of the signal
    return (f"worker died from {signame} in {frame.short()}, called from node {node!r}"
            + (f" ({site})" if site else "") + (f": {hint}" if hint else ""))


def format_frames(frames: list[Frame], limit: int = 24) -> str:
    """The native stack as the error shows it, numbered, innermost first."""
    mine = own(frames)
    lines = [f"  #{k} {f}" for k, f in enumerate(mine[:limit])]
    hidden = len(frames) - len(lines)
    if hidden:
        lines.append(f"  ... {hidden} more frame(s), in the Python interpreter and below")
    return "\n".join(lines)


@dataclass(frozen=True)
class Death:
    """What the parent makes of a dead worker's record: the first line, frames, diagnosis, stacks."""

    reason: str
    frames: list[Frame]
    native_stack: str
    diagnosis: list[str]
    stacks: str = ""


def examine(record: str, signame: str | None, reason: str, node: str, stack: str,
            hang: tuple[str, str] | None = None, after_return: bool = False) -> Death:
    """The death of a worker whose crash record is the file `record`. `hang`: for a worker killed
    for running too long, (py-spy's stacks, why none) as `stacks.hang_stacks` gave them, the
    Python stacks of `stack` standing in when py-spy gave none."""
    from .diagnosis import diagnose
    if hang is not None:
        text, why = hang
        stacks = text or (f"faulthandler, Python frames only ({why}):\n{stack}" if stack else "")
        return Death(reason, [], "", diagnose(stacks=text), stacks)
    frames = read_record(record)
    return Death(crash_line(signame, reason, frames, node, stack), frames, format_frames(frames),
                 diagnose(frames, after_return=after_return))
