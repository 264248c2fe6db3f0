"""Where cache entries live. A store moves opaque bytes; it knows nothing of keys' meaning or MACs.

`Store` is the interface a shared store implements to put a cache on several machines.
`FileStore` is one file per entry, for a directory on a shared filesystem (NFS, a cluster FS) where
SQLite's locking cannot be trusted; it needs only atomic rename, so an fsspec or object-store
version is the same class over another filesystem API. `LocalStore` is the fast local one:

    <dir>/index.sqlite   key -> small entries inline, or the name of a blob file; sizes; times
    <dir>/blobs/ab/cdef… large entries (> 256 KiB), written to a unique temporary name, then renamed

It is for a directory only its user writes (a private cache, the local side of a bucket's): SQLite
opens its files by path, follows symbolic links and makes `-wal`/`-shm` files beside them, and
Python's sqlite3 cannot ask it not to (`SQLITE_OPEN_NOFOLLOW`), so in a directory others write a
planted link would make it write where they choose. A directory others write is a `FileStore`'s
(`files.py`). The index files are kept 0600 (a lock on them needs a descriptor: nobody else can
hold one), and the blob files are reached through the directory's descriptor (`folders.py`).

A cache hit reads an entry through `view`: a blob file comes back as a private copy-on-write
mapping, so the big arrays of an entry (DiskCache's format 4) are unpickled as views of the file's
pages instead of being copied out of it.

Why SQLite: the warm path is one lookup per node per item (30,000 for 10,000 items x 3 nodes); an
indexed SELECT in WAL mode costs a few microseconds where opening one file per entry costs ten or
more, and SQLite gives atomic, concurrent, crash-safe writes from any number of processes.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from . import flight
from .folders import Folder, map_or_copy, open_named, read_fd
from .folders import unreadable as unreadable  # (read here by observe/report.py)

log = logging.getLogger("hardy.cache")

INLINE_MAX = 256 << 10
_generation = 0  # bumped in a forked child: SQLite connections must never cross a fork


def _forked() -> None:
    global _generation
    _generation += 1


os.register_at_fork(after_in_child=_forked)
TOUCH_EVERY = 3600.0  # seconds: last-access times are refreshed at most this often (LRU granularity)
WRITABLE_AGAIN = 5.0  # seconds: an index opened read-only because it could not be opened for writing is tried again
FULL_BELOW = 1 << 20  # bytes available under which a disk that refuses the index is said to be full


@dataclass(frozen=True)
class EntryInfo:
    key: bytes
    size: int
    created: float
    accessed: float
    inline: bool


Buffer = bytes | bytearray | memoryview
Data = Buffer | Sequence[Buffer]  # an entry, or its pieces in order (written without joining them)
B = TypeVar("B", bound=Buffer)
INDEX = "index.sqlite"
INDEX_FILES = (INDEX, f"{INDEX}-wal", f"{INDEX}-shm", f"{INDEX}-journal")


class Store(Protocol):
    """Opaque entries by key. `view` and `get_many` hand out entries for DiskCache to verify and
    unpickle: any buffer, best one it may keep and write into without a copy (a private mapping);
    `get` returns bytes. `put` takes an entry's bytes or its pieces (an entry with big buffers)."""

    def get(self, key: bytes) -> bytes | None: ...
    def view(self, key: bytes) -> Buffer | None: ...
    def get_many(self, keys: tuple[bytes, ...]) -> dict[bytes, Buffer]: ...
    def put(self, key: bytes, data: Data) -> None: ...
    def delete(self, key: bytes) -> None: ...
    def entries(self) -> Iterator[EntryInfo]: ...
    def clear(self) -> None: ...
    def exists(self) -> bool: ...


def _unfolded(db: str) -> bool:
    """Whether `db` has a write-ahead log with writes not yet folded into it, and the -shm file that
    lets a reader see them without writing anything."""
    try:
        return os.path.getsize(db + "-wal") > 0 and os.path.exists(db + "-shm")
    except OSError:
        return False


def is_corruption(exc: sqlite3.Error) -> bool:
    """Only a damaged file is corruption; a full disk, a read-only mount, missing permission, an I/O
    error or a lock held past the timeout are faults of the environment, and leave the index alone."""
    code = getattr(exc, "sqlite_errorcode", None)  # Python 3.11+; before, only the message tells
    if code is None:
        return "malformed" in str(exc) or "not a database" in str(exc)
    return code & 0xFF in (11, 26)  # SQLITE_CORRUPT, SQLITE_NOTADB


