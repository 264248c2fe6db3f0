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
else can even delete those entries. The other folders (`entries/`, the key format's, a team
secret's, its shards, `locks/`) are the team's: made with the directory's own group permissions,
whatever the umask (022 made them 0755 in a 2775 team folder: no teammate could ever write there);
a setgid team folder passes its group on. Others' permissions stay the umask's: in a folder anyone
may write, a 0755 `entries/<key format>/` keeps them from renaming your own key's folder. A folder
that refuses the user anyway (another's, made by an older hardy or by hand) is named in the cache's
warning with its owner and the fix (`_Refused`).

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
from .folders import OTHERS_WRITE, Folder, copy_fd, open_named, unreadable
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
        self._team = 0  # the directory's group permission bits, which its team folders get
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
        try:
            here = open_named(self.path, private=not self.shared, create=create, mode=team)
            if self.shared:
                self._team = stat.S_IMODE(os.fstat(here.fd).st_mode) & stat.S_IRWXG
            for k, name in enumerate(levels):
                mine = self._private(k)
                deeper = here.sub(name, create=create, mode=0o700 if mine else team, private=mine)
                here.close()
                here = self._widened(deeper, create and not mine)
        except PermissionError as exc:
            raise self._refused(exc, levels, create) from None
        return here

    def _widened(self, folder: Folder, create: bool) -> Folder:
        """A team folder of the user's own, as writable by its group as the directory is, whatever
        the umask made it (with 022, 0755: the first member's folders refused every teammate)."""
        if create and self._team:
            st = os.fstat(folder.fd)
            if st.st_uid == os.geteuid() and self._team & ~st.st_mode:
                os.fchmod(folder.fd, stat.S_IMODE(st.st_mode) | self._team)
        return folder

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
        shard = self._root(create).sub(name[:2], create=create, mode=0o700 if mine else 0o777, private=mine)
        return self._widened(shard, create and not mine)

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
        except PermissionError as exc:
            raise self._refused(exc, [*self.levels, name[:2]], False, name) from None
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
        try:
            with self._shard(name, create=True) as shard:
                shard.write(name, pieces(data))
        except PermissionError as exc:
            raise self._refused(exc, [*self.levels, name[:2]], True, name) from None

    def delete(self, key: bytes) -> None:
        name = key.hex()
        try:
            with self._shard(name) as shard:
                shard.unlink(name)
        except FileNotFoundError:
            pass
        except PermissionError as exc:
            raise self._refused(exc, [*self.levels, name[:2]], True, name) from None

    def _refused(self, exc: PermissionError, levels: list[str], writing: bool, name: str = "") -> PermissionError:
        """`exc`, with which folder on the way to `levels` (and the file `name` in the last) refused
        the user, whose it is and what to do: a bare "permission denied" left a teammate no fix."""
        if isinstance(exc, _Refused):
            return exc
        try:
            chain, entry = self._walk(levels, name)
        except OSError:
            return exc
        why = refusal(chain, entry, writing)
        return _Refused(exc, why) if why else exc

    def _walk(self, levels: list[str], name: str) -> tuple[list[Seen], os.stat_result | None]:
        """The folders from the directory down `levels` as far as they exist and open (path, status,
        whether it must be the user's alone), and the status of the file `name` in the last."""
        here = open_named(self.path, private=False)
        try:
            chain = [(here.path, os.fstat(here.fd), not self.shared)]
            for k, level in enumerate(levels):
                try:
                    deeper = here.sub(level, private=False)
                except PermissionError:  # not the user's to open: the one that refused
                    chain.append((os.path.join(here.path, level), here.lstat(level), self._private(k)))
                    return chain, None
                except FileNotFoundError:
                    return chain, None
                here.close()
                here = deeper
                chain.append((here.path, os.fstat(here.fd), self._private(k)))
            try:
                return chain, here.lstat(name) if name else None
            except FileNotFoundError:
                return chain, None
        finally:
            here.close()

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


Seen = tuple[str, os.stat_result, bool]  # a folder on the way to an entry: path, status, the user's alone


class _Refused(PermissionError):
    """Permission denied, with `refusal`: which folder refused, whose it is and the fix, which the
    cache's warning says (`tally.reason`)."""

    def __init__(self, exc: PermissionError, refusal: str):
        super().__init__(exc.errno, exc.strerror, exc.filename)
        self.refusal = refusal


def refusal(chain: list[Seen], entry: os.stat_result | None, writing: bool) -> str | None:
    """Why the folders `chain` (from the cache directory down) refuse the user reading (or, `writing`,
    writing or deleting) the entry `entry` is the status of, in words that name the folder, whose it
    is and the fix; None if their permissions do not explain it (an ACL, a root-owned mount)."""
    me = os.geteuid()
    for i, (path, st, alone) in enumerate(chain):
        if alone and (st.st_uid != me or st.st_mode & OTHERS_WRITE):
            return (f"{path} must be yours alone (it holds your own key's entries, and its name is public) but is "
                    f"{whose(st)}: someone else made it first; they or root can remove it, or use another directory")
        need = 0o7 if writing and i == len(chain) - 1 else 0o5  # rwx where an entry is made, else r-x
        if not may(st, need):
            return unwritable(chain, i, need)
    path, st, _ = chain[-1]
    if writing and entry is not None and st.st_mode & stat.S_ISVTX and me not in (entry.st_uid, st.st_uid):
        return (f"{path} is a sticky folder, {whose(st)}, holding an entry of {user(entry.st_uid)}'s, which only "
                "they can replace or delete; they or root can remove the folder, or use another directory")
    if not writing and entry is not None and not may(entry, 0o4):
        return f"its entry in {path} is {whose(entry)} and unreadable to you; they or root can remove it"
    return None


def unwritable(chain: list[Seen], i: int, need: int) -> str:
    """`chain[i]` refuses the user; named as the topmost folder above it of the same owner that
    refuses too, where `chmod -R` fixes all of them (a teammate's tree made 0755 by the umask)."""
    while i > 0 and chain[i - 1][1].st_uid == chain[i][1].st_uid and not may(chain[i - 1][1], need):
        i -= 1
    path, st, _ = chain[i]
    if st.st_uid == os.geteuid():
        fix = f"run `chmod -R u+rwX {path}`"
    elif st.st_gid in {os.getegid(), *os.getgroups()}:
        fix = f"its owner or root can run `chmod -R g+rwX {path}`"
    else:
        fix = f"its owner or root can give it a group of yours: `chgrp -R TEAM {path} && chmod -R g+rwX {path}`"
    return (f"{path} is {whose(st)} and not {'writable' if need & 2 else 'readable'} by you: {fix} (a team's "
            "folder: docs/caching.md#trust), or use another directory")


def whose(st: os.stat_result) -> str:
    """`alice's (uid 1001, group team, mode 755)`: whose a file or folder is, as a fix needs it."""
    import grp
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    name = user(st.st_uid)
    uid = "" if name.startswith("uid ") else f"uid {st.st_uid}, "
    return f"{name}'s ({uid}group {group}, mode {stat.S_IMODE(st.st_mode):o})"


def user(uid: int) -> str:
    """A user's name, else `uid N` (a uid with no account)."""
    import pwd
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def may(st: os.stat_result, need: int) -> bool:
    """Whether the current user has the permissions `need` (as `0o7`: rwx) on what `st` is the status of."""
    me = os.geteuid()
    if me == 0:
        return True
    shift = 6 if st.st_uid == me else 3 if st.st_gid in {os.getegid(), *os.getgroups()} else 0
    return (st.st_mode >> shift) & need == need


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
