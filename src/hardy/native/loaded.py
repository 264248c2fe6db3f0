"""Shared libraries loaded in this process, read from its memory map (`/proc/self/maps`).

The loader's own list (`dl_iterate_phdr`) is cheaper to read (30 against 240 µs; 50 against 770
with torch loaded) but unsafe to read from Python. The walk holds the loader's lock while it calls
back into Python, which waits for the GIL; a thread that holds the GIL and loads a library (any
import of an extension module) waits for that lock: both wait forever. And glibc (2.36 at least)
does not reset that lock in a fork child: a fork while another thread walked left the child's next
walk or `dlopen` waiting forever. A pool's spare-worker thread forked a worker as the map's thread
listed its libraries to diagnose a crash, and the worker never started. The memory map takes no
lock of the loader's. It names each library by its file's real path (symlinks resolved), once
per file. threadpoolctl reads it too since 3.7, for the same reasons (hardy requires 3.8, faster).
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

# A mapping's line: address range, permissions, offset, device, inode, then the file's path, with
# " (deleted)" after a file removed or replaced since. Shared objects: *.so, *.so.1, *.so.1.2.3-git.
_SHARED_OBJECT = re.compile(rb"^\S+ \S+ \S+ \S+ \S+ +(/.*?\.so(?:\.[^/\s]+)?)(?: \(deleted\))?$", re.MULTILINE)


def loaded_libraries() -> list[str]:
    """Real paths of the shared objects mapped into this process, each once, in address order."""
    if not sys.platform.startswith("linux"):
        return []
    with open("/proc/self/maps", "rb") as maps:
        found = _SHARED_OBJECT.findall(maps.read())
    return [os.fsdecode(path) for path in dict.fromkeys(found)]


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
