"""Which file a crash's libraries were mapped from, so that their functions are named from it.

The parent names a worker's native frames after the worker died, from each library's file on
disk (`symbols.py`). If that file was replaced after the worker loaded it (a rebuild in place, a
`pip install -U` during a long run), the disk holds other code at those offsets, and the names
would be another function's. So the dying worker, in its last words (after its results are sent),
checks each library of its crash record against its own memory map (`/proc/self/maps`): the
mapping that holds the frame's address names the file it was loaded from, marked `(deleted)` or
under another path once that file was replaced. It writes one line per library:

    hardy-mapped: same <inode>:<size>:<mtime_ns> <path>     the file at <path> is the one mapped
    hardy-mapped: replaced - <path>                           it is not (or is gone)

and, for a replaced library whose mapped file it can still open (`/proc/self/map_files`, which
Linux lets only a process with CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE open), the function of each
of its frames, read from that file's symbol table:

    hardy-symbol: <address> <offset into the function> <symbol>

The parent (`frames.name_frames`) names a frame from the disk only when its library is `same` and
the file still has that identity; for a replaced one it takes the `hardy-symbol` name, else the
exported name `dladdr` found in the worker's memory (the mapped copy's own dynamic symbols), else
says "library replaced since it was loaded" instead of a name. A record without these lines (a
worker whose last words did not run) is named from the disk, as before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

MARK = "hardy-mapped: "
SYMBOL = "hardy-symbol: "
NATIVE = "hardy-native: "
Native = tuple[int, int, int, str, str]  # a native frame's address, load base, symbol address, symbol, library


@dataclass(frozen=True)
class Mapped:
    """What the worker said of one library: the identity of the file it mapped (None: replaced)."""

    identity: str | None

    def replaced(self, path: str) -> bool:
        """Whether the file at `path` now is not the one the worker ran."""
        return self.identity is None or self.identity != _identity(path)


def native_lines(text: str) -> list[Native]:
    """(address, load base, symbol address, exported symbol, library) of each frame of the last
    native record in `text` (`handler.py` writes one per crash, or per exit from native code)."""
    frames: list[Native] = []
    for line in text.splitlines():
        if not line.startswith(NATIVE):
            continue
        parts = line[len(NATIVE):].split(" ", 4)
        if parts[0] in ("signal", "exit"):
            frames = []  # a later record: the one the process died of
            continue
        if len(parts) != 5:
            continue
        try:
            frames.append((int(parts[0], 16), int(parts[1], 16), int(parts[2], 16), parts[3], parts[4]))
        except ValueError:
            continue
    return frames


def record(fault: int) -> None:
    """In a dying worker: the `hardy-mapped` (and `hardy-symbol`) lines for the libraries of the
    native record in its crash file `fault`, appended to it."""
    try:
        text = os.pread(fault, os.fstat(fault).st_size, 0).decode(errors="replace")
        frames = native_lines(text)
        if not frames:
            return
        maps = _maps()
        lines = []
        for library in dict.fromkeys(f[4] for f in frames if f[4] not in ("", "?") and f[1]):
            ours = [(k, f) for k, f in enumerate(frames) if f[4] == library]
            where = next((m for m in maps if m[0] <= ours[0][1][0] < m[1]), None)
            if where is None:  # no file mapping holds it: nothing to say, the disk names it
                continue
            if _same(where, library):
                lines.append(f"{MARK}same {_identity(library)} {library}\n")
            else:
                lines += [f"{MARK}replaced - {library}\n", *_named(where, ours)]
        os.write(fault, "".join(lines).encode())
    except Exception:  # last words: whatever fails here leaves the record as it was
        pass


def read(text: str) -> tuple[dict[str, Mapped], dict[int, tuple[str, int]]]:
    """({library: what the worker said of it}, {address: (symbol, offset into it)}) from a record."""
    mapped: dict[str, Mapped] = {}
    named: dict[int, tuple[str, int]] = {}
    for line in text.splitlines():
        if line.startswith(MARK):
            parts = line[len(MARK):].split(" ", 2)
            if len(parts) == 3:
                mapped[parts[2]] = Mapped(parts[1] if parts[0] == "same" else None)
        elif line.startswith(SYMBOL):
            parts = line[len(SYMBOL):].split(" ", 2)
            try:
                named[int(parts[0], 16)] = (parts[2], int(parts[1], 16))
            except (ValueError, IndexError):
                continue
    return mapped, named


def _identity(path: str) -> str:
    """`inode:size:mtime_ns` of the file at `path` now, or "-" when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return "-"
    return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def _maps() -> list[tuple[int, int, str, str, int]]:
    """(start, end, the mapped file's path now, the range as map_files names it, its inode) of each
    mapping of a file; the path of a file that was removed or replaced ends with " (deleted)"."""
    found = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith("/"):
                start, _, end = parts[0].partition("-")
                found.append((int(start, 16), int(end, 16), parts[5].rstrip("\n"), parts[0], int(parts[4])))
    return found


def _same(where: tuple[int, int, str, str, int], library: str) -> bool:
    """Whether the file at `library` is the one mapped at `where`: not deleted, and under the same
    path or with the same inode (a path seen through a bind mount or an overlay reads otherwise)."""
    if where[2].endswith(" (deleted)"):
        return False
    try:
        return where[2] == os.path.realpath(library) or where[4] == os.stat(library).st_ino
    except OSError:
        return False


def _named(where: tuple[int, int, str, str, int], frames: list[tuple[int, Native]]) -> list[str]:
    """`hardy-symbol` lines for the frames of a replaced library (each with its place in the
    record), read from the mapped file itself through /proc/self/map_files (none where this
    process may not open it)."""
    from .symbols import table
    mapped = f"/proc/self/map_files/{where[3]}"
    try:
        os.close(os.open(mapped, os.O_RDONLY))
    except OSError:
        return []
    symbols = table(mapped)
    if symbols is None:
        return []
    lines = []
    for k, (address, base, _, _, _) in frames:
        caller = int(k > 0)  # after the first, return addresses: the call is the byte before
        hit = symbols.lookup(address - base - caller)
        if hit is not None:
            lines.append(f"{SYMBOL}{address:#x} {hit[1] + caller:#x} {hit[0]}\n")
    return lines
