"""A crash's frames: the native ones named from the lines the native handler wrote, which of
them the crash is named by, and the line of the node's own code in the Python stack.

The native handler (`handler.py`) writes the crashing thread's return addresses into the fault
record as `hardy-native:` lines (`record.py` holds the whole format); `mapped.py` says which file
each library was mapped from. Naming them reads each library's symbol table (`symbols.py`).
"""

from __future__ import annotations

import os
import re
import sysconfig
from collections.abc import Mapping

from . import mapped
from .symbols import Frame, demangle, symbolise

MARK = "hardy-native: "
# The C runtime and the interpreter: a crash "in" them is named by the first frame outside them
# (abort() is libc's, the assertion that called it is the library's), and a native stack is shown
# down to the interpreter, whose own frames the Python stack already tells.
_RUNTIME = re.compile(r"^(libc\.so|libpthread|ld-linux|libgcc_s|libstdc\+\+)")
_INTERPRETER = re.compile(r"^(libpython|python\d|_ctypes\.|libffi\.)")


def name_frames(native: list[mapped.Native], libraries: Mapping[str, mapped.Mapped],
                named: Mapping[int, tuple[str, int]]) -> list[Frame]:
    """Native frames as a record holds them, named: from each library's file on disk, unless the
    worker said that file is not the one it had mapped (`mapped.py`: then from the mapped copy,
    or not at all)."""
    frames: list[Frame] = []
    for address, base, saddr, exported, library in native:
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


def python_frames(stack: str) -> list[tuple[str, str, int]]:
    """The frames (file, function, line) of the thread that ran the node in a faulthandler
    `stack`, outermost first: the current thread's (the main one, which runs the plan, once
    hardy's machinery is left out: `record`), else the first thread with one outside the standard
    library, installed packages and hardy."""
    blocks = stack.split("\n\n")
    current = [b for b in blocks if "Current thread" in b]
    for block in current + blocks:
        found = [(f.group(1), f.group(3), int(f.group(2))) for f in _PY_FRAME.finditer(block)]
        if (found and block in current) or any(not file.startswith(_NOT_USER_CODE) for file, _, _ in found):
            return found[::-1]
    return []


_NOT_USER_CODE = tuple({sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "platstdlib", "purelib", "platlib")}
                       | {os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep})


RECORDED = 64  # return addresses the handler records at most (MAX_FRAMES in native_handler.c, handler.py)
_REPEATS = 16  # frames of one function at the end of a record that stopped short of the interpreter


def overflowed(frames: list[Frame]) -> Frame | None:
    """The function a native stack overflow recursed in: the record is full (nearly: the handler
    leaves out its own frames) without reaching the interpreter, and its last frames are all that
    function's (deep C recursion, until the stack ran out). None for any other crash."""
    tail = frames[-_REPEATS:]
    if len(frames) < RECORDED - 8 or len(own(frames)) < len(frames) or len(tail) < _REPEATS:
        return None
    first = tail[0]
    same = all(f.library == first.library and (f.function or f.offset) == (first.function or first.offset)
               for f in tail)
    return first if same and first.library else None


def _cut(frames: list[Frame]) -> str:
    """What the frames past the shown ones are: `38 more frames of recurse` when one function."""
    names = {f.function or f.short() for f in frames}
    what = f"of {names.pop()}" if len(names) == 1 else f"in {', '.join(sorted({f.name or '?' for f in frames}))}"
    return f"  ... {len(frames)} more frame(s) {what}"


def format_frames(frames: list[Frame], limit: int = 24) -> str:
    """The native stack as the error shows it, numbered, innermost first: the frames past
    `limit` summed up by what they are, the interpreter's (which the Python stack tells) counted;
    a stack overflow (`overflowed`) said, since the record then ends before the interpreter."""
    mine = own(frames)
    lines = [f"  #{k} {f}" for k, f in enumerate(mine[:limit])]
    if len(mine) > limit:
        lines.append(_cut(mine[limit:]))
    if len(frames) > len(mine):
        lines.append(f"  ... {len(frames) - len(mine)} more frame(s), in the Python interpreter and below")
    deep = overflowed(frames)
    if deep is not None:
        lines.append(f"  (the native stack overflowed: {deep.function or deep.short()} calls itself until the stack "
                     f"runs out; the record holds only the innermost {len(frames)} frames, all of them its own. "
                     "No Python stack is recorded for a stack overflow: see docs/failures.md)")
    return "\n".join(lines)
