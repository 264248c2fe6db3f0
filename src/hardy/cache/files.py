"""One file per entry: the store of a directory shared between machines, or between users.

    <dir>/entries/ab/<key>                              a private directory (`DiskCache(path, store="files")`)
    <dir>/entries/<key format>/<key id>/ab/<key>        a shared one (`DiskCache(path, shared=True)`)

Writes go to a fresh name and are renamed into place: readers see a whole entry or none, and only
atomic rename is needed (no SQLite, whose locks cannot be trusted on NFS and whose files follow
links: `store.py`). Every file and folder is reached through the directory's descriptor, one level
at a time, without following a link (`folders.py`): in a directory other users write, a link they
plant at any level is refused (the entry is a miss, or is not stored), never followed.

A shared directory keeps each secret's entries in a folder of its own, named by the key id, as a
bucket does (`objectstore.py`). An entry read there is verified with that secret: one that fails,
whatever its header says, is damage, deleted and recomputed (`DiskCache._load`); another secret's
entries are in another folder, never read, so nothing anyone writes can make a reader skip a key for
good. A folder of the current user's own key (`own`) is made 0700 and must stay theirs: nobody
else can even delete those entries. A team secret's folder is made for the team (0777 less the
umask; a setgid group folder passes its group on).

Access times come from the filesystem (no write on read), so LRU order follows atime where the
mount records it, else creation order. Entries are read, not mapped: a page of a mapped NFS file
deleted by another machine can fail to load later (SIGBUS); `view` reads into a buffer of its own,
one copy, which the caller may keep and write into. Another user's file that no writer of entries
makes is damage, never read: one with holes (entries are written whole; a sparse terabyte costs
its planter no disk) or bigger than half the memory (a bucket's cap: `s3.half_the_memory`). The
user's own files are read as written (a filesystem that compresses may store their zeros as holes).

`choose_store` is which store `DiskCache(store=...)` means.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from typing import Any, cast

from ..model.arguments import bad
from .folders import Folder, copy_fd, open_named, unreadable
from .s3 import half_the_memory
from .store import Buffer, Data, EntryInfo, LocalStore, Store, pieces


class FileStore:
    """Entries as files under `<path>/entries/` (see the module docstring). `namespace` (a shared
    directory's `<key format>/<key id>`) puts them in a folder of their own; `shared`: others may
    write the directory (its folders may be theirs; only links are refused); `own`: the
    namespace's folder is the current user's alone (0700, checked)."""

    def __init__(self, path: str | os.PathLike[str], namespace: str | None = None, *, shared: bool = False,
                 own: bool = False):
        self.path = os.fspath(path)
        self.namespace, self.shared, self.own = namespace, shared, own
        self.levels = ["entries", *(namespace.split("/") if namespace else [])]
        self.root = os.path.join(self.path, *self.levels)
        self._folders: dict[str, Folder] = {}
        self.read_limit = half_the_memory()  # bytes of one entry, at most (`view`): as a bucket's; this process's own

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "namespace": self.namespace, "shared": self.shared, "own": self.own}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state.pop("path"), **state)  # type: ignore[misc]  # unpickling re-runs the constructor

    def __repr__(self) -> str:
        return f"FileStore({self.root!r})"

    def namespaced(self, key: bytes) -> bool:
        """Whether `key`'s entry was read from a folder only one secret's entries belong in."""
        return self.namespace is not None

    def folder(self, levels: list[str], create: bool = False) -> Folder:
        """The folder `levels` down from the directory (`entries/...`, or DiskCache's `locks/...`):
        in a shared directory the team's, save a namespace's own folder (the third level) when
        `own`: the user's alone; in a private directory, every one the user's alone."""
        team = 0o777 if self.shared else 0o700
        here = open_named(self.path, private=not self.shared, create=create, mode=team)
        for k, name in enumerate(levels):
            mine = self._private(k)
            deeper = here.sub(name, create=create, mode=0o700 if mine else team, private=mine)
            here.close()
            here = deeper
        return here

    def _private(self, level: int) -> bool:
        return not self.shared or (self.own and level >= 2)

    def _root(self, create: bool = False) -> Folder:
        """The entries' folder, opened once (its descriptor stays valid wherever it is moved)."""
        root = self._folders.get("")
        if root is None:
            root = self._folders.setdefault("", self.folder(self.levels, create))
        return root

    def _shard(self, name: str, create: bool = False) -> Folder:
        mine = self._private(len(self.levels))
        return self._root(create).sub(name[:2], create=create, mode=0o700 if mine else 0o777, private=mine)

    def exists(self) -> bool:
        try:
            self._root()
        except OSError:
            return False
        return True

    def get(self, key: bytes) -> bytes | None:
        data = self.view(key)
        return None if data is None else bytes(data)

    def view(self, key: bytes) -> Buffer | None:
        name = key.hex()
        try:
            with self._shard(name) as shard:
                fd = shard.open(name, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO planted there: no wait for a writer
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # a FIFO that would hang the reader, a device: damage
                return b""
            if st.st_nlink > 1 or st.st_uid != os.geteuid() and unreadable(st, self.read_limit):
                # damage, unread: a second link (an entry is renamed into place, with one; another user
                # who may write a file of yours can link it here, made sparse), or another's that is
                # sparse (entries are written whole) or past the cap (ours: written by us, as big)
                return b""
            try:
                return copy_fd(fd, st.st_size)
            except MemoryError:  # a size no entry of ours has (a sparse file of a terabyte): damage
                return b""
        finally:
            os.close(fd)

    def get_many(self, keys: tuple[bytes, ...]) -> dict[bytes, Buffer]:
        found = {}
        for key in keys:
            data = self.view(key)
            if data is not None:
                found[key] = data
        return found

    def put(self, key: bytes, data: Data) -> None:
        name = key.hex()
        with self._shard(name, create=True) as shard:
            shard.write(name, pieces(data))

    def delete(self, key: bytes) -> None:
        name = key.hex()
        try:
            with self._shard(name) as shard:
                shard.unlink(name)
        except FileNotFoundError:
            pass

    def entries(self) -> Iterator[EntryInfo]:
        found = []
        try:
            root = self._root()
        except FileNotFoundError:
            return
        for shard, name in root.files(depth=1):
            if len(name) != 32 or os.path.basename(shard.path) != name[:2]:
                continue  # a temporary file, or anything else planted there
            try:
                st = shard.lstat(name)
                key = bytes.fromhex(name)
            except (OSError, ValueError):
                continue
            if stat.S_ISREG(st.st_mode):
                found.append(EntryInfo(key, st.st_size, st.st_mtime, max(st.st_atime, st.st_mtime), False))
        yield from sorted(found, key=lambda e: e.accessed)

    def clear(self) -> None:
        for info in list(self.entries()):
            self.delete(info.key)


STORES = ("files",)  # the stores DiskCache(store=...) names; None is the local one


def choose_store(path: str, store: Any) -> Store:
    """The store `DiskCache(store=...)` asks for: by name, or any object with the `Store` methods
    (checked here: a wrong one would otherwise fail every cached node, blamed on the node)."""
    if store is None:
        return LocalStore(path)
    if isinstance(store, str):
        if store not in STORES:
            raise bad("DiskCache", "store", store, "None (the local store, or the bucket a path such as "
                                f"'s3://bucket/prefix' names), one of {', '.join(map(repr, STORES))} or a Store object")
        return FileStore(path)
    missing = [m for m in _STORE_METHODS if not callable(getattr(store, m, None))]
    if missing:
        raise bad("DiskCache", "store", store, "None (the local store, or a bucket's), one of "
                            f"{', '.join(map(repr, STORES))} or an object with the methods of "
                            f"hardy.cache.store.Store (this one lacks {', '.join(missing)})", wrong_type=True)
    return cast(Store, store)


_STORE_METHODS = tuple(m for m in vars(Store) if not m.startswith("_"))
