"""A local store in front of a bucket: one cache for many machines, at local speed once warm.

`SharedStore` is what `DiskCache("s3://bucket/prefix", ...)` uses: the local store in front, read
through (a remote hit is downloaded once, then served from local disk, big arrays mapped), and
the bucket behind (`objectstore.BucketStore`), published to in the background. A map reads ahead
(`prefetch`): the next items' entries are fetched all at once, and each item's lookup is then
served from memory instead of waiting for a GET of its own. Bytes from the bucket are verified by
DiskCache's MAC exactly as local ones, before anything is unpickled. A fetched entry is written
locally only if its header names the bucket folder's key id: the local directory keeps the entries
of every secret its user works with, and one there naming another is kept for that secret, so a
forged header must never get in (it is deleted in the bucket instead: `namespaced`).
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..errors import CacheUnavailable as Unavailable
from .entry import KEY_ID
from .objectstore import BucketStore
from .store import INLINE_MAX, Buffer, Data, EntryInfo, LocalStore


class SharedStore:
    """A local store in front of a bucket: reads go local first, then to the bucket (a remote hit
    is written locally and served from there: big entries come back mapped); writes go local, then
    are published in the background. Local faults are raised as from any store (DiskCache counts
    them); the bucket's are counted by the bucket and reported through `settle()`, never raised.

    The bucket is only deleted from for an entry this thread has just fetched from it and DiskCache
    found damaged (conditionally on the ETag read): evicting or clearing the local copy never
    touches the shared one."""

    def __init__(self, local: LocalStore, bucket: BucketStore):
        self.local = local
        self.bucket = bucket
        self._fresh = threading.local()  # {key: ETag} of the entries the last read fetched
        self._ahead: dict[bytes, tuple[bytes, str]] = {}  # fetched ahead of their lookup (`prefetch`)
        self._absent: set[bytes] = set()  # looked up ahead and not in the bucket: misses, no second GET
        self._key_id = bytes.fromhex(bucket.namespace.rpartition("/")[2])

    def __getstate__(self) -> dict[str, Any]:
        return {"local": self.local, "bucket": self.bucket}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["local"], state["bucket"])  # type: ignore[misc]

    def _fetched(self) -> dict[bytes, str]:
        fresh: dict[bytes, str] | None = getattr(self._fresh, "etags", None)
        if fresh is None:
            fresh = self._fresh.etags = {}
        return fresh

    def _mine(self) -> collections.deque[tuple[bytes, ...]]:
        """This thread's read-ahead windows (each thread of a threaded map reads ahead for its chunk)."""
        windows: collections.deque[tuple[bytes, ...]] | None = getattr(self._fresh, "windows", None)
        if windows is None:
            windows = self._fresh.windows = collections.deque()
        return windows

    def _keep(self, key: bytes, data: bytes, etag: str) -> Buffer:
        """A fetched entry: written locally (unverified: DiskCache deletes it here and in the bucket
        if its MAC fails), served as the local store serves it (a big one mapped)."""
        self._fetched()[key] = etag
        if data[4:4 + KEY_ID] != self._key_id:  # forged or damaged: DiskCache deletes it in the bucket
            return data
        try:
            self.local.put(key, data)
        except OSError:  # a full local disk: serve what was fetched
            return data
        return (self.local.view(key) or data) if len(data) > INLINE_MAX else data

    def get(self, key: bytes) -> bytes | None:
        data = self.view(key)
        return None if data is None else bytes(data)

    def view(self, key: bytes) -> Buffer | None:
        self._fetched().clear()
        data = self.local.view(key)
        if data is not None:
            return data
        got = self._ahead.pop(key, None)
        if got is not None:
            return self._keep(key, *got)
        if key in self._absent:
            self._absent.discard(key)
            return None
        try:
            got = self.bucket.fetch(key)
        except Unavailable:
            return None
        return None if got is None else self._keep(key, *got)

    def get_many(self, keys: tuple[bytes, ...]) -> dict[bytes, Buffer]:
        self._fetched().clear()
        found = self.local.get_many(keys)
        missing = []
        for key in keys:
            if key in found:
                continue
            got = self._ahead.pop(key, None)
            if got is not None:
                found[key] = self._keep(key, *got)
            elif key in self._absent:
                self._absent.discard(key)
            else:
                missing.append(key)
        if missing:
            for key, (data, etag) in self.bucket.fetch_many(tuple(missing)).items():
                found[key] = self._keep(key, data, etag)
        return found

    def prefetch(self, keys: Sequence[bytes]) -> Callable[[], None] | None:
        """Read-ahead for a map: start fetching those of `keys` the local store lacks, all at once
        (`concurrency` requests in flight), and return what waits until they are in: then each
        item's lookup is served from memory (and written locally) or known absent, instead of
        waiting for a GET of its own. None when there is nothing to fetch. Bytes fetched ahead
        are verified exactly as any others, when looked up; those of the last two windows are
        kept per thread, older ones (items that never looked them up) dropped."""
        wanted = tuple(k for k in dict.fromkeys(keys) if k not in self._ahead)
        if wanted:
            here = self.local.have(wanted)
            wanted = tuple(k for k in wanted if k not in here)
        if not wanted or self.bucket.down():
            return None
        pending = self.bucket.fetch_ahead(wanted)
        windows = self._mine()

        def ready() -> None:
            try:
                found, absent = pending.result()
            except Exception:  # the loop's own failure: every lookup then asks for itself
                return
            self._ahead.update(found)
            self._absent.update(absent)
            windows.append(wanted)
            while len(windows) > 2:
                for key in windows.popleft():
                    self._ahead.pop(key, None)
                    self._absent.discard(key)
        return ready

    def namespaced(self, key: bytes) -> bool:
        """Whether `key`'s entry came from the bucket just now (its folder is one key id's); one read
        from the local directory is checked as any private directory's."""
        return key in self._fetched()

    def put(self, key: bytes, data: Data) -> None:
        self._fetched().clear()
        try:
            self.local.put(key, data)
        finally:  # a full local disk still shares the result
            self.bucket.publish(key, data)

    def delete(self, key: bytes) -> None:
        self.local.delete(key)
        etag = self._fetched().pop(key, None)
        if etag is not None:
            try:
                self.bucket.delete_if(key, etag)
            except Unavailable:
                pass

    def entries(self) -> Iterator[EntryInfo]:
        return self.local.entries()

    def clear(self) -> None:
        self.local.clear()

    def exists(self) -> bool:
        return self.local.exists()

    def sweep(self, older_than: float = 3600.0) -> int:
        return self.local.sweep(older_than)

    def settle(self) -> list[str]:
        return self.bucket.settle()

    def lease(self, key: bytes) -> contextlib.AbstractContextManager[None]:
        return self.bucket.lease(key)
