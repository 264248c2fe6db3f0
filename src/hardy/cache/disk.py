"""DiskCache: content-addressed node results that are verified before they are ever unpickled.

Entry layout (bytes, whatever the store):  b"HRD" | format version (1 byte) | MAC (16 bytes) | pickle
MAC = keyed BLAKE3(secret, FORMAT | entry key | pickle). It is the checksum and the signature at
once: a truncated, zeroed or flipped entry, an entry copied under another key, or one written by
anybody without the secret fails verification and is deleted, logged and recomputed. Nothing that
fails is unpickled, so a crafted pickle in the cache directory never runs.

See docs/caching.md for exactly what goes into a key.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import logging
import os
import pickle
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from blake3 import blake3

from ..hashing import DIGEST, FORMAT, UnhashableError, code_fingerprint, digest, hash_value
from ..node import Node
from ..plan import MISS
from ..sizes import parse_size
from .store import EntryInfo, FileStore, LocalStore, Store

log = logging.getLogger("hardy.cache")

MAGIC = b"HRD"
VERSION = 2  # 2: keyed BLAKE3 MACs
HEADER = len(MAGIC) + 1 + DIGEST


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


class DiskCache:
    """A node-result cache in a directory shared by any number of processes.

    secret: the MAC key. By default `HARDY_CACHE_KEY` (any string; for a cache shared between users
    or machines), else a random key created 0600 in the directory on first use.
    single_flight: processes that miss on the same key wait for the first to compute it.
    max_size: bytes (or "10GB"); least recently used entries are evicted past it.
    store: where entries live: the local SQLite + blob store by default, "files" for a directory
    on a filesystem shared between machines (one file per entry, see FileStore), or any `Store`.
    """

    def __init__(self, path: str | os.PathLike[str] = ".hardy-cache", *, secret: bytes | str | None = None,
                 single_flight: bool = False, max_size: int | str | None = None, store: Store | str | None = None):
        self.path = os.path.abspath(os.fspath(path))
        if store is None:
            store = LocalStore(self.path)
        elif store == "files":
            store = FileStore(self.path)
        self.store: Store = store  # type: ignore[assignment]
        self._explicit_secret = secret
        self._secret = _secret_bytes(secret) if secret is not None else None
        self._mac_key: bytes | None = None
        self.single_flight = single_flight
        self.max_size = parse_size(max_size)
        self._puts = 0
        self.hits = self.misses = self.rejected = 0

    def __getstate__(self) -> dict:
        return {"path": self.path, "store": self.store, "secret": self._explicit_secret,
                "single_flight": self.single_flight, "max_size": self.max_size}

    def __setstate__(self, s: dict) -> None:
        self.__init__(s["path"], secret=s["secret"], single_flight=s["single_flight"], max_size=s["max_size"],
                      store=s["store"])

    def __repr__(self) -> str:
        return f"DiskCache({self.path!r})"

    @property
    def secret(self) -> bytes:
        if self._secret is None:
            env = os.environ.get("HARDY_CACHE_KEY")
            self._secret = _secret_bytes(env) if env else _secret_file(self.path)
        return self._secret

    # --- entries -----------------------------------------------------------------------------------

    def _mac(self, key: bytes, payload: bytes | memoryview) -> bytes:
        if self._mac_key is None:  # keyed BLAKE3 takes exactly 32 bytes: derived from the secret
            self._mac_key = blake3(self.secret, derive_key_context="hardy cache entry MAC v2").digest()
        h = blake3(FORMAT, key=self._mac_key)
        h.update(key)
        h.update(payload)
        return h.digest(DIGEST)

    def get(self, key: bytes, default: Any = None) -> Any:
        """The value stored under `key` if it verifies, else `default` (a bad entry is deleted)."""
        entry = self.store.get(key)
        if entry is None:
            self.misses += 1
            return default
        value = self._load(key, entry)
        return default if value is MISS else value

    def _load(self, key: bytes, entry: bytes) -> Any:
        """Verify, then unpickle; a bad entry is deleted and logged, and MISS returned."""
        reason = None
        if len(entry) < HEADER or entry[:3] != MAGIC:
            reason = "not a hardy entry or truncated header"
        elif entry[3] != VERSION:
            reason = f"format version {entry[3]}, expected {VERSION}"
        else:
            payload = memoryview(entry)[HEADER:]
            if not hmac.compare_digest(entry[4:HEADER], self._mac(key, payload)):
                reason = "MAC mismatch: truncated, corrupted, moved or written without this cache's key"
            else:
                try:
                    value = pickle.loads(payload)
                    self.hits += 1
                    return value
                except Exception as exc:  # verified but unloadable: a class that changed since
                    reason = f"verified but could not be unpickled ({type(exc).__name__}: {exc})"
        self.rejected += 1
        log.warning("cache entry %s rejected (%s); deleted, recomputing", key.hex(), reason)
        self.store.delete(key)
        return MISS

    def put(self, key: bytes, value: Any) -> bool:
        """Store `value`; False (and a log line) if it cannot be pickled — the run goes on uncached."""
        try:
            payload = pickle.dumps(value, protocol=5)
        except Exception:
            try:
                import cloudpickle
                payload = cloudpickle.dumps(value, protocol=5)
            except Exception as exc:
                log.warning("result for cache key %s not cached: cannot pickle %s (%s)", key.hex(),
                            type(value).__name__, exc)
                return False
        self.store.put(key, MAGIC + bytes([VERSION]) + self._mac(key, payload) + payload)
        self._puts += 1
        if self.max_size is not None and self._puts % 256 == 0:
            self.prune(max_size=self.max_size)
        return True

    @contextlib.contextmanager
    def _flight(self, key: bytes) -> Iterator[None]:
        """An exclusive flock per key: released by the kernel even if its holder is killed."""
        folder = os.path.join(self.path, "locks")
        os.makedirs(folder, exist_ok=True)
        fd = os.open(os.path.join(folder, key.hex()), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    # --- what compiled plans call (see Plan._cache_prelude) ----------------------------------------

    @staticmethod
    def input_key(value: Any, name: str) -> bytes:
        """The key of an input value: its content hash."""
        try:
            return hash_value(value)
        except UnhashableError as exc:
            raise UnhashableError(f"input {name!r}: {exc}") from None

    def lookup(self, key: bytes) -> Any:
        return self.get(key, MISS)

    def fetch(self, keys: tuple[bytes, ...]) -> dict[bytes, Any]:
        """The verified values of those keys the cache has, in one store round trip."""
        found = {}
        for key, entry in self.store.get_many(keys).items():
            value = self._load(key, entry)
            if value is not MISS:
                found[key] = value
        self.misses += len(keys) - len(found)
        return found

    def fill(self, key: bytes, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Compute a missing value and store it (waiting for another process first with single flight)."""
        if not self.single_flight:
            value = func(*args, **kwargs)
            self.put(key, value)
            return value
        with self._flight(key):
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
        """Check every entry's MAC (and that it unpickles); bad ones are deleted."""
        bad = []
        es = self.entries()
        for e in es:
            if self.get(e.key, MISS) is MISS:
                bad.append(e.key.hex())
        return VerifyReport(checked=len(es), bad=bad)

    def prune(self, max_size: int | str | None = None, older_than: float | None = None) -> int:
        """Delete entries not used for `older_than` seconds, then least recently used ones until the
        cache holds at most `max_size` bytes. Returns how many entries were deleted."""
        limit = parse_size(max_size)
        es = self.entries()  # least recently used first
        now, deleted, total = time.time(), 0, sum(e.size for e in es)
        for e in es:
            if (older_than is not None and now - e.accessed > older_than) or (limit is not None and total > limit):
                self.store.delete(e.key)
                total -= e.size
                deleted += 1
        if isinstance(self.store, LocalStore):
            self.store.sweep()
        return deleted

    def clear(self) -> None:
        self.store.clear()