def blob_name(key: bytes) -> str:
    name = key.hex()
    return os.path.join(name[:2], name)


def number(value: Any) -> float:
    """A size or time of an index row as a number (0 for anything else: the row was not hardy's)."""
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else 0.0


def pieces(data: Data) -> Sequence[Buffer]:
    return [data] if isinstance(data, (bytes, bytearray, memoryview)) else data


class LocalStore:
    """A cache directory of the current user's: a SQLite index plus blob files. Safe for many
    processes and threads.

    Nothing is created until the first write, so opening a cache to look into it (or a prepared
    cache on a read-only mount) leaves the filesystem as it was."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        self.blobs = os.path.join(self.path, "blobs")
        self._db = os.path.join(self.path, INDEX)
        self._local = threading.local()  # conn, generation; unwritable and until for a read-only fallback
        self._folders: dict[str, Folder] = {}  # the directory and its blobs folder, opened once per object
        self._here: tuple[int, int] | None = None  # (device, inode) of the index the connections opened

    def exists(self) -> bool:
        return os.path.exists(self._db)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"])  # type: ignore[misc]  # unpickling re-runs the constructor

    def folder(self, create: bool = False) -> Folder:
        """The cache directory, opened and checked (the current user's, writable by nobody else)."""
        top = self._folders.get("")
        if top is None:
            top = self._folders.setdefault("", open_named(self.path, private=True, create=create))
        return top

    def _blobs(self, create: bool = False) -> Folder:
        blobs = self._folders.get("blobs")
        if blobs is None:
            blobs = self._folders.setdefault("blobs", self.folder(create).sub("blobs", create=create))
        return blobs

    # --- connection per process and thread (never reused across fork) ---------------------------

    def _conn(self) -> sqlite3.Connection:
        local = self._local
        conn: sqlite3.Connection | None = getattr(local, "conn", None)
        if conn is not None and local.generation == _generation and (local.until is None or
                                                                      time.monotonic() < local.until):
            return conn
        local.unwritable = local.until = None
        local.conn, local.generation = self._open(), _generation
        return local.conn  # type: ignore[no-any-return]

    def _open(self) -> sqlite3.Connection:
        for attempt in range(2):
            try:
                return self._connect()
            except sqlite3.DatabaseError as exc:
                if not attempt and is_corruption(exc):
                    self._quarantine(exc)
                    continue
                if is_corruption(exc) or "locked" in str(exc) or not self.exists():
                    raise
                return self._fallback(exc)
        raise AssertionError("unreachable")

    def _fallback(self, exc: sqlite3.DatabaseError) -> sqlite3.Connection:
        """An index that exists but cannot be opened for writing (a full disk: WAL mode must make its
        -shm file, 32 KiB, and SQLite cannot read a WAL database without it unless told that nobody
        writes it) is read without creating anything, so everything stored is served; writes fail
        at once with why (`_writable`), and a writable connection is tried again after
        `WRITABLE_AGAIN` seconds. Read `immutable`, unless a writer left a write-ahead log with its
        -shm (then through them, as any reader, where they can be read): nobody can write to a full
        disk, and one that frees space and writes within those seconds can at worst make this
        reader see a torn page: an error (never taken for damage here: `_run`) or bytes whose MAC
        fails."""
        try:
            disk = os.statvfs(self.path)
            full = disk.f_bavail * disk.f_frsize < FULL_BELOW or disk.f_favail == 0
        except OSError:
            full = False
        why = (errno.ENOSPC if full else errno.EIO, f"{'disk full' if full else exc}: the cache index {self._db} "
               "cannot be written")
        for frozen in (False, True) if _unfolded(self._db) else (True,):
            conn = self._read_only(frozen)
            try:
                conn.execute("SELECT 1 FROM entries LIMIT 0")  # (opening reads nothing yet)
                break
            except sqlite3.Error:
                conn.close()
                if frozen and full:
                    raise OSError(*why) from exc
                if frozen:
                    raise exc from None
        self._local.unwritable, self._local.until = why, time.monotonic() + WRITABLE_AGAIN
        return conn

    def _read_only(self, frozen: bool) -> sqlite3.Connection:
        """The index opened read-only: `frozen`, as immutable (no -shm, no lock, nothing created)."""
        self._mark()
        return sqlite3.connect(f"file:{self._db}?{'immutable=1' if frozen else 'mode=ro'}", uri=True,
                               isolation_level=None, check_same_thread=False)

    def _writable(self, retry: bool = False) -> sqlite3.Connection:
        """The connection, for a write: a read-only fallback (`_fallback`) is given up for a writable
        one when its time is up, or at once with `retry` (room was just made); until then a write
        fails at once, saying why."""
        if retry and getattr(self._local, "unwritable", None) is not None:
            self._local.conn = None
        conn = self._conn()
        if (why := getattr(self._local, "unwritable", None)) is not None:
            raise OSError(*why)
        return conn

    def _mark(self) -> None:
        """Remember which index file the connections open (`moved`)."""
        with contextlib.suppress(OSError):
            st = os.stat(self._db)
            self._here = (st.st_dev, st.st_ino)

    def moved(self) -> bool:
        """Whether the index this store opened is no longer at its path: its directory deleted or
        replaced while in use (`rm -rf`, a temporary-file cleaner), or the index moved aside as
        damaged by another process. Everything opened is then let go (each thread's connection,
        and the folders' descriptors, closed once nobody uses them), so the next use opens, or
        makes, what is there now; until then reads come from the deleted files and writes go into
        them, to vanish at exit. One `stat`: DiskCache asks before each write and after each map,
        never on a hit."""
        if self._here is None:
            return False
        try:
            st = os.stat(self._db)
            if (st.st_dev, st.st_ino) == self._here:
                return False
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError:  # (unreadable now: its faults will say so)
            return False
        self._here, self._local, self._folders = None, threading.local(), {}
        return True

    def _connect(self) -> sqlite3.Connection:
        """A connection to the index, set up. When several processes open a fresh index at once,
        switching it to WAL can answer "database is locked" at once, without waiting for the busy
        timeout (a lock upgrade SQLite refuses rather than risk a deadlock): that is retried. A
        directory we cannot write to (a read-only mount of a prepared cache) is opened read-only."""
        if os.path.exists(self._db) and not os.access(self.path, os.W_OK):  # (index first: it implies the folder)
            # Nobody can write a read-only mount: the index is immutable (no -shm needed), unless
            # its writer ended before folding its write-ahead log into it (a process killed, or one
            # whose workers still held the index): SQLite reads that log read-only through the -shm
            # file beside it. A directory only we cannot write to is opened read-only, seeing others' writes.
            return self._read_only(bool(os.statvfs(self.path).f_flag & os.ST_RDONLY) and not _unfolded(self._db))
        self._private_index()
        self._mark()
        delay, deadline = 0.002, time.monotonic() + 60
        while True:
            conn = sqlite3.connect(self._db, timeout=60, isolation_level=None, check_same_thread=False)
            try:
                conn.execute("PRAGMA busy_timeout=60000")
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")
                conn.execute("CREATE TABLE IF NOT EXISTS entries (key BLOB PRIMARY KEY, data BLOB, file TEXT, "
                             "size INTEGER, created REAL, accessed REAL) WITHOUT ROWID")
                return conn
            except sqlite3.OperationalError as exc:
                conn.close()
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(delay)
                delay = min(2 * delay, 0.1)

    def _private_index(self) -> None:
        """The index files, before SQLite opens them: none a link (refused: ELOOP), each readable
        by the current user only. SQLite locks with fcntl on a descriptor of the file, so an index
        others may read (SQLite makes it with the umask's 0644, and its -wal and -shm alike) lets
        any of them hold a lock that stalls every writer; 0600 leaves them none. The index is made
        here, empty and 0600, and SQLite gives -wal and -shm the mode of the index."""
        top = self.folder(create=True)
        for name in INDEX_FILES:
            try:
                fd = top.open(name, os.O_RDONLY | (os.O_CREAT | os.O_EXCL if name == INDEX else 0), 0o600)
            except FileExistsError:
                fd = top.open(name, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                st = os.fstat(fd)
                if st.st_mode & 0o077 and st.st_uid == os.geteuid():
                    os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o700)
            finally:
                os.close(fd)

    def _quarantine(self, exc: Exception) -> None:
        """A damaged index is moved aside (its entries are lost, never served wrong) and a new one
        started, at most once per clock hour: the aside name is the hour's, taken atomically with
        link(), so processes that all find the damage at once move it once; the others reconnect."""
        self._local.conn = None
        aside = f"{INDEX}.damaged-{time.strftime('%Y%m%d%H')}"
        top = self.folder()
        try:
            os.link(INDEX, aside, src_dir_fd=top.fd, dst_dir_fd=top.fd, follow_symlinks=False)
        except OSError:  # moved aside already this hour (or cannot be): leave it, run uncached if it stays bad
            return
        log.warning("cache index %s is damaged (%s); moved to %s, starting a new one", self._db, exc,
                    os.path.join(self.path, aside))
        top.unlink(INDEX)
        for suffix in ("-wal", "-shm"):
            try:
                os.replace(INDEX + suffix, aside + suffix, src_dir_fd=top.fd, dst_dir_fd=top.fd)
            except OSError:
                pass

    def _run(self, sql: str, args: tuple[Any, ...] = (), write: bool = False, retry: bool = False) -> list[Any]:
        try:
            return (self._writable(retry) if write else self._conn()).execute(sql, args).fetchall()
        except sqlite3.DatabaseError as exc:
            if not is_corruption(exc) or getattr(self._local, "unwritable", None) is not None:
                raise  # (a read-only fallback's torn read is no damage: `_fallback`)
            self._quarantine(exc)
            return self._conn().execute(sql, args).fetchall()

    # --- entries -----------------------------------------------------------------------------------

    def get(self, key: bytes) -> bytes | None:
        return self._get(key, read_fd)

    def view(self, key: bytes) -> Buffer | None:
        """The entry; a blob file as a private mapping (`map_or_copy`)."""
        return self._get(key, map_or_copy)

    def _get(self, key: bytes, read: Callable[[int], B]) -> B | None:
        if getattr(self._local, "conn", None) is None and not self.exists():
            return None  # nothing written yet: a miss, without creating anything
        try:
            row = self._conn().execute("SELECT data, file, accessed FROM entries WHERE key = ?", (key,)).fetchone()
        except sqlite3.DatabaseError:
            rows = self._run("SELECT data, file, accessed FROM entries WHERE key = ?", (key,))
            row = rows[0] if rows else None
        if row is None:
            return None
        data: B
        data, file, accessed = row
        if file is not None:
            try:
                data = self._read_blob(key, file, read)
            except OSError:  # gone, or a row that names no blob of this key
                with contextlib.suppress(sqlite3.Error, OSError):  # (a full disk's index: a miss all the same)
                    self.delete(key)
                return None
        elif not isinstance(data, bytes):  # a row hardy did not write: an entry that fails verification
            data = b""  # type: ignore[assignment]
        now = time.time()
        if now - number(accessed) > TOUCH_EVERY:
            try:
                self._run("UPDATE entries SET accessed = ? WHERE key = ?", (now, key), write=True)
            except (sqlite3.Error, OSError):  # read-only or full: only LRU order suffers
                pass
        return data

    def _read_blob(self, key: bytes, file: str, read: Callable[[int], B]) -> B:
        self._blob(key, file)
        with self._blobs().sub(file[:2]) as shard:
            fd = shard.open(key.hex(), os.O_RDONLY | os.O_NONBLOCK)
        try:
            return read(fd)
        finally:
            os.close(fd)

    def get_many(self, keys: tuple[bytes, ...]) -> dict[bytes, Buffer]:
        if getattr(self._local, "conn", None) is None and not self.exists():
            return {}
        marks = ",".join("?" * len(keys))
        rows = self._run(f"SELECT key, data, file, accessed FROM entries WHERE key IN ({marks})", keys)
        found: dict[bytes, Buffer] = {}
        now = time.time()
        for key, data, file, accessed in rows:
            if file is not None or not isinstance(data, bytes) or now - number(accessed) > TOUCH_EVERY:
                data = self.view(key)  # files, odd rows and stale access times: the one-by-one path
            if data is not None:
                found[key] = data
        return found

    def have(self, keys: Sequence[bytes]) -> set[bytes]:
        """Which of `keys` have an entry (one query; unverified: for read-ahead, not for serving)."""
        if not keys or getattr(self._local, "conn", None) is None and not self.exists():
            return set()
        marks = ",".join("?" * len(keys))
        return {row[0] for row in self._run(f"SELECT key FROM entries WHERE key IN ({marks})", tuple(keys))}

    def put(self, key: bytes, data: Data) -> None:
        now = time.time()
        size = sum(memoryview(piece).nbytes for piece in pieces(data))
        if size <= INLINE_MAX:
            row = b"".join(pieces(data))
            self._run("INSERT OR REPLACE INTO entries VALUES (?, ?, NULL, ?, ?, ?)", (key, row, size, now, now),
                      write=True)
            return
        name = blob_name(key)
        with self._blobs(create=True).sub(name[:2], create=True) as shard:
            shard.write(key.hex(), pieces(data))
            try:
                self._run("INSERT OR REPLACE INTO entries VALUES (?, NULL, ?, ?, ?, ?)", (key, name, size, now, now),
                          write=True)
            except BaseException:  # no entry refers to the blob: do not leave it taking space
                shard.unlink(key.hex())
                raise

    def delete(self, key: bytes) -> None:
        """The key's blob file first, if it has one (removing a file takes no room: on a full disk
        that makes the room the index's write needs), then its row."""
        name = blob_name(key)
        try:
            with self._blobs().sub(name[:2]) as shard:
                freed = shard.unlink(key.hex())
        except OSError:
            freed = False
        self._run("DELETE FROM entries WHERE key = ?", (key,), write=True, retry=freed)

    def _blob(self, key: bytes, file: str) -> str:
        """The blob file of `key`, whose index row names `file`: always the key's own name, so an
        index that names another file cannot point a read or a delete elsewhere."""
        if file != blob_name(key):
            raise OSError(f"cache index row for {key.hex()} names {file!r}, not its blob")
        return os.path.join(self.blobs, file)

    def entries(self) -> Iterator[EntryInfo]:
        if not self.exists():
            return
        rows = self._run("SELECT key, size, created, accessed, file FROM entries")
        found = [EntryInfo(key, int(number(size)), number(created), number(accessed), file is None)
                 for key, size, created, accessed, file in rows if isinstance(key, bytes)]  # others: not hardy's
        yield from sorted(found, key=lambda e: e.accessed)

    def clear(self) -> None:
        """Every entry deleted; on a full disk, where the index cannot be written, the blob files
        first (which makes room for it)."""
        if self.exists():
            try:
                self._run("DELETE FROM entries", write=True)
            except (sqlite3.Error, OSError):
                self._sweep_blobs(0, keep=set())
                self._run("DELETE FROM entries", write=True, retry=True)
        self.sweep(0)

    def locks(self, create: bool = False) -> Folder:
        """Single flight's lock files (`DiskCache._flight`): a folder of this private one."""
        return self.folder(create).sub("locks", create=create)

    def sweep(self, older_than: float = 3600.0) -> int:
        """Remove blob files no entry refers to that are older than `older_than` seconds (left by a
        writer killed between rename and insert), temporary files their writer left when killed
        (`Folder.sweep`) and lock files nobody holds. Returns how many files were removed."""
        removed = self._sweep_blobs(older_than) if self.exists() else 0
        try:
            with self.locks() as locks:
                return removed + flight.sweep(locks)
        except FileNotFoundError:
            return removed

    def _sweep_blobs(self, older_than: float, keep: set[str] | None = None) -> int:
        """Blob files no entry refers to (none kept with `keep=set()`), older than `older_than`."""
        known = {f for (f,) in self._run("SELECT file FROM entries WHERE file IS NOT NULL")} if keep is None else keep
        removed, now = 0, time.time()
        try:
            blobs = self._blobs()
        except FileNotFoundError:
            return 0
        for shard in blobs.names():
            with contextlib.suppress(OSError), blobs.sub(shard) as folder:
                removed += folder.sweep()  # temporary files their writers left when killed (a live one's is locked)
                for name in folder.names():
                    with contextlib.suppress(OSError):
                        if (f"{shard}/{name}" not in known and not name.endswith(".tmp")
                                and now - folder.lstat(name).st_mtime >= older_than):
                            removed += folder.unlink(name)
        return removed
