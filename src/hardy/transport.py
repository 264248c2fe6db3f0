"""Big buffers between the parent and its workers through shared memory, not through the pipe.

A message is pickled with protocol 5; every buffer of at least `THRESHOLD` bytes that a value
exposes (numpy arrays, torch CPU tensors, Arrow buffers, bytes-likes: whatever pickles a
`PickleBuffer`) is taken out of band and copied once into a memfd segment, whose file descriptor
follows the message over the worker's Unix socket (SCM_RIGHTS). The receiver maps the segment and
unpickles views of it, so its arrays are the shared pages themselves: no copy into the pipe, out
of it, or out of the pickle. Why memfd rather than /dev/shm files: a memfd has no name anyone
could guess or open, lives only as long as an open descriptor or mapping, and the kernel frees it
when both sides are gone, so a worker killed mid-transfer (SIGSEGV, SIGKILL, the OOM killer)
leaves nothing behind, which a named segment cannot promise. Below the threshold the pipe is
cheaper than creating, sizing and mapping a segment (bench/bigdata.py).

A message without big buffers is the plain pickle, so both sides tell the two apart by the first
bytes: a pickle starts with the PROTO opcode, a message with a segment with `MAGIC`.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import pickle
import socket
import struct
import weakref
from collections.abc import Callable, Sequence
from typing import Any

THRESHOLD = 1 << 20  # bytes: smaller buffers stay in the pickle
MAGIC = b"HSEG"
_ALIGN = 64


class Packed:
    """A pickled message and the memfd segments holding its big buffers: its own (closed once
    sent, or by `close` if it will not be), then shared ones (`Shared`, which closes them)."""

    __slots__ = ("data", "fds", "owned")

    def __init__(self, data: bytes, fds: Sequence[int] = (), owned: bool = False):
        self.data, self.fds, self.owned = data, list(fds), owned

    def close(self) -> None:
        if self.owned:
            os.close(self.fds[0])
            self.owned = False


class Shared:
    """Segments of the values every item of a map shares (a bound array, a model's weights): each
    is written once for the whole map and its descriptor passed with every chunk, instead of a
    copy per chunk. `close` when the map is over (the workers' mappings stay valid)."""

    def __init__(self, values: Sequence[Any], dump: Callable[..., bytes]):
        self.owners: dict[int, Any] = {}  # id -> the object exporting a shared buffer (kept alive)
        self.fds: dict[int, int] = {}

        def note(buf: pickle.PickleBuffer | None) -> bool:
            raw = big_buffer(buf)
            if raw is not None:
                self.owners[id(raw.obj)] = raw.obj
            return True
        for value in values:
            try:
                dump(value, buffer_callback=note)
            except Exception:  # it will fail with a clear error where the chunk is shipped
                pass

    def segment(self, raw: memoryview) -> int | None:
        """The descriptor of the segment holding `raw`, if `raw` belongs to a shared value."""
        if id(raw.obj) not in self.owners:
            return None
        fd = self.fds.get(id(raw.obj))
        if fd is None:
            fd = self.fds[id(raw.obj)] = _segment([raw])[0]
        return fd

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def pack(obj: Any, dump: Callable[..., bytes], shared: Shared | None = None) -> Packed:
    """`obj` pickled, its big buffers in a fresh memfd segment (or, for values of `shared`, in
    theirs). `dump(obj, buffer_callback)` is `shipping.dumps` or a function like it."""
    big: list[memoryview] = []

    def out_of_band(buf: pickle.PickleBuffer | None) -> bool:
        if buf is None:  # `dump` starts a second attempt: the first one's buffers are not used
            big.clear()
            return True
        raw = big_buffer(buf)
        if raw is None:
            return True
        big.append(raw)
        return False

    data = dump(obj, buffer_callback=out_of_band)
    if not big:
        return Packed(data)
    own = [raw for raw in big if shared is None or shared.segment(raw) is None]
    fd, starts = _segment(own) if own else (None, [])
    where: dict[int, tuple[int, int]] = {id(raw): (0, start) for raw, start in zip(own, starts)}
    fds = [fd] if fd is not None else []
    for raw in big:
        if id(raw) not in where:
            assert shared is not None
            fds.append(shared.segment(raw))  # type: ignore[arg-type]
            where[id(raw)] = (len(fds) - 1, 0)
    layout = [v for raw in big for v in (*where[id(raw)], raw.nbytes)]
    return Packed(MAGIC + struct.pack(f"<II{len(layout)}Q", len(big), len(fds), *layout) + data, fds,
                  owned=fd is not None)


def big_buffer(buf: pickle.PickleBuffer | None) -> memoryview | None:
    """The buffer's bytes if it should travel out of band (big enough and contiguous)."""
    if buf is None:
        return None
    try:
        raw = buf.raw()
    except BufferError:  # not contiguous: in the pickle
        return None
    return raw if raw.nbytes >= THRESHOLD else None


def _segment(raws: Sequence[memoryview]) -> tuple[int, list[int]]:
    """A new memfd holding `raws` one after another (aligned), and where each starts."""
    starts, size = [], 0
    for raw in raws:
        starts.append(size)
        size += -(-raw.nbytes // _ALIGN) * _ALIGN
    fd = os.memfd_create("hardy", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        for raw, start in zip(raws, starts):  # write(2) into the segment: no page faults here
            done = 0
            while done < raw.nbytes:
                done += os.pwrite(fd, raw[done:], start + done)
    except BaseException:
        os.close(fd)
        raise
    return fd, starts


def send(conn: Any, head: bytes, packed: Packed) -> None:
    """`head` + the message over `conn` (a multiprocessing Connection on a Unix socket), then the
    segments' descriptors; the message's own is closed here: only the receiver holds it now."""
    try:
        conn.send_bytes(head + packed.data if head else packed.data)
        if packed.fds:
            with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:
                socket.send_fds(s, [b"F"], packed.fds)
    finally:
        packed.close()


def unpack(conn: Any, view: memoryview) -> Any:
    """The object in `view` (a message read from `conn`); its big buffers are views of the
    segments that follow on `conn`, each unmapped when the last of its views is collected."""
    if view[:4] != MAGIC:
        return pickle.loads(view)
    count, n_fds = struct.unpack_from("<II", view, 4)
    layout = struct.unpack_from(f"<{3 * count}Q", view, 12)
    with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:
        _, fds, _, _ = socket.recv_fds(s, 1, n_fds)
    if len(fds) != n_fds:
        for fd in fds:
            os.close(fd)
        raise EOFError("the sender died before passing its shared-memory segments")
    sizes = [0] * n_fds
    for k in range(count):
        seg, start, n = layout[3 * k:3 * k + 3]
        sizes[seg] = max(sizes[seg], start + n)
    try:
        whole = [map_fd(fd, size) for fd, size in zip(fds, sizes)]
    finally:
        for fd in fds:
            os.close(fd)
    buffers = [whole[layout[3 * k]][layout[3 * k + 1]:layout[3 * k + 1] + layout[3 * k + 2]] for k in range(count)]
    return pickle.loads(view[12 + 24 * count:], buffers=buffers)


def map_fd(fd: int, size: int, flags: int = mmap.MAP_SHARED) -> memoryview:
    """`fd`'s first `size` bytes mapped read-write, as a view that unmaps itself when its last user
    is gone: MAP_SHARED for a segment both processes see, MAP_PRIVATE for a copy-on-write view of a
    file (the cache's blob files: writes stay in this process). The descriptor may be closed at once.
    Not `mmap.mmap`: before Python 3.13 it keeps a duplicate descriptor per mapping, and a map's
    results alive at once would run the process out of descriptors."""
    libc = _libc()
    addr = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        err = ctypes.get_errno()
        raise OSError(err, f"mapping {size} bytes: {os.strerror(err)}")
    region = (ctypes.c_char * size).from_address(addr)
    weakref.finalize(region, libc.munmap, addr, size)
    return memoryview(region).cast("B")


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc
