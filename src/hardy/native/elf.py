"""Reading the dynamic section of an ELF shared library (pyelftools): what the loader will look for."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import BinaryIO

ELF_MAGIC = b"\x7fELF"


@dataclass(frozen=True)
class Library:
    path: str
    soname: str            # DT_SONAME, or the file name when the library has none
    needed: tuple[str, ...]
    rpath: tuple[str, ...]   # DT_RPATH entries, $ORIGIN expanded
    runpath: tuple[str, ...]  # DT_RUNPATH entries, $ORIGIN expanded

    @property
    def directory(self) -> str:
        return os.path.dirname(self.path)


def open_regular(path: str) -> BinaryIO | None:
    """`path` opened for reading if it is a regular file, else None: a FIFO named like a library
    (planted in a shared folder) would block a plain open() for ever, and a device never ends. Opened
    with O_NONBLOCK, and with O_NOFOLLOW where the name is a link of another user's (a link of the
    user's or root's is followed, as the loader does); what was opened is checked, not the name."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        if os.lstat(path).st_uid not in (os.geteuid(), 0):
            flags |= os.O_NOFOLLOW
        fd = os.open(path, flags)
    except OSError:
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return os.fdopen(fd, "rb")
    except OSError:
        pass
    os.close(fd)
    return None


def is_elf(path: str) -> bool:
    f = open_regular(path)
    if f is None:
        return False
    with f:
        try:
            return f.read(4) == ELF_MAGIC
        except OSError:
            return False


def read_library(path: str) -> Library | None:
    """The dynamic-linking facts of one file, or None if it is not an ELF shared object (or not a
    regular file: `open_regular`)."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile
    f = open_regular(path)
    if f is None:
        return None
    try:
        with f:
            if f.read(4) != ELF_MAGIC:
                return None
            elf = ELFFile(f)
            dynamic = elf.get_section_by_name(".dynamic")
            soname, needed, rpath, runpath = None, [], [], []
            if dynamic is not None:
                for tag in dynamic.iter_tags():
                    kind = tag.entry.d_tag
                    if kind == "DT_NEEDED":
                        needed.append(tag.needed)
                    elif kind == "DT_SONAME":
                        soname = tag.soname
                    elif kind == "DT_RPATH":
                        rpath += _expand(tag.rpath, path)
                    elif kind == "DT_RUNPATH":
                        runpath += _expand(tag.runpath, path)
    except (ELFError, OSError, ValueError):
        return None
    return Library(path, soname or os.path.basename(path), tuple(needed), tuple(rpath), tuple(runpath))


def _expand(value: str, path: str) -> list[str]:
    origin = os.path.dirname(os.path.abspath(path))
    return [p.replace("$ORIGIN", origin).replace("${ORIGIN}", origin) for p in value.split(":") if p]
