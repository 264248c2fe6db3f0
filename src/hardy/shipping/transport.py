"""Big buffers between the parent and its workers through shared memory, not through the pipe.

A message is pickled with protocol 5; every buffer of at least `buffers.THRESHOLD` bytes that a value
exposes (numpy arrays and Arrow buffers pickle their memory as a `PickleBuffer`; with
`shipping.dumps` and `shipping.out_of_band`, so do plain torch CPU tensors, bytes, bytearray and
memoryview) is taken out of band and copied once into a memfd segment, whose file descriptors
follow the message over the worker's Unix socket (SCM_RIGHTS). The receiver maps the segment and
unpickles views of it, so its arrays and tensors are the shared pages themselves: no copy into the
pipe, out of it, or out of the pickle (bytes and bytearray own their memory: they are copied out
of the pages once). Why memfd rather than /dev/shm files: a memfd has no name anyone
could guess or open, lives only as long as an open descriptor or mapping, and the kernel frees it
when both sides are gone, so a worker killed mid-transfer (SIGSEGV, SIGKILL, the OOM killer)
leaves nothing behind, which a named segment cannot promise. Below the threshold the pipe is
cheaper than creating, sizing and mapping a segment (bench/bigdata.py).

Copying into the segment is the sender's whole cost, and one memfd takes writes only as fast as
one thread makes them (about 2.8 GB/s here: the kernel allocates a page per 4 KiB written). So a
segment of 2 x `PIECE` or more is cut into up to `WRITERS` pieces, one memfd each, written by that
many threads at once (write(2) lets go of the GIL); the receiver reserves one range of addresses
and maps the pieces one after another into it, so a buffer that straddles two is still one view.

A message without big buffers is the plain pickle, so both sides tell the two apart by the first
bytes: a pickle starts with the PROTO opcode, a message with a segment with `MAGIC`.
"""

from __future__ import annotations

import functools
import mmap
import os
import pickle
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..buffers import big_buffer, map_pieces
from .pickling import dumps, out_of_band, quick

PIECE = 4 << 20  # bytes: a segment is cut into pieces no smaller than this, written at once
WRITERS = min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
MAGIC = b"HSEG"
_ALIGN = 64
SCM_MAX_FD = 253  # descriptors one sendmsg(2) may pass (Linux): more go in several messages


class Packed:
    """A pickled message and the memfd segments holding its big buffers: first the descriptors of
    its own segment, `owned` of them (closed once sent, or by `close` if it will not be), then
    those of shared ones (`Shared`, which closes them)."""

    __slots__ = ("data", "fds", "owned")

    def __init__(self, data: bytes, fds: Sequence[int] = (), owned: int = 0):
        self.data, self.fds, self.owned = data, list(fds) if fds else _NONE, owned

    def close(self) -> None:
        if self.owned:
            for fd in self.fds[:self.owned]:
                os.close(fd)
            self.owned = 0


_NONE: list[int] = []  # the descriptors of a message that has none (never changed)


class Shared:
    """Segments of the values every item of a map shares (a bound array, a model's weights): each
    is written once for the whole map and its descriptor passed with every chunk, instead of a
    copy per chunk. `close` when the map is over (the workers' mappings stay valid)."""

    def __init__(self, values: Sequence[Any], dump: Callable[..., bytes]):
        self.owners: dict[int, Any] = {}  # id -> the object exporting a shared buffer (kept alive)
        self.fds: dict[int, list[int]] = {}

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

    def segment(self, raw: memoryview) -> list[int] | None:
        """The descriptors of the segment holding `raw`, if `raw` belongs to a shared value."""
        if id(raw.obj) not in self.owners:
            return None
        fds = self.fds.get(id(raw.obj))
        if fds is None:
            fds = self.fds[id(raw.obj)] = _segment([raw])[0]
        return fds

    def close(self) -> None:
        for fds in self.fds.values():
            for fd in fds:
                os.close(fd)
        self.fds.clear()


def pack(obj: Any, dump: Callable[..., bytes], shared: Shared | None = None) -> Packed:
    """`obj` pickled, its big buffers in a fresh memfd segment (or, for values of `shared`, in
    theirs). `dump(obj, buffer_callback)` is `shipping.dumps` or a function like it; with one of
    hardy's own two (`dumps`, `out_of_band`), a message without big buffers is pickled once, the
    quick way (`pickling.quick`)."""
    if dump is dumps or dump is out_of_band:
        data = quick(obj, main=dump is dumps)
        if data is not None:
            return Packed(data)
    big: list[memoryview] = []

    def take_out(buf: pickle.PickleBuffer | None) -> bool:
        if buf is None:  # `dump` starts a second attempt: the first one's buffers are not used
            big.clear()
            return True
        raw = big_buffer(buf)
        if raw is None:
            return True
        big.append(raw)
        return False

    data = dump(obj, buffer_callback=take_out)
    if not big:
        return Packed(data)
    own = [raw for raw in big if shared is None or shared.segment(raw) is None]
    fds, starts = _segment(own) if own else ([], [])
    owned = len(fds)
    # Where each buffer is: (its segment's first descriptor in the message, offset, size).
    where: dict[int, tuple[int, int]] = {id(raw): (0, start) for raw, start in zip(own, starts)}
    for raw in big:
        if id(raw) not in where:
            theirs = shared.segment(raw) if shared is not None else None
            assert theirs is not None  # the others are in `own`
            where[id(raw)] = (len(fds), 0)
            fds += theirs
    layout = [v for raw in big for v in (*where[id(raw)], raw.nbytes)]
    return Packed(MAGIC + struct.pack(f"<II{len(layout)}Q", len(big), len(fds), *layout) + data, fds, owned)


