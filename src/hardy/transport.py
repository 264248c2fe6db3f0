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
from typing import Any, Callable

THRESHOLD = 1 << 20  # bytes: smaller buffers stay in the pickle
MAGIC = b"HSEG"
_ALIGN = 64


class Packed:
    """A pickled message and, when it has big buffers, the memfd holding them until it is sent
    (or `close`d: a message that will not be sent must not keep its segment)."""

    __slots__ = ("data", "fd")

    def __init__(self, data: bytes, fd: int | None = None):
        self.data, self.fd = data, fd

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def pack(obj: Any, dump: Callable[..., bytes]) -> Packed:
    """`obj` pickled, its big buffers in a fresh memfd segment. `dump(obj, buffer_callback)` is
    `shipping.dumps` or a function like it."""
    big: list[memoryview] = []

    def out_of_band(buf: pickle.PickleBuffer | None) -> bool:
        if buf is None:  # `dump` starts a second attempt: the first one's buffers are not used
            big.clear()
            return True
        try:
            raw = buf.raw()
        except BufferError:  # not contiguous: in the pickle
            return True
        if raw.nbytes < THRESHOLD:
            return True
        big.append(raw)
        return False

    data = dump(obj, buffer_callback=out_of_band)
    if not big:
        return Packed(data)
    offsets, size = [], 0
    for raw in big:
        offsets += [size, raw.nbytes]
        size += -(-raw.nbytes // _ALIGN) * _ALIGN
    fd = os.memfd_create("hardy", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        for raw, start in zip(big, offsets[::2]):  # write(2) into the segment: no page faults here
            done = 0
            while done < raw.nbytes:
                done += os.pwrite(fd, raw[done:], start + done)
    except BaseException:
        os.close(fd)
        raise
    return Packed(MAGIC + struct.pack(f"<I{len(offsets)}Q", len(big), *offsets) + data, fd)


def send(conn: Any, head: bytes, packed: Packed) -> None:
    """`head` + the message over `conn` (a multiprocessing Connection on a Unix socket), then the
    segment's descriptor, which is closed here: from now on only the receiver holds it."""
    try:
        conn.send_bytes(head + packed.data if head else packed.data)
        if packed.fd is not None:
            with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:
                socket.send_fds(s, [b"F"], [packed.fd])
    finally:
        packed.close()


def unpack(conn: Any, view: memoryview) -> Any:
    """The object in `view` (a message read from `conn`); its big buffers are views of the
    segment that follows on `conn`, unmapped when the last of them is garbage-collected."""
    if view[:4] != MAGIC:
        return pickle.loads(view)
    (count,) = struct.unpack_from("<I", view, 4)
    offsets = struct.unpack_from(f"<{2 * count}Q", view, 8)
    with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:
        _, fds, _, _ = socket.recv_fds(s, 1, 1)
    if not fds:
        raise EOFError("the sender died before passing its shared-memory segment")
    try:
        whole = _map(fds[0], offsets[-2] + offsets[-1])
    finally:
        for fd in fds:
            os.close(fd)
    buffers = [whole[offsets[2 * k]:offsets[2 * k] + offsets[2 * k + 1]] for k in range(count)]
    return pickle.loads(view[8 + 16 * count:], buffers=buffers)


def _map(fd: int, size: int) -> memoryview:
    """`fd`'s first `size` bytes mapped, as a view that unmaps itself when its last user is gone.
    Not `mmap.mmap`: before Python 3.13 it keeps a duplicate descriptor per mapping, and a map's
    results alive at once would run the process out of descriptors."""
    libc = _libc()
    addr = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        err = ctypes.get_errno()
        raise OSError(err, f"mapping a shared-memory segment of {size} bytes: {os.strerror(err)}")
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
