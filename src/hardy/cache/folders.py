"""Files in a directory other users may write, reached without following anything they planted.

A path is resolved again by every call that names it, so checking a path (`lstat`) and then using
it (`open`) proves nothing: another user who can write the directory swaps in a symbolic link in
between, and a process that writes through it (as root: anywhere) creates or overwrites files of
their choosing. So a directory is opened once, checked through its descriptor (`fstat`: a directory,
whose, writable by whom), and everything inside is reached relative to that descriptor
(`openat` and friends: Python's `dir_fd=`), one level at a time, each level opened with
`O_NOFOLLOW`: a link planted at any level fails with ELOOP (an `OSError`, which the cache counts as
a fault: the node runs uncached), never followed. Files are created with `O_EXCL` under a fresh
random name and renamed into place (a rename replaces a link, never writes through it).

The directory a user names (`DiskCache(path)`, `report_dir=`) is theirs to choose: its last component
may be a symbolic link, but only one of the user's own or root's (the rule of Linux's
`fs.protected_symlinks` for sticky directories such as /tmp: another user's link there is refused).

Standard library only (`os.open(..., dir_fd=)`, `os.replace(..., src_dir_fd=, dst_dir_fd=)`): the
same few calls as Python's own `shutil.rmtree` and `tempfile`.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
from collections.abc import Callable, Iterator, Sequence

from ..errors import UntrustedCacheError
from .s3 import half_the_memory

NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW
OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
OTHERS_ANY = stat.S_IRWXG | stat.S_IRWXO
HOLES_ALLOWED = 1 << 20  # bytes of a file's size its blocks may fall short of (block rounding, a tiny inline file)


class Folder:
    """An open, checked directory: `fd` is its descriptor, `path` only names it in messages.

    `private`: it must be the current user's and writable by nobody else (checked on the
    descriptor, so it holds for what every later call reaches). Close it, or use it as a context
    manager."""

    __slots__ = ("fd", "path", "private")

    def __init__(self, fd: int, path: str, private: bool):
        self.fd, self.path, self.private = -1, path, private
        try:
            check(fd, path, private)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def __enter__(self) -> Folder:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self, _close: Callable[[int], None] = os.close) -> None:  # (bound early: callable at exit too)
        if self.fd >= 0:
            _close(self.fd)
            self.fd = -1

    __del__ = close  # one opened twice by racing threads: the copy not kept is closed when dropped

    def sub(self, name: str, *, create: bool = False, mode: int = 0o700, private: bool | None = None) -> Folder:
        """The folder `name` in this one (made with `mode` if absent and `create`), opened without
        following a link; private if this one is, unless said otherwise."""
        private = self.private if private is None else private
        try:
            fd = self._open_folder(name)
        except FileNotFoundError:
            if not create:
                raise
            try:
                os.mkdir(name, mode, dir_fd=self.fd)
                made = True
            except FileExistsError:  # made by another process meanwhile: opened and checked as any
                made = False
            fd = self._open_folder(name)
            if made and private:
                os.fchmod(fd, mode & 0o755)  # ours: exactly so, whatever the umask
        return Folder(fd, os.path.join(self.path, name), private)

    def _open_folder(self, name: str) -> int:
        """`name` opened as a folder; a link there fails with ELOOP (the kernel says ENOTDIR)."""
        try:
            return os.open(name, DIRECTORY, dir_fd=self.fd)
        except NotADirectoryError:
            if stat.S_ISLNK(self.lstat(name).st_mode):
                raise OSError(errno.ELOOP, "a symbolic link where a folder should be: not followed",
                              os.path.join(self.path, name)) from None
            raise

    def open(self, name: str, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
        """A descriptor of the file `name` in this folder; a link there fails (ELOOP)."""
        return os.open(name, flags | NOFOLLOW, mode, dir_fd=self.fd)

    def lstat(self, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def write(self, name: str, data: bytes | Sequence[bytes | bytearray | memoryview],
              mode: int | None = 0o444) -> None:
        """`name` written whole or not at all: to a fresh name (`O_EXCL`), then renamed into place;
        `mode` exactly, or (None) as the umask makes a new file. The temporary file is locked
        (`flock`) from its creation until it is renamed: a writer killed meanwhile leaves one that
        nobody holds, which `sweep` removes, and a live writer's is never removed."""
        while True:
            tmp = f".{name}.{os.urandom(8).hex()}.tmp"
            fd = self.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if mode is not None else 0o666)
            if _locked(fd):
                break  # (a sweep removed it between its creation and the lock: a new name)
            os.close(fd)
        try:
            with open(fd, "wb", closefd=False) as f:
                for piece in [data] if isinstance(data, (bytes, bytearray, memoryview)) else data:
                    f.write(piece)
                if mode is not None:
                    os.fchmod(f.fileno(), mode)  # read-only entries: nobody but root truncates a mapped one
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)  # (before the lock goes, with `fd`)
        except BaseException:
            self.unlink(tmp)
            raise
        finally:
            os.close(fd)

    def sweep(self) -> int:
        """Remove the temporary files `write` left here when killed (never a live writer's, which
        holds its lock): named as `write` names them, regular files of the current user's that
        nobody holds. Returns how many were removed."""
        removed = 0
        for name in self.names():
            if not (name.startswith(".") and name.endswith(".tmp")):
                continue
            try:
                fd = self.open(name, os.O_RDONLY | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # OSError: held, its writer is alive
                    removed += self.unlink(name)
            except OSError:
                pass
            finally:
                os.close(fd)
        return removed

    def unlink(self, name: str) -> bool:
        """Remove `name` (a link planted there is itself removed, never what it points to)."""
        try:
            os.unlink(name, dir_fd=self.fd)
            return True
        except FileNotFoundError:
            return False

    def names(self) -> list[str]:
        """What the folder holds, read through a descriptor of its own (a listing shares no offset
        with another process's)."""
        fd = os.open(".", DIRECTORY, dir_fd=self.fd)
        try:
            return os.listdir(fd)
        finally:
            os.close(fd)

    def files(self, *, depth: int) -> Iterator[tuple[Folder, str]]:
        """(folder, name) of each entry `depth` levels down (0: this folder's own), folders opened as
        `sub` opens them; a link or anything unreadable on the way is left out."""
        for name in self.names():
            if depth == 0:
                yield self, name
                continue
            try:
                deeper = self.sub(name)
            except OSError:
                continue
            with deeper:
                yield from deeper.files(depth=depth - 1)


def _locked(fd: int) -> bool:
    """Lock a new temporary file for its writer; False if a sweep removed it before the lock was
    taken (no link left: it can never be renamed into place). A filesystem without locks (an NFS
    mount without its lock service) writes without one, and its sweep removes nothing."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        return True
    return os.fstat(fd).st_nlink > 0


def check(fd: int, path: str, private: bool) -> os.stat_result:
    """The directory `fd`'s status; raises if it is no directory, or (private) not the current user's or
    writable by others."""
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", path)
    if private and (st.st_uid != os.geteuid() or st.st_mode & OTHERS_WRITE):
        raise PermissionError(errno.EPERM, f"not a private folder of the current user's (uid {st.st_uid}, mode "
                              f"{stat.S_IMODE(st.st_mode):o})", path)
    return st


def open_named(path: str, *, private: bool, create: bool = False, mode: int = 0o700) -> Folder:
    """The directory a user named, opened and checked (made with `mode` if absent and `create`).
    Its last component may be a link of the user's own or root's; one of anyone else's is refused
    (`UntrustedCacheError`), as Linux refuses to follow other users' links in sticky directories."""
    path = os.path.abspath(path)
    if create:
        os.makedirs(path, mode=mode, exist_ok=True)
    try:
        fd = os.open(path, DIRECTORY)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR) or not os.path.islink(path):
            raise
        owner = os.lstat(path).st_uid
        if owner not in (os.geteuid(), 0):
            raise UntrustedCacheError(f"{path} is a symbolic link of uid {owner}'s, not yours: hardy does not "
                                      "follow another user's link (whoever made it chooses where your files go); "
                                      "remove it, or name the directory it points to") from None
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    return Folder(fd, path, private)


