"""DiskCache: content-addressed node results that are verified before they are ever unpickled.

Each entry is signed bytes (the layout and why: `cache/entry.py`): its MAC is checked before it
is ever unpickled, so a truncated, corrupted, moved or forged entry is deleted and recomputed, and
a crafted pickle in the cache directory never runs. One whose header names another secret is
skipped (kept for its owner) only where several secrets' entries live and only their user writes
(a private directory); in a folder of one secret's own (a shared directory's, a bucket's) anyone
who can write there can write that header: it is damage (docs/security.md). The cache never fails
a node: what goes wrong is counted and said once per map (`tally.py`). What goes into a key:
docs/caching.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import pickle
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgument, UnhashableError, UntrustedCacheError
from ..hashing import FORMAT, hash_value
from ..model import arguments
from ..model.sizes import parse_size
from .entry import BUFFERS, FORMATS, HEADER, KEY_ID, MAGIC, TAG, VERSION, dumps, laid_out, private, split, unpack
from .files import FileStore, choose_store
from .flight import flight
from .flight import sweep as sweep_locks
from .folders import Folder
from .keys import MISS, PlanCache
from .store import Buffer, Data, EntryInfo, LocalStore, Store
from .tally import DAMAGED, FORGED, Tally, reason
from .trust import KEY_FILE, check_directory, load_key, mac_key, make_cache_directory, secret_bytes, sign, user_key

log = logging.getLogger("hardy.cache")

# What a store raises when its environment misbehaves: counted, and the node runs uncached. With
# them, a directory found untrusted after the constructor checked it (another user made it
# since): refused like one found there, but the cache's to report, never a node's failure.
FAULTS = (OSError, sqlite3.Error, UntrustedCacheError)


@dataclass(frozen=True)
class CacheStats:
    entries: int
    bytes: int
    inline: int
    files: int
    oldest: float | None
    newest_access: float | None


@dataclass(frozen=True)
class VerifyReport:
    checked: int
    bad: list[str]
    other_secret: int = 0  # entries written under another secret: kept, not checked


class DiskCache(PlanCache):
    """A node-result cache in a directory shared by any number of processes.

    secret: the MAC key. By default `HARDY_CACHE_KEY` (any string; for a cache shared between users
    or machines), else a random key created 0600 in the directory on first use (a shared cache:
    the current user's own key). Whoever can write the key can run code in your runs, so a
    directory or key someone else could have written is refused (`UntrustedCacheError`).
    shared: a directory others may write too (a team's): its key file is never read, entries are
    signed with `secret` / `HARDY_CACHE_KEY` if given (everyone who knows it is trusted), else with
    the current user's own key (`$XDG_STATE_HOME/hardy/cache.key`, made now if missing): each user
    hits only their own. Its entries are files in a folder of the secret's key id (`FileStore`),
    reached without following any link others plant (docs/security.md).
    single_flight: processes that miss on the same key wait for the first to compute it (never for
    a lock another user made).
    max_size: bytes (or "10GB"); least recently used entries are evicted past it.
    store: where entries live: the local SQLite + blob store by default, "files" for a directory
    on a filesystem shared between machines (one file per entry, see FileStore), or any `Store`.

    path may also be a bucket, "s3://bucket/prefix" (`pip install 'hardy[s3]'`), shared by every
    machine given the same secret: `storage_options` are s3fs's (endpoint_url, key, secret...),
    `local` the directory read through in front of it (default ".hardy-cache"). A secret is then
    required (secret= or HARDY_CACHE_KEY): a per-directory one would share nothing. With
    single_flight, machines also wait for each other (a lease object per key). See
    docs/caching.md, "Shared caches".
    """

    def __init__(self, path: str | os.PathLike[str] = ".hardy-cache", *, secret: bytes | str | None = None,
                 single_flight: bool = False, max_size: int | str | None = None, store: Store | str | None = None,
                 shared: bool = False, storage_options: dict[str, Any] | None = None,
                 local: str | os.PathLike[str] | None = None):
        url = os.fspath(arguments.path("DiskCache", "path", path))
        if secret is not None and not isinstance(secret, (bytes, str)) or secret == "" or secret == b"":
            raise arguments.bad("DiskCache", "secret", secret, "a non-empty string or bytes, or None (a key kept "
                                "in the directory)", wrong_type=not isinstance(secret, (bytes, str)))
        remote = "://" in url and store is None
        if remote:
            secret = secret if secret is not None else os.environ.get("HARDY_CACHE_KEY") or None
            if secret is None:
                raise InvalidArgument(f"DiskCache({url!r}) is shared by every machine that uses the bucket: "
                                      "give them one secret, DiskCache(..., secret=...) or HARDY_CACHE_KEY "
                                      "(docs/caching.md)")
            path = arguments.path("DiskCache", "local", local, optional=True) or ".hardy-cache"
        self.path = os.path.abspath(os.fspath(path))
        self.shared = arguments.flag("DiskCache", "shared", shared)
        # refused here if it exists and is not ours; in a worker's copy at its first use (`__setstate__`)
        self._trusted = check_directory(self.path, shared, later=getattr(self, "_refusal_later", False))
        self._explicit_secret = secret
        self._secret = secret_bytes(secret) if secret is not None else None
        if self._secret is None and not os.environ.get("HARDY_CACHE_KEY"):
            self._existing_key()
        self._mac_key: bytes | None = None
        self._key_id: bytes | None = None
        self.store: Store = self._shared_store(store) if self.shared else choose_store(self.path, store)
        self.single_flight = arguments.flag("DiskCache", "single_flight", single_flight)
        self.max_size = arguments.size("DiskCache", "max_size", max_size)
        self._puts = 0
        self.hits = self.misses = self.rejected = self.skipped = 0
        self._theirs: set[bytes] = set()  # keys whose entries another secret wrote: not overwritten
        self._tally = Tally(self.path)  # what went wrong since the last report
        self._reported = 0  # skipped at the last report
        if remote:
            from .objectstore import BucketStore
            from .shared import SharedStore
            bucket = BucketStore(url, self.namespace, storage_options)
            bucket.lease_key = mac_key(self.secret, "single-flight lease")
            self.store = SharedStore(LocalStore(self.path), bucket)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "store": self.store, "secret": self._explicit_secret,
                "single_flight": self.single_flight, "max_size": self.max_size, "shared": self.shared}

    def __setstate__(self, s: dict[str, Any]) -> None:
        """Unpickling (a worker's copy) runs the constructor again, where the directory is checked
        again; one another user made or replaced since the caller's constructor looked is not
        refused there, which would fail the whole map as it loads: it is refused at each use, a
        fault counted as any other (the nodes run uncached, with the cache's one warning)."""
        self._refusal_later = True
        self.__init__(  # type: ignore[misc]
            s["path"], secret=s["secret"], single_flight=s["single_flight"], max_size=s["max_size"], store=s["store"],
            shared=s["shared"])

    def __repr__(self) -> str:
        return f"DiskCache({self.path!r})"

    @property
    def namespace(self) -> str:
        """`<key format>/<key id>`: the folder of this secret's entries in a shared directory or a bucket."""
        return f"{FORMAT.decode()}/{self.key_id.hex()}"

    def _shared_store(self, store: Store | str | None) -> Store:
        """A shared directory's store: one file per entry in the folder of this secret's key id
        (`files.py`), never SQLite (whose files follow links others plant: `store.py`)."""
        if store is None or store == "files":
            own = self._explicit_secret is None and not os.environ.get("HARDY_CACHE_KEY")
            return FileStore(self.path, self.namespace, shared=True, own=own)
        if isinstance(store, LocalStore):
            raise InvalidArgument(f"DiskCache({self.path!r}, shared=True) cannot keep a SQLite index in a directory "
                                  "others write (SQLite follows the links they could plant there): leave store= out "
                                  "(one file per entry) or give a directory of your own")
        return choose_store(self.path, store)

    @property
    def secret(self) -> bytes:
        if self._secret is None:
            env = os.environ.get("HARDY_CACHE_KEY")
            if env:
                self._secret = secret_bytes(env)
            elif self.shared:
                self._secret = user_key()
            else:
                self._trust(create=True)
                self._secret = load_key(self.path, KEY_FILE)
        return self._secret

    def _existing_key(self) -> None:
        """Read (and so check) a key that exists already: refused here, in the constructor, not
        inside a node's call. A missing one is made on the first write (a shared directory's: now,
        `_shared_store`, since its entries' folder is named by it)."""
        if not self.shared and self._trusted and os.path.lexists(os.path.join(self.path, KEY_FILE)):
            self._secret = load_key(self.path, KEY_FILE)

    def _trust(self, create: bool = False) -> None:
        """Check the directory (once it exists) before the first entry is read or written in this
        process; `create`: make it first, private (0700) unless shared, then check it — a directory
        someone else made in between is refused like one that was there."""
        if self._trusted:
            return
        if create:
            make_cache_directory(self.path, self.shared)
        self._trusted = check_directory(self.path, self.shared)

    @property
    def key_id(self) -> bytes:
        """Names the secret in each entry's header without revealing it."""
        if self._key_id is None:
            self._key_id = hashlib.blake2b(b"hardy-key-id", key=self.secret, digest_size=KEY_ID).digest()
        return self._key_id

    # --- faults: counted, summed up once, never raised into a node ----------------------------------

    def report(self) -> None:
        """One warning for everything that went wrong since the last report (a map's worth): entries
        that could not be read or written and why, entries deleted and why, entries of another
        secret skipped. Compiled plans' callers (a map, a worker's batch) call this at their end."""
        self._moved()
        skipped = self.skipped - self._reported
        settle = getattr(self.store, "settle", None)  # a shared store: its publications, what it could not do
        shared: list[str] = settle() if settle is not None else []
        if not (self._tally or skipped or shared):
            return
        parts = self._tally.parts(shared)
        if skipped:
            parts.append(f"{skipped} entr{'y' if skipped == 1 else 'ies'} written under another secret skipped "
                         "(kept; set the same HARDY_CACHE_KEY for everybody sharing this directory to share them)")
        log.warning("cache %s: %s", self.path, "; ".join(parts))
        self._reported = self.skipped

    # --- entries -----------------------------------------------------------------------------------

    def _mac(self, key: bytes, payload: Buffer) -> bytes:
        """A format 3 entry's MAC: the warm path's, one call per hit on a small value."""
        return sign(self._mac_key or self._derive_mac_key(), FORMAT, key, payload)

    def _mac_pieces(self, key: bytes, body: Sequence[Buffer]) -> bytes:
        """A format 4 entry's MAC: TAG first, then its body's pieces, hashed where they are: 11 ms
        for 80 MB (5.7 ms with BLAKE3's 2 threads on 2 cores, a fork hazard `sign` avoids)."""
        return sign(self._mac_key or self._derive_mac_key(), FORMAT, key, TAG, *body)

    def _derive_mac_key(self) -> bytes:
        """Derived from the secret, once."""
        self._mac_key = mac_key(self.secret, "cache entry")
        return self._mac_key

    def get(self, key: bytes, default: Any = None) -> Any:
        """The value stored under `key` if it verifies, else `default` (a bad entry is deleted)."""
        try:
            if not self._trusted:
                self._trust()
            entry = self.store.view(key)
            value = MISS if entry is None else self._load(key, entry)
        except FAULTS as exc:
            self._tally.fault("read", exc)
            value = MISS
        if value is MISS:
            self.misses += 1
            return default
        return value

    def _load(self, key: bytes, entry: Buffer) -> Any:
        """Verify, then unpickle. What fails is deleted (MISS); an entry another secret wrote in a
        place several secrets share, or a newer hardy's that verifies, is skipped (MISS); each is
        counted for `report()`."""
        why, reason = DAMAGED, None
        if len(entry) < HEADER or entry[:3] != MAGIC:
            reason = "not a hardy entry or truncated header"
        elif entry[4:4 + KEY_ID] != (self._key_id or self.key_id):
            if not self._namespaced(key):
                self.skipped += 1  # another secret's, where several live (a private directory): theirs to keep
                self._theirs.add(key)
                return MISS
            why = reason = FORGED
        elif entry[3] not in FORMATS:
            if self._newer(key, memoryview(entry)):
                return MISS  # a newer hardy's entry, signed with this secret: kept for it
            reason = "an unknown format whose MAC fails"
        else:
            value, reason = self._verified(key, entry)
            if reason is None:
                self.hits += 1
                return value
        self.rejected += 1
        log.debug("cache entry %s rejected (%s); deleted, recomputing", key.hex(), reason)
        try:
            self.store.delete(key)
            self._tally.deleted[why] += 1  # (one still there, undeletable, is a fault: never said deleted)
        except FAULTS as exc:
            self._tally.fault("deleted", exc)
        return MISS

    def _verified(self, key: bytes, entry: Buffer) -> tuple[Any, str | None]:
        """(the value, None) if the MAC verifies and the entry unpickles, else (None, why not)."""
        whole = memoryview(entry)
        if entry[3] == VERSION:
            body = private(whole[HEADER:])
            mac = self._mac(key, body)
        else:
            body, buffers = split(whole)
            mac = self._mac_pieces(key, (body, buffers))
        if not hmac.compare_digest(entry[4 + KEY_ID:HEADER], mac):
            return None, "MAC mismatch: truncated, corrupted or moved"
        try:
            return (pickle.loads(body) if entry[3] == VERSION else unpack(whole, body)), None
        except Exception as exc:  # verified but unloadable: a class that changed since
            return None, f"verified but could not be unpickled ({type(exc).__name__}: {exc})"

    def _newer(self, key: bytes, whole: memoryview) -> bool:
        """Whether an entry of a format this hardy does not know was signed with this secret: every
        format from 4 on is signed as FORMAT | key | its version byte | the rest, so a newer
        hardy's entry is told from bytes someone rewrote without the secret."""
        return whole[3] > BUFFERS and hmac.compare_digest(
            whole[4 + KEY_ID:HEADER], sign(self._mac_key or self._derive_mac_key(), FORMAT, key, whole[3:4],
                                           whole[HEADER:]))

    def _namespaced(self, key: bytes) -> bool:
        """Whether `key`'s entry was read from a place of this secret's own (a shared directory's
        or a bucket's folder of this key id), where a header naming another secret is forged."""
        namespaced = getattr(self.store, "namespaced", None)
        return bool(namespaced(key)) if namespaced is not None else False

    def put(self, key: bytes, value: Any) -> bool:
        """Store `value`; False if it cannot be pickled or stored — the run goes on uncached —
        or if the entry under `key` is another secret's, which is left to its owner."""
        if key in self._theirs:
            return False
        big: list[memoryview] = []
        try:
            payload = dumps(value, big)
        except Exception as exc:
            log.warning("result for cache key %s not cached: cannot pickle %s (%s)", key.hex(),
                        type(value).__name__, exc)
            return False
        try:
            self._moved()
            if not self._trusted:
                self._trust(create=True)
            self.store.put(key, self._entry(key, payload, big))
        except FAULTS as exc:
            self._tally.fault("written", exc)
            return False
        self._puts += 1
        if self.max_size is not None and self._puts % 256 == 0:
            self.prune(max_size=self.max_size)
        return True

    def _entry(self, key: bytes, payload: bytes, big: list[memoryview]) -> Data:
        """The entry for a pickle and its out-of-band buffers: format 3's bytes without buffers,
        else format 4's pieces, the buffers as they are (the store writes them one after another)."""
        if not big:
            return MAGIC + bytes([VERSION]) + self.key_id + self._mac(key, payload) + payload
        body = laid_out(payload, big)
        return [MAGIC + bytes([BUFFERS]) + self.key_id + self._mac_pieces(key, body), *body]

    def _moved(self) -> None:
        """The store's directory deleted or replaced while in use (`LocalStore.moved`) is checked as a
        new one, and made again (with a new key: its own went) at the next write, said once."""
        if getattr(self.store, "moved", bool)():
            if not os.path.isdir(self.path):
                log.warning("cache %s was deleted while in use: it is made again, empty, at the next write", self.path)
            self._trusted = False
            if self._explicit_secret is None and not os.environ.get("HARDY_CACHE_KEY"):
                self._secret = self._mac_key = self._key_id = None  # the key file's: read (or made) again

    def _locks(self, create: bool = True) -> Folder:
        """Single flight's folder: `<dir>/locks`, or in a shared directory `locks/<key format>/<key id>`
        (the user's alone with their own key, the team's with a shared secret)."""
        if isinstance(self.store, FileStore) and self.store.shared:
            return self.store.folder(["locks", *self.namespace.split("/")], create=create)
        if not self._trusted:
            self._trust(create=create)
        return LocalStore(self.path).locks(create=create)

    # --- what compiled plans call (see PlanSource._cache_prelude) ----------------------------------------

    hash_value = staticmethod(hash_value)  # how values are keyed (hardy.compat.hypernodes's leaves private state out)

    @classmethod
    def input_key(cls, value: Any, name: str) -> bytes:
        """The key of an input value: its content hash."""
        try:
            return cls.hash_value(value)
        except UnhashableError as exc:
            kind = type(value)
            raise UnhashableError(f"input {name!r} (a {kind.__module__}.{kind.__qualname__}): "
                                  f"{exc.describe(name)}", exc.culprit, exc.path) from None

    def lookup(self, key: bytes) -> Any:
        return self.get(key, MISS)

    @property
    def reads_ahead(self) -> bool:
        """Whether a map should hand its next items' keys to `prefetch` (a shared store's cache)."""
        return hasattr(self.store, "prefetch")

    def prefetch(self, keys: Sequence[bytes]) -> Callable[[], None] | None:
        """Read-ahead for a map over a shared store: start fetching the entries of the next items'
        keys and return what waits for them (None: nothing to wait for; a local store has
        nothing to fetch). Nothing is verified or served here: lookups do that as always."""
        ahead = getattr(self.store, "prefetch", None)
        if ahead is None:
            return None
        try:
            return ahead(keys)  # type: ignore[no-any-return]
        except FAULTS as exc:
            self._tally.fault("read", exc)
            return None

    def fetch(self, keys: tuple[bytes, ...]) -> dict[bytes, Any]:
        """The verified values of those keys the cache has, in one store round trip."""
        found = {}
        try:
            if not self._trusted:
                self._trust()
            for key, entry in self.store.get_many(keys).items():
                value = self._load(key, entry)
                if value is not MISS:
                    found[key] = value
        except FAULTS as exc:
            self._tally.fault("read", exc, len(keys) - len(found))
        self.misses += len(keys) - len(found)
        return found

    def fill(self, key: bytes, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Compute a missing value and store it (waiting for another process first with single flight)."""
        if not self.single_flight:
            value = func(*args, **kwargs)
            self.put(key, value)
            return value
        lease = getattr(self.store, "lease", None)  # a shared store's: machines wait for each other too
        try:
            locks = self._locks()
        except FAULTS as exc:  # a directory where locks cannot be made (or not trusted) computes without one
            self._tally.notes[f"computed without single flight ({reason(exc)})"] += 1
            locks = None
        with flight(locks, key, self._tally.notes) if locks is not None else contextlib.nullcontext(), \
                (lease(key) if lease is not None else contextlib.nullcontext()):
            value = self.get(key, MISS)
            if value is MISS:
                value = func(*args, **kwargs)
                self.put(key, value)
        return value

    async def afill(self, key: bytes, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        value = await func(*args, **kwargs)
        self.put(key, value)
        return value

    # --- maintenance -------------------------------------------------------------------------------

    def entries(self) -> list[EntryInfo]:
        return list(self.store.entries())

    def stats(self) -> CacheStats:
        es = self.entries()
        return CacheStats(entries=len(es), bytes=sum(e.size for e in es), inline=sum(e.inline for e in es),
                          files=sum(not e.inline for e in es), oldest=min((e.created for e in es), default=None),
                          newest_access=max((e.accessed for e in es), default=None))

    def verify(self) -> VerifyReport:
        """Check every entry's MAC (and that it unpickles); bad ones are deleted, those written
        under another secret counted and kept."""
        bad, es, skipped = [], self.entries(), self.skipped
        with contextlib.suppress(*FAULTS):
            getattr(self.store, "sweep", self._sweep_locks)()  # files of no entry: killed writers' temporary files
        for e in es:
            before = self.skipped
            if self.get(e.key, MISS) is MISS and self.skipped == before:
                bad.append(e.key.hex())
        return VerifyReport(checked=len(es) - (self.skipped - skipped), bad=bad, other_secret=self.skipped - skipped)

    def prune(self, max_size: int | str | None = None, older_than: float | None = None) -> int:
        """Delete entries not used for `older_than` seconds, then least recently used ones until the
        cache holds at most `max_size` bytes (those with files first: on a full disk, removing them
        makes the room the index's write needs); then unreferenced files and stale locks. Returns how
        many entries were deleted. A fault stops it there, counted for `report()`, never raised:
        pruning also runs inside `put`."""
        try:
            limit = parse_size(max_size)
        except (ValueError, OverflowError):
            raise arguments.bad("DiskCache.prune", "max_size", max_size,
                                "a number of bytes, or a size such as '10GB' or '512M'") from None
        deleted, older_than = 0, arguments.seconds("DiskCache.prune", "older_than", older_than, True, zero=True)
        try:
            es = self.entries()  # least recently used first
            now, total, victims = time.time(), sum(e.size for e in es), []
            for e in es:
                if (older_than is not None and now - e.accessed > older_than) or (limit is not None and total > limit):
                    victims.append(e)
                    total -= e.size
            for e in sorted(victims, key=lambda e: e.inline):  # files first: on a full disk they make room
                self.store.delete(e.key)
                deleted += 1
            getattr(self.store, "sweep", self._sweep_locks)()  # LocalStore's, and a shared store's local one
        except FAULTS as exc:
            self._tally.fault("pruned", exc)
        return deleted

    def clear(self) -> None:
        self.store.clear()
        self._sweep_locks()

    def _sweep_locks(self) -> None:
        """Lock files no process holds, removed: at best (a `locks` another user made a file, or
        took away, leaves the entries cleared or pruned all the same)."""
        with contextlib.suppress(*FAULTS), self._locks(create=False) as locks:
            sweep_locks(locks)
