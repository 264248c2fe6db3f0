"""Shared libraries loaded in this process, read with `dl_iterate_phdr`.

`dl_iterate_phdr` asks the dynamic loader itself (~170 µs for a process with torch loaded), which is
cheaper and more exact than parsing /proc/self/maps: it lists each library once, by the path it was
loaded from, including ones loaded with RTLD_LOCAL by extension modules.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys

_OPENMP = re.compile(r"^lib(gomp|iomp5|omp)([-.][\w.-]*)?\.so")


class _PhdrInfo(ctypes.Structure):
    _fields_ = [("addr", ctypes.c_void_p), ("name", ctypes.c_char_p),
                ("phdr", ctypes.c_void_p), ("phnum", ctypes.c_uint16)]


_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_PhdrInfo), ctypes.c_size_t, ctypes.c_void_p)


def loaded_libraries() -> list[str]:
    """Paths of the shared objects mapped into this process, in load order."""
    if not sys.platform.startswith("linux"):
        return []
    names: list[str] = []

    def visit(info: ctypes._Pointer, size: int, data: int) -> int:  # type: ignore[type-arg]
        name = info.contents.name
        if name:
            names.append(os.fsdecode(name))
        return 0

    libc = ctypes.CDLL(None)
    libc.dl_iterate_phdr(_CALLBACK(visit), None)
    return names


def openmp_runtimes(libraries: list[str] | None = None) -> list[str]:
    """The OpenMP runtimes among the loaded libraries (torch bundles its own libgomp copy)."""
    libs = loaded_libraries() if libraries is None else libraries
    return [p for p in libs if _OPENMP.match(os.path.basename(p))]