def _segment(raws: Sequence[memoryview]) -> tuple[list[int], list[int]]:
    """A new segment holding `raws` one after another (aligned), and where each starts. A big
    segment is cut into pieces, one memfd each, written by as many threads at once: one memfd
    takes writes no faster than one thread can make them, separate ones scale."""
    starts, size = [], 0
    for raw in raws:
        starts.append(size)
        size += -(-raw.nbytes // _ALIGN) * _ALIGN
    pieces = max(1, min(WRITERS, size // PIECE))
    step = -(-size // pieces // mmap.PAGESIZE) * mmap.PAGESIZE  # the receiver maps each piece on a page
    bounds = [(lo, min(size, lo + step)) for lo in range(0, size, step)]
    fds: list[int] = []
    try:
        for lo, hi in bounds:
            fds.append(os.memfd_create("hardy", os.MFD_CLOEXEC))
            os.ftruncate(fds[-1], hi - lo)
        _together([functools.partial(_fill, fd, lo, hi, raws, starts) for fd, (lo, hi) in zip(fds, bounds)])
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds, starts


def _fill(fd: int, lo: int, hi: int, raws: Sequence[memoryview], starts: Sequence[int]) -> None:
    """Write the bytes of the segment from `lo` to `hi` into `fd`, the piece holding them: with
    write(2), which takes no page faults and lets go of the GIL."""
    for raw, start in zip(raws, starts):
        done, end = max(lo, start), min(hi, start + raw.nbytes)
        while done < end:
            done += os.pwrite(fd, raw[done - start:end - start], done - lo)


def _together(jobs: Sequence[Callable[[], None]]) -> None:
    """Run the jobs at once, the first in this thread; raise the first error once all are over.
    Threads started per call, not a pool: a pool's idle threads do not survive a fork."""
    errors: list[BaseException] = []

    def run(job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as exc:  # raised in the calling thread below
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(job,), name="hardy-ship-part", daemon=True) for job in jobs[1:]]
    for thread in threads:
        thread.start()
    try:
        jobs[0]()
    finally:
        for thread in threads:
            thread.join()
    if errors:
        raise errors[0]


def send(conn: Any, head: bytes, packed: Packed) -> None:
    """`head` + the message over `conn` (a multiprocessing Connection on a Unix socket), then the
    segments' descriptors, `SCM_MAX_FD` per message (a map's shared values, cut into pieces, can
    pass more); the message's own are closed here: only the receiver holds them now."""
    try:
        write_frame(conn.fileno(), head, packed.data)
        if packed.fds:
            with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:
                for k in range(0, len(packed.fds), SCM_MAX_FD):
                    socket.send_fds(s, [b"F"], packed.fds[k:k + SCM_MAX_FD])
    finally:
        packed.close()


SPIN = 50e-6  # seconds a call's two sides wait awake for the other's next message (`spin_for`) before sleeping
_LENGTH = struct.Struct("!i")  # a message's length in front of it, as multiprocessing's Connection frames it
_SMALL = 16384  # bytes: a message sent in one write with its length (as Connection does up to that size)


class Channel:
    """One end of a socket, with the three methods of multiprocessing's `Connection` that a fork
    server and its workers use (`send_bytes`, `recv_bytes`, `fileno`) and the same framing
    (`write_frame`, `read_frame`): the other end may be a `Connection`. A fork server imports what
    its workers need before it can fork the first, and `multiprocessing.connection` (with the
    `subprocess` it imports) was a tenth of that, for these three methods."""

    __slots__ = ("fd",)

    def __init__(self, fd: int):
        self.fd = fd

    def fileno(self) -> int:
        return self.fd

    def send_bytes(self, data: bytes) -> None:
        write_frame(self.fd, b"", data)

    def recv_bytes(self) -> bytes:
        return read_frame(self.fd)

    def close(self) -> None:
        if self.fd >= 0:  # (once: a second close would close whatever took the number since)
            os.close(self.fd)
            self.fd = -1


def write_frame(fd: int, head: bytes, data: bytes) -> None:
    """`head` + `data` as one message on socket `fd`, framed as `Connection.send_bytes` frames it
    (either end may read it with `recv_bytes`): written here without that method's layers, which
    cost as much as the write itself on a small message, the common one."""
    n = len(head) + len(data)
    if n <= _SMALL:
        _write_all(fd, _LENGTH.pack(n) + head + data)
        return
    if n > 0x7FFFFFFF:
        _write_all(fd, _LENGTH.pack(-1) + struct.pack("!Q", n))
    else:
        _write_all(fd, _LENGTH.pack(n))
    if head:
        _write_all(fd, head)
    _write_all(fd, data)


def _write_all(fd: int, data: Any) -> None:
    view = None
    while True:
        n = os.write(fd, data)
        if n == len(data):
            return
        view = memoryview(data) if view is None else view
        data = view = view[n:]


def spin_for(poller: Any, seconds: float) -> None:
    """Wait up to `seconds` on the CPU for `poller`'s descriptor to be readable (or its other end
    gone), handing the CPU to any other process ready to run on it meanwhile (`sched_yield`); the
    caller then reads as usual. A process that sleeps on its read is woken by the kernel when the
    other side writes, and on this project's virtual machines that wake-up is most of a call's
    round trip (a run() 70 to 80 µs instead of 25 to 35, bench/everyday.py): the side that
    expects an answer or the next call within microseconds waits for it awake instead, as
    OpenMP's threads do between parallel regions (for 200 ms by default; here 50 µs)."""
    clock, poll, pause = time.perf_counter, poller.poll, os.sched_yield
    end = clock() + seconds
    while not poll(0):
        if clock() >= end:
            return
        pause()


def read_frame(fd: int) -> bytes:
    """The next message on socket `fd` (framed as `write_frame` and `Connection.send_bytes` frame it);
    EOFError at the end of the stream, as `Connection.recv_bytes` raises it. On a socket with a
    receive timeout (the parent's end of a worker's: `Worker.wait`), BlockingIOError when no
    message began within it; once one has, its rest is waited for."""
    head = os.read(fd, 4)
    if len(head) < 4:
        head = _read_rest(fd, head, 4)
    (size,) = _LENGTH.unpack(head)
    if size == -1:
        (size,) = struct.unpack("!Q", _read_rest(fd, b"", 8))
    data = _read(fd, size) if size else b""
    return data if len(data) == size else _read_rest(fd, data, size)


def _read(fd: int, size: int) -> bytes:
    while True:
        try:
            return os.read(fd, size)
        except BlockingIOError:  # (a receive timeout, mid-message: the sender is still writing)
            continue


def _read_rest(fd: int, first: bytes, size: int) -> bytes:
    if not first and size:
        first = _read(fd, size)
        if not first:
            raise EOFError
    parts, got = [first], len(first)
    while got < size:
        chunk = _read(fd, size - got)
        if not chunk:
            raise OSError("got end of file during message")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def packed(data: bytes, start: int = 0) -> bool:
    """Whether the message at `start` of `data` has segments to receive (else it is a plain pickle)."""
    return data.startswith(MAGIC, start)


def unpack(conn: Any, view: memoryview) -> Any:
    """The object in `view` (a message read from `conn`); its big buffers are views of the
    segments that follow on `conn`, each unmapped when the last of its views is collected."""
    if view[:4] != MAGIC:
        return pickle.loads(view)
    count, n_fds = struct.unpack_from("<II", view, 4)
    layout = struct.unpack_from(f"<{3 * count}Q", view, 12)
    fds = receive_fds(conn, n_fds)
    firsts = sorted(set(layout[::3]))  # a segment: its first descriptor and those up to the next one's
    try:
        whole = {first: map_pieces(fds[first:end]) for first, end in zip(firsts, [*firsts[1:], n_fds])}
    finally:
        for fd in fds:
            os.close(fd)
    buffers = [whole[layout[3 * k]][layout[3 * k + 1]:layout[3 * k + 1] + layout[3 * k + 2]] for k in range(count)]
    return pickle.loads(view[12 + 24 * count:], buffers=buffers)


def receive_fds(conn: Any, n_fds: int) -> list[int]:
    """The `n_fds` descriptors `send` passed after a message on `conn`."""
    fds: list[int] = []
    with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:
        while len(fds) < n_fds:  # one byte per message of at most SCM_MAX_FD descriptors (`send`)
            try:
                _, got, _, _ = socket.recv_fds(s, 1, min(SCM_MAX_FD, n_fds - len(fds)))
            except BlockingIOError:  # (a receive timeout: they follow their message, on their way)
                continue
            fds += got
            if not got:
                break
    if len(fds) != n_fds:
        for fd in fds:
            os.close(fd)
        raise EOFError("the sender died before passing its shared-memory segments")
    return fds