# The key formulas (docs/caching.md). Compiled plans and the Daft engine both call these.

def call_fingerprint(node: Node, given: Sequence[str]) -> bytes:
    """A node's fingerprint with the names of the arguments it is given (defaults not given)."""
    return digest(FORMAT, node_fingerprint(node), ",".join(given).encode())


def call_key(fingerprint: bytes, *arg_keys: bytes) -> bytes:
    """The key of one call: its fingerprint and its arguments' keys (16 bytes each)."""
    return blake3(fingerprint + b"".join(arg_keys)).digest(DIGEST)


def output_key(key: bytes, output: str, n_outputs: int) -> bytes:
    """The key of one output of a call: the call's key itself, or derived for several outputs."""
    return key if n_outputs == 1 else blake3(key + output.encode()).digest(DIGEST)


def node_fingerprint(node: Node) -> bytes:
    """The node's identity for caching: its code (transitively), outputs and a format version."""
    from ..pipeline import PipelineNode
    if isinstance(node, PipelineNode):
        inner = sorted(node_fingerprint(n) for n in node.pipeline.graph.nodes)
        return digest(FORMAT, b"pipeline", *inner, repr((node.inputs, node.outputs, node.map_over,
                                                          node.map_mode)).encode(),
                      hash_value(node.pipeline.bound_inputs))
    return digest(FORMAT, b"node", code_fingerprint(node.func), repr(node.outputs).encode())


def _secret_bytes(secret: bytes | str) -> bytes:
    return hashlib.sha256(secret.encode() if isinstance(secret, str) else secret).digest()


def _secret_file(folder: str) -> bytes:
    """The directory's own key: created once, 0600, atomically (link() fails if it already exists)."""
    path = os.path.join(folder, "secret.key")
    try:
        with open(path, "rb") as f:
            data = f.read()
        if len(data) == 32:
            return data
    except FileNotFoundError:
        pass
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex}"
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(32))
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    with open(path, "rb") as f:
        return f.read()
