"""Cache entries in an object store (the S3 API, through fsspec's s3fs): one cache for many machines.

    <prefix>/<key format>/<key id>/<k[:2]>/<key>    one object per entry, bytes as DiskCache made them
    <prefix>/leases/<key format>/<key id>/<key>     single flight's leases (only with single_flight)

The key format (`hardy-key-3`) and the key id (which secret signed the entry) are in the path, so
entries of other formats or secrets are never fetched; two hex digits shard the keys for listing in
parallel. No index object, nothing listed on the hot path: a lookup is one GET, a publication one PUT.

Why these mechanisms:
- Publication is a create-only write (`If-None-Match: *`): a second writer of the same entry gets
  412, which is success (any verified entry of a key is right), and a 409 (two conditional writes
  in flight) is retried with jitter. An object is never overwritten: no reader sees two bodies mixed.
- Nothing the bucket says is trusted: DiskCache verifies each entry's MAC before unpickling (a
  bucket has many writers; an ETag is a checksum anyone can compute). A damaged entry is deleted
  with `If-Match` on the ETag read: a good one published since by someone else is never deleted.
- The remote side never fails a node: an unreachable, slow (timeouts below), throttling (503
  SlowDown, retried with backoff by botocore and s3fs) or misconfigured store makes lookups miss
  and publications wait for another run; the local store in front goes on working, and `settle()`
  tells DiskCache's one warning per map what happened. A store that says it is unusable is left
  alone for `DOWN_FOR` seconds: a map over a dead server does not pay a timeout per item.
- Nothing in the bucket can stop a reader: an object under `<key id>/` whose header names another
  secret is forged (or damaged), deleted and republished like any other (`DiskCache._load`), never
  skipped for good; a lease that does not verify (signed without the secret) is taken over at
  once (`lease`); an object too big for this machine is not read (`_fetch`).
- s3fs rather than boto3: fsspec's `storage_options` are how pandas, Dask and Ray name a bucket,
  and its event loop gives concurrent requests without a thread per request.

`BucketStore` is the bucket as a `Store` (what `hardy cache ... --remote` maintains);
`DiskCache("s3://bucket/prefix", ...)` puts it behind a local store (`cache/shared.py`).
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import os
import random
import threading
import time
import weakref
from collections.abc import Coroutine, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

from ..errors import CacheUnavailable as Unavailable
from ..errors import InvalidArgument, install_hint
from .leases import Leases
from .s3 import CONFLICT_TRIES, UNUSABLE, code_of, half_the_memory, read_capped, reason
from .store import Buffer, Data, EntryInfo, pieces

T = TypeVar("T")
CONNECT_TIMEOUT = 3.0  # seconds to open a connection: a loopback or in-region server needs milliseconds
READ_TIMEOUT = 20.0  # seconds without a byte on an open connection: a stalled server, not a big entry
ATTEMPTS = 3  # botocore's tries per request (standard mode: 503 SlowDown, 500s, connection errors)
AHEAD_SHARE = 8  # a batch fetched ahead holds at most this share of `read_limit` (two are kept a thread)
DOWN_FOR = 30.0  # seconds the bucket is left alone after a failure that says it is unusable


class BucketStore(Leases):
    """Entries as objects under `s3://bucket/prefix/<namespace>/`: a `Store` over the S3 API.

    `namespace` is `<key format>/<key id hex>` (DiskCache makes it). `storage_options` go to
    `s3fs.S3FileSystem` (endpoint_url, key, secret, anon, client_kwargs...), over hardy's timeouts.
    `concurrency` bounds the requests in flight (listing shards, fetching a batch, publishing)."""

    def __init__(self, url: str, namespace: str, storage_options: dict[str, Any] | None = None, *,
                 concurrency: int = 32):
        scheme, _, rest = url.partition("://")
        if scheme not in ("s3", "s3a") or not rest.strip("/"):
            raise InvalidArgument(f"{url!r} is not an object-store URL hardy knows: use s3://bucket/prefix "
                             "(any S3-compatible server through storage_options={'endpoint_url': ...})")
        self.url = url.rstrip("/")
        self.bucket, _, prefix = rest.strip("/").partition("/")
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.root = f"{self.prefix}{namespace}"
        self.namespace = namespace
        self.storage_options = dict(storage_options or {})
        self.concurrency = concurrency
        self.lease_key: bytes | None = None  # signs single flight's leases (DiskCache sets it from the secret)
        self._setup()

    def _setup(self) -> None:
        _live.add(self)
        self._fs: Any = None
        self._pid = 0
        self._lock = threading.Lock()
        self._etags: dict[bytes, str] = {}  # from listings: what `delete` makes its deletion conditional on
        self._down_until = 0.0
        self._problems: collections.Counter[str] = collections.Counter()
        self._pending: set[Future[None]] = set()
        self._room: threading.BoundedSemaphore = threading.BoundedSemaphore(4 * self.concurrency)
        self._gate: asyncio.Semaphore | None = None
        self.read_limit = half_the_memory()  # bytes of one object, at most (`_fetch`); this process's own

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "root": self.root, "bucket": self.bucket, "prefix": self.prefix,
                "namespace": self.namespace, "storage_options": self.storage_options, "concurrency": self.concurrency,
                "lease_key": self.lease_key}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup()

    def __repr__(self) -> str:
        return f"BucketStore({self.url!r})"

    # --- the client, per process --------------------------------------------------------------------

    @property
    def fs(self) -> Any:
        """The s3fs filesystem of this process (a forked child makes its own: no loop crosses a fork)."""
        if self._fs is None or self._pid != os.getpid():
            try:
                import s3fs
            except ImportError:
                raise Unavailable(f"the object-store cache needs s3fs: {install_hint('s3')}") from None
            options = dict(self.storage_options)
            config = {"connect_timeout": CONNECT_TIMEOUT, "read_timeout": READ_TIMEOUT,
                      "retries": {"max_attempts": ATTEMPTS, "mode": "standard"},
                      "max_pool_connections": self.concurrency,  # botocore's default, 10, would cap it
                      # (CRC32 checksums of every request and response: redundant with the MAC, and CPU)
                      "request_checksum_calculation": "when_required", "response_checksum_validation": "when_required",
                      **options.pop("config_kwargs", {})}
            fs = s3fs.S3FileSystem(skip_instance_cache=True, config_kwargs=config, **options)
            fs.retries = 2  # s3fs's own loop around botocore's: SlowDown once more, after a pause
            if self._pid:  # a forked child: the parent's publications are the parent's
                self._setup()
            self._fs, self._pid = fs, os.getpid()
        return self._fs

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        from fsspec.asyn import sync
        return sync(self.fs.loop, lambda: coro)  # type: ignore[no-any-return]

    async def _call(self, method: str, **kwargs: Any) -> Any:
        if self._gate is None:
            self._gate = asyncio.Semaphore(self.concurrency)
        async with self._gate:
            return await self.fs._call_s3(method, Bucket=self.bucket, **kwargs)

    def path(self, key: bytes) -> str:
        name = key.hex()
        return f"{self.root}/{name[:2]}/{name}"

    def lease_path(self, key: bytes) -> str:
        return f"{self.prefix}leases/{self.namespace}/{key.hex()}"

    def namespaced(self, key: bytes) -> bool:
        """Every entry is read from the folder of one key id: one naming another is forged."""
        return True

    # --- faults ------------------------------------------------------------------------------------

    def down(self) -> bool:
        return time.monotonic() < self._down_until

    def _failed(self, action: str, exc: BaseException) -> Unavailable:
        """Count a failure for `settle()`; one that says the bucket is unusable leaves it alone for
        DOWN_FOR seconds. Returned as `Unavailable` for the caller to raise or swallow."""
        code = code_of(exc)
        if not hasattr(exc, "response") and not hasattr(exc.__cause__, "response") or code in UNUSABLE:
            self._down_until = time.monotonic() + DOWN_FOR
        with self._lock:
            self._problems[f"could not be {action} ({reason(exc)})"] += 1
        return Unavailable(f"{self.url}: {reason(exc)}")

    def _skipped(self, action: str) -> Unavailable:
        with self._lock:
            self._problems[f"not {action} (the store failed less than {DOWN_FOR:.0f} s before)"] += 1
        return Unavailable(f"{self.url}: left alone after a failure")

    def settle(self, timeout: float = 300.0) -> list[str]:
        """Wait for the publications in flight (at most `timeout` seconds), then hand over and forget
        what went wrong since the last call, in the words of DiskCache's warning."""
        deadline = time.monotonic() + timeout
        for fut in list(self._pending):
            try:
                fut.result(max(0.0, deadline - time.monotonic()))
            except Exception:  # counted by _publish; a timeout leaves it running
                pass
        with self._lock:
            parts = [f"{n} entr{'y' if n == 1 else 'ies'} {what}" for what, n in self._problems.most_common()]
            self._problems.clear()
        if parts:
            parts[-1] += f" at {self.url}; the local cache was used"
        return parts

    # --- entries -----------------------------------------------------------------------------------

    async def _fetch(self, key: bytes, budget: list[int] | None = None) -> tuple[bytes, str] | None:
        """The object's bytes and ETag; None if there is none, or if it is bigger than `read_limit`
        (`s3.read_capped`: a bucket's writer could make a reader load one until the kernel kills
        it). `budget`: the bytes a batch fetched ahead may still hold, between them; an object that
        does not fit raises `_Later` (it is looked up alone when its item needs it). Raises Unavailable."""
        if self.down():
            raise self._skipped("looked up")
        try:
            resp = await self._call("get_object", Key=self.path(key))
            size, cap = resp.get("ContentLength"), self.read_limit
            if budget is not None:  # its room taken before it is read: the batch's reads run at once
                cap = min(cap, size if isinstance(size, int) and size <= budget[0] else budget[0])
                budget[0] -= cap
            data = await read_capped(resp, cap)
        except FileNotFoundError as exc:
            if code_of(exc) != "NoSuchBucket":
                return None
            raise self._failed("looked up", exc) from None
        except Exception as exc:
            raise self._failed("looked up", exc) from None
        if budget is not None:  # (what it did not use)
            budget[0] += cap - (len(data) if data is not None else 0)
        if data is None and cap < self.read_limit:
            raise _Later(key)
        if data is None:
            with self._lock:
                self._problems[f"not read (bigger than {cap / 2**30:.3g} GiB, half this machine's memory)"] += 1
            return None
        return data, resp["ETag"]

    async def _fetch_many(self, keys: tuple[bytes, ...]) -> dict[bytes, tuple[bytes, str]]:
        """Those of `keys` the bucket has, fetched concurrently, together at most `read_limit` bytes
        (those that do not fit are misses); failures count, never raise."""
        budget = [self.read_limit]
        got = await asyncio.gather(*(self._fetch(k, budget) for k in keys), return_exceptions=True)
        return {k: g for k, g in zip(keys, got) if isinstance(g, tuple)}

    async def _publish(self, key: bytes, body: bytes) -> None:
        """Create-only: 412 (someone published this entry) is success, 409 is retried with jitter."""
        if self.down():
            raise self._skipped("published")
        for attempt in range(CONFLICT_TRIES):
            try:
                await self._call("put_object", Key=self.path(key), Body=body, IfNoneMatch="*")
                return
            except Exception as exc:
                code = code_of(exc)
                if code == "PreconditionFailed":
                    return
                if code != "ConditionalRequestConflict" or attempt == CONFLICT_TRIES - 1:
                    raise self._failed("published", exc) from None
                await asyncio.sleep(random.uniform(0, 0.05 * 2 ** attempt))

    async def _delete_if(self, key: bytes, etag: str) -> bool:
        """Delete the object only if it is still the one read (its ETag): False if it changed."""
        try:
            await self._call("delete_object", Key=self.path(key), IfMatch=etag)
            return True
        except FileNotFoundError:  # gone already
            return False
        except Exception as exc:
            if code_of(exc) == "PreconditionFailed":
                return False  # re-published since: that entry is not the damaged one
            raise self._failed("deleted", exc) from None

    def fetch(self, key: bytes) -> tuple[bytes, str] | None:
        return self._run(self._fetch(key))

    async def _look_ahead(self, keys: tuple[bytes, ...]) -> tuple[dict[bytes, tuple[bytes, str]], set[bytes]]:
        """`_fetch_many`, also telling which keys the bucket answered it has no entry for. The first
        key goes alone: a bucket that fails it is left alone (`down`) before the others are sent,
        instead of every one of them being tried and retried at once."""
        budget = [self.read_limit // AHEAD_SHARE]
        got = list(await asyncio.gather(self._fetch(keys[0], budget), return_exceptions=True))
        got += await asyncio.gather(*(self._fetch(k, budget) for k in keys[1:]), return_exceptions=True)
        return ({k: g for k, g in zip(keys, got) if isinstance(g, tuple)},
                {k for k, g in zip(keys, got) if g is None})

    def fetch_ahead(self, keys: tuple[bytes, ...]) -> Future[tuple[dict[bytes, tuple[bytes, str]], set[bytes]]]:
        """Start fetching `keys` (`concurrency` at a time) and return at once: the future's result
        is the entries found and the keys the bucket has no entry for (failures are in neither)."""
        return asyncio.run_coroutine_threadsafe(self._look_ahead(keys), self.fs.loop)

    def fetch_many(self, keys: tuple[bytes, ...]) -> dict[bytes, tuple[bytes, str]]:
        if self.down():
            self._skipped("looked up")
            return {}
        return self._run(self._fetch_many(keys))

    def publish(self, key: bytes, data: Data) -> None:
        """Publish in the background (at most 4 × concurrency waiting: a bucket slower than the
        computation slows the computation, never fills memory). `settle()` waits for them."""
        if self.down():
            self._skipped("published")
            return
        body = b"".join(pieces(data))  # the caller's buffers may change once it returns
        loop = self.fs.loop
        self._room.acquire()
        fut = asyncio.run_coroutine_threadsafe(self._publish(key, body), loop)
        self._pending.add(fut)
        fut.add_done_callback(self._published)

    def _published(self, fut: Future[None]) -> None:
        self._pending.discard(fut)
        self._room.release()

    def delete_if(self, key: bytes, etag: str) -> bool:
        return self._run(self._delete_if(key, etag))

    # --- Store: the bucket alone (what `hardy cache ... --remote` maintains) -----------------------

    def get(self, key: bytes) -> bytes | None:
        got = self.fetch(key)
        if got is None:
            return None
        self._etags[key] = got[1]
        return got[0]

    view = get

    def get_many(self, keys: tuple[bytes, ...]) -> dict[bytes, Buffer]:
        found = self.fetch_many(keys)
        self._etags.update({k: etag for k, (_, etag) in found.items()})
        return {k: data for k, (data, _) in found.items()}

    def put(self, key: bytes, data: Data) -> None:
        self._run(self._publish(key, b"".join(pieces(data))))

    def delete(self, key: bytes) -> None:
        """Delete only the object last read or listed under `key`; one replaced since stays."""
        etag = self._etags.pop(key, None)
        if etag is not None:
            self.delete_if(key, etag)

    def exists(self) -> bool:
        try:
            return bool(self._run(self._call("list_objects_v2", Prefix=self.root + "/", MaxKeys=1)).get("KeyCount"))
        except Exception as exc:
            raise self._failed("listed", exc) from None

    def entries(self) -> Iterator[EntryInfo]:
        """Every entry, oldest first: the 256 shards listed concurrently. Object stores keep no
        access time: created and accessed are both the object's LastModified."""
        found = []
        for obj in self._run(self._list_all()):
            name = obj["Key"].rpartition("/")[2]
            try:
                key = bytes.fromhex(name)
            except ValueError:
                continue
            self._etags[key] = obj["ETag"]
            when = obj["LastModified"].timestamp()
            found.append(EntryInfo(key, obj["Size"], when, when, False))
        yield from sorted(found, key=lambda e: e.created)

    async def _list_all(self) -> list[dict[str, Any]]:
        shards = await asyncio.gather(*(self._list(f"{self.root}/{i:02x}/") for i in range(256)))
        return [obj for shard in shards for obj in shard]

    async def _list(self, prefix: str) -> list[dict[str, Any]]:
        objects, token = [], None
        while True:
            more: dict[str, str] = {"ContinuationToken": token} if token else {}
            try:
                page = await self._call("list_objects_v2", Prefix=prefix, **more)
            except Exception as exc:
                raise self._failed("listed", exc) from None
            objects += page.get("Contents", [])
            token = page.get("NextContinuationToken")
            if not token:
                return objects

    def clear(self) -> None:
        for info in list(self.entries()):
            self.delete(info.key)


class _Later(Exception):
    """An object a batch fetched ahead had no room for (`BucketStore._fetch`): neither found nor absent."""


_live: weakref.WeakSet[BucketStore] = weakref.WeakSet()


@atexit.register
def _settle_all() -> None:
    """Publications still in flight when the interpreter exits are given a few seconds."""
    for bucket in list(_live):
        if bucket._pending and bucket._pid == os.getpid():
            bucket.settle(timeout=10.0)
