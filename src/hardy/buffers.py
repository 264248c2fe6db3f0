"""Big buffers, and the memory they are mapped from: the leaf under the worker transport
(`shipping.transport`, segments between processes) and the cache (entries mapped from files).

`THRESHOLD` is where a buffer stops being cheaper to copy through a pickle than to map
(bench/bigdata.py): both the transport and the cache's entry format keep bigger ones out of band.
Mappings are made with libc's mmap and handed out as views that unmap themselves when their last
user is gone (`map_fd`), not as `mmap.mmap` objects: before Python 3.13 each of those keeps a
duplicate descriptor, and a map's results alive at once would run the process out of them.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import pickle
import weakref
from collections.abc import Sequence
from typing import Any

THRESHOLD = 1 << 20  # bytes: smaller buffers stay in the pickle
_MAP_FIXED = 0x10  # <sys/mman.h> on Linux, as memfd is; the mmap module lacks it before 3.13


def big_buffer(buf: pickle.PickleBuffer | None) -> memoryview | None:
    """The buffer's bytes if it should travel out of band (big enough and contiguous)."""
    if buf is None:
        return None
    try:
        raw = buf.raw()
    except BufferError:  # not contiguous: in the pickle
        return None
    return raw if raw.nbytes >= THRESHOLD else None


def map_fd(fd: int, size: int, flags: int = mmap.MAP_SHARED) -> memoryview:
    """`fd`'s first `size` bytes mapped read-write, as a view that unmaps itself when its last user
    is gone: MAP_SHARED for a segment both processes see, MAP_PRIVATE for a copy-on-write view of a
    file (the cache's blob files: writes stay in this process). The descriptor may be closed at once."""
    addr = _checked(_libc().mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0), size)
    return _view(addr, size)


def map_pieces(fds: Sequence[int]) -> memoryview:
    """The pieces of a segment (memfds of a message, `shipping.transport`) mapped one after another,
    as one view (see `map_fd`)."""
    libc = _libc()
    sizes = [os.fstat(fd).st_size for fd in fds]
    size = sum(sizes)
    # Reserve the whole range (PROT_NONE: 0), then lay each piece over its part of it.
    addr = _checked(libc.mmap(None, size, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0), size)
    try:
        at = addr
        for fd, piece in zip(fds, sizes):
            _checked(libc.mmap(at, piece, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED, fd, 0),
                     size)
            at += piece
    except OSError:
        libc.munmap(addr, size)
        raise
    return _view(addr, size)


def _view(addr: int, size: int) -> memoryview:
    """The mapping at `addr` as a view that unmaps it when its last user is gone. Not `mmap.mmap`:
    before Python 3.13 it keeps a duplicate descriptor per mapping, and a map's results alive at
    once would run the process out of descriptors."""
    region = (ctypes.c_char * size).from_address(addr)
    weakref.finalize(region, _libc().munmap, addr, size)
    return memoryview(region).cast("B")


def _checked(addr: int | None, size: int) -> int:
    if addr in (None, ctypes.c_void_p(-1).value):
        err = ctypes.get_errno()
        raise OSError(err, f"mapping {size} bytes of shared memory or of a cache file: {os.strerror(err)}")
    assert addr is not None
    return addr


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc
