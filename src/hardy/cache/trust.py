"""Who may write what a cache trusts: the cache directory and the secret that signs its entries.

A cache entry is unpickled once its MAC verifies, so whoever can write the secret, or read it and
write the directory, can run code in every run that uses the cache. The rules, checked before the
secret is used (see docs/caching.md, "Trust"):

- a private cache (the default): the directory must belong to the current user and be writable by
  nobody else; its key, `<dir>/secret.key`, must be a regular file (not a symbolic link) of the
  current user's that nobody else can read or write. It is created so on first use.
- a shared cache (`DiskCache(path, shared=True)`, a team's directory others can write): the
  directory's key is never read; entries are signed with the current user's own key, kept under
  `$XDG_STATE_HOME/hardy/` (`~/.local/state/hardy/`), so each user hits only their own entries
  and nobody can make another user's run unpickle anything, or with a secret the team shares
  (`secret=` / `HARDY_CACHE_KEY`): then everyone who knows it is trusted to run code in
  everyone's runs.

Anything else is refused with `UntrustedCacheError`, which says what to do. Plain `os.lstat`/
`O_NOFOLLOW` checks: no library does this (Python's own `tempfile` and ssh's `StrictModes` are the
same few lines).
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat

from blake3 import blake3

from ..errors import UntrustedCacheError
from ..hashing import DIGEST
from .folders import Folder, open_named

KEY_FILE = "secret.key"
KEY_SIZE = 32
OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
OTHERS_ANY = stat.S_IRWXG | stat.S_IRWXO
DOCS = "docs/caching.md#trust"


def mac_key(secret: bytes, purpose: str) -> bytes:
    """The MAC key of one purpose, derived from a secret (keyed BLAKE3 takes exactly 32 bytes): what
    is signed for one purpose (a cache entry, a failed item's kept inputs) never verifies as another's."""
    return blake3(secret, derive_key_context=f"hardy {purpose} MAC v3").digest()


def secret_bytes(secret: bytes | str) -> bytes:
    """A secret as given (`secret=`, HARDY_CACHE_KEY), of any length, as 32 bytes."""
    return hashlib.sha256(secret.encode() if isinstance(secret, str) else secret).digest()


def sign(key: bytes, *pieces: bytes | bytearray | memoryview) -> bytes:
    """The MAC of `pieces`, hashed where they are (keyed BLAKE3, DIGEST bytes): it is the checksum and
    the signature at once. Single-threaded (BLAKE3's threads are a fork hazard)."""
    h = blake3(key=key)
    for piece in pieces:
        h.update(piece)
    return h.digest(DIGEST)


def refuse(what: str, path: str, why: str, fix: str) -> UntrustedCacheError:
    return UntrustedCacheError(f"hardy {what} {path} {why}: whoever can write it could make your runs "
                               f"unpickle code of their choosing, so it is not used. {fix} (see {DOCS})")


def _owner(uid: int) -> str:
    try:
        import pwd
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def check_directory(path: str, shared: bool, later: bool = False) -> bool:
    """Whether `path` exists; raises if it may not be used as a cache directory by this user (a
    link of another user's is refused either way: `folders.open_named`). `later`: False in place
    of the refusal, which the first use then raises again, where it counts as a fault."""
    try:
        return _checked_directory(path, shared)
    except UntrustedCacheError:
        if later:
            return False
        raise


def _checked_directory(path: str, shared: bool) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    if os.path.islink(path):
        open_named(path, private=False).close()
    if shared:
        return True
    me = os.geteuid()
    fix = ("Use a directory of your own: DiskCache('a folder of yours'), or for a bucket cache "
           "(DiskCache('s3://...'), whose local folder defaults to ./.hardy-cache) local='a folder of yours'; "
           f"a local directory a team writes together: DiskCache({path!r}, shared=True)")
    if st.st_uid != me:
        raise refuse("cache directory", path, f"belongs to {_owner(st.st_uid)}, not to you", fix)
    check_owned("cache directory", path, st, f"Run `chmod go-w {path}` if only you write it, or use "
                f"DiskCache({path!r}, shared=True) for a local directory a team writes together (for a "
                "bucket cache's local folder, pass local='a folder of yours' instead)")
    return True


def check_owned(what: str, path: str, st: os.stat_result, fix: str) -> None:
    """Refuse (`what` names it) a file or directory that is not the current user's, or that others may write."""
    if st.st_uid != os.geteuid():
        raise refuse(what, path, f"belongs to {_owner(st.st_uid)}, not to you", fix)
    if st.st_mode & OTHERS_WRITE:
        raise refuse(what, path, f"is writable by others (mode {stat.S_IMODE(st.st_mode):o})", fix)


def make_cache_directory(path: str, shared: bool = False) -> None:
    """Create `path` (and missing parents): 0700 for a private cache, whatever the umask."""
    os.makedirs(path, mode=0o777 if shared else 0o700, exist_ok=True)


def user_key_folder() -> str:
    """Where the current user's own cache key lives: `$XDG_STATE_HOME/hardy`, else ~/.local/state/hardy."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "hardy")


def load_key(folder: str | Folder, name: str) -> bytes:
    """The key `name` in `folder` (a private one: a path is opened and checked so), created (32
    random bytes, 0600, atomically) if absent; refused if it is not a regular file of the current
    user's that nobody else can read or write. Read through the folder's descriptor, without
    following a link."""
    if isinstance(folder, str):
        with open_named(folder, private=True) as opened:
            return load_key(opened, name)
    path = os.path.join(folder.path, name)
    fix = ("Delete it if you did not make it, or pass DiskCache(..., secret=...) / set HARDY_CACHE_KEY "
           "to a secret of your own")
    try:
        fd = folder.open(name)
    except FileNotFoundError:
        return _create_key(folder, name)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise refuse("cache key", path, "is a symbolic link", fix) from None
        raise refuse("cache key", path, f"cannot be opened ({exc.strerror})", fix) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise refuse("cache key", path, "is not a regular file", fix)
        if st.st_uid != os.geteuid():
            raise refuse("cache key", path, f"belongs to {_owner(st.st_uid)}, not to you", fix)
        if st.st_mode & OTHERS_ANY:
            raise refuse("cache key", path, f"can be read or written by others (mode {stat.S_IMODE(st.st_mode):o})",
                         f"Run `chmod 600 {path}` if you made it, or delete it")
        data = os.read(fd, KEY_SIZE + 1)
    finally:
        os.close(fd)
    if len(data) != KEY_SIZE:
        raise refuse("cache key", path, f"holds {len(data)} bytes, not {KEY_SIZE}", "Delete it: a new one is made")
    return data


def _create_key(folder: Folder, name: str) -> bytes:
    """32 random bytes into `name`, 0600: written under a unique name, then linked into place
    (link() fails if another process made the key first; theirs is then read and checked)."""
    tmp = f"{name}.{os.urandom(16).hex()}"
    fd = folder.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(KEY_SIZE))
        os.link(tmp, name, src_dir_fd=folder.fd, dst_dir_fd=folder.fd, follow_symlinks=False)
    except FileExistsError:
        pass
    finally:
        try:
            folder.unlink(tmp)
        except OSError:
            pass
    return load_key(folder, name)


def state_folder(create: bool = True) -> Folder:
    """The current user's own state folder (`user_key_folder`: their cache key, kept failed inputs'
    reports), opened without following a link: it must be theirs and private."""
    path = user_key_folder()
    try:
        with open_named(os.path.dirname(path), private=False, create=create, mode=0o700) as base:
            return base.sub(os.path.basename(path), create=create, mode=0o700, private=True)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.EPERM, errno.ENOTDIR):
            raise
        raise refuse("cache key folder", path, "is a symbolic link, someone else's or writable by others",
                     "Make it yours and private (`chmod 700`), or set XDG_STATE_HOME, or pass "
                     "DiskCache(..., secret=...)") from None


def user_key() -> bytes:
    """The current user's own cache key (shared caches): its folder must be the user's, private."""
    with state_folder() as folder:
        return load_key(folder, "cache.key")
