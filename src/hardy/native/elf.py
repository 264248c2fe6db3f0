"""Reading the dynamic section of an ELF shared library (pyelftools): what the loader will look for."""

from __future__ import annotations

import os
from dataclasses import dataclass

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


def is_elf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == ELF_MAGIC
    except OSError:
        return False


def read_library(path: str) -> Library | None:
    """The dynamic-linking facts of one file, or None if it is not an ELF shared object."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile
    if not is_elf(path):
        return None
    try:
        with open(path, "rb") as f:
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
