"""Shared libraries loaded in this process, read with `dl_iterate_phdr`.

`dl_iterate_phdr` asks the dynamic loader itself (~170 µs for a process with torch loaded), which is
cheaper and more exact than parsing /proc/self/maps: it lists each library once, by the path it was
loaded from, including ones loaded with RTLD_LOCAL by extension modules.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any


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


# Every file name threadpoolctl recognises as an OpenMP or BLAS runtime holds one of these
# (libgomp, libiomp, libomp, vcomp; libopenblas, libscipy_openblas, libblas, libflexiblas; libblis; libmkl_rt)
_RUNTIME_MARKS = ("omp", "blas", "blis", "mkl")


def may_hold_thread_pools() -> bool:
    """Whether a library loaded here might be a runtime threadpoolctl governs: False means none is,
    so there is nothing to cap, without importing threadpoolctl (a fork server's first map waits
    for its imports). True may be a false alarm (a name that holds a mark by chance)."""
    return any(mark in os.path.basename(path).lower() for path in loaded_libraries() for mark in _RUNTIME_MARKS)


def thread_pools() -> list[dict[str, Any]]:
    """The OpenMP and BLAS runtimes loaded in this process, as threadpoolctl finds them: each with
    its `user_api` ("openmp" or "blas"), `internal_api`, `filepath`, `version` and `num_threads`.

    threadpoolctl is the maintained answer to "which runtimes are loaded and how many threads will
    each use" (scikit-learn and numpy's test suites rely on it); it also knows each runtime's symbol
    for reading and setting its thread count, which a list of library names does not."""
    from threadpoolctl import threadpool_info
    info: list[dict[str, Any]] = threadpool_info()
    return info


def openmp_runtimes() -> list[str]:
    """Paths of the loaded OpenMP runtimes (torch bundles its own libgomp copy, numba may load another)."""
    return [p["filepath"] for p in thread_pools() if p["user_api"] == "openmp"]