def unreadable(st: os.stat_result, limit: int | None = None) -> str | None:
    """Why a regular file someone else may have written is no file of hardy's to read into memory,
    told by its `fstat` alone; None if it may be read. hardy writes its files whole, so one with
    holes (a sparse terabyte costs its writer no disk, and its reader the time and memory of
    reading every zero) is not; nor is one bigger than `limit` (default: half the memory this
    process may use, `s3.half_the_memory`, the cap a bucket's objects are read under)."""
    if st.st_size - st.st_blocks * 512 > HOLES_ALLOWED:
        return f"a sparse file ({st.st_size:,} bytes long, {st.st_blocks * 512:,} on disk)"
    limit = half_the_memory() if limit is None else limit
    if st.st_size > limit:
        return f"{st.st_size:,} bytes, more than the {limit:,} read at most"
    return None


def read_fd(fd: int) -> bytes:
    """The whole of a regular file (anything else, a FIFO planted to hang the reader, is refused;
    someone else's file too if it is `unreadable`)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.EINVAL, "not a regular file")
    if st.st_uid != os.geteuid() and (why := unreadable(st)):
        raise OSError(errno.EFBIG, f"not read: {why}")
    with open(fd, "rb", closefd=False) as f:
        return f.read()


def map_or_copy(fd: int) -> bytes | memoryview:
    """A private copy-on-write mapping of the file: its pages are read from the page cache on first
    touch, not copied; whoever holds it may write into it (numpy arrays unpickled over it are
    writable) without changing the file. Replacing or deleting the file (atomic rename, unlink: all
    the cache ever does to a blob) leaves the mapping as it was.

    A mapping dies (SIGBUS) when its file is truncated later, so only files nobody else can
    truncate are mapped: the current user's, read-only (blobs are written 0444; an older writable
    one of ours is made read-only here). Anyone else's file is read into memory of our own: one
    copy, and a truncation meanwhile makes a short entry that fails its MAC; never one that is
    `unreadable` (sparse, or bigger than half the memory)."""
    from ..buffers import map_fd  # here: `import hardy` does not load ctypes
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.EINVAL, "not a regular file")
    if st.st_uid != os.geteuid():
        if why := unreadable(st):
            raise OSError(errno.EFBIG, f"not read: {why}")
        return copy_fd(fd, st.st_size)
    if st.st_mode & 0o222:
        os.fchmod(fd, 0o444)
    return map_fd(fd, st.st_size, mmap.MAP_PRIVATE) if st.st_size else b""


def copy_fd(fd: int, size: int) -> memoryview:
    """Up to `size` bytes of the file into a buffer of our own (which the caller may keep and write into)."""
    data = bytearray(size)
    view, done = memoryview(data), 0
    while done < size and (n := os.readv(fd, [view[done:]])):
        done += n
    return view[:done]
