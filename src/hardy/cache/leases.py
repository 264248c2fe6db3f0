"""Single flight across machines: a bucket's leases (`Leases.lease`), which `BucketStore` holds.

A process that misses takes the key's lease, an object created with If-None-Match (one holder),
computes and publishes, while the others wait for the entry. The holder renews it; a lease not
renewed for its ttl (its holder died) is taken over. Leases are signed with a key derived from
the cache's secret, so one written by someone without it is taken over at once instead of being
waited on, and one longer than any of ours is not even read (`s3.read_capped`). Within a
machine, lock files do the same (`flight.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import os
import random
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any

from .s3 import CONFLICT_TRIES, code_of, read_capped
from .trust import sign

if TYPE_CHECKING:
    import collections

    from ..errors import CacheUnavailable

FORGED_LEASE = "computed without single flight: its lease was forged again after each takeover"
LEASE_TTL = 60.0  # seconds a single-flight lease lives unless renewed (renewed every third of it)
LEASE_MAX = 4096  # bytes: a lease of ours is a short JSON line


class Leases:
    """`BucketStore`'s single flight, through the store's requests, paths and accounting (below)."""

    lease_key: bytes | None
    _lock: threading.Lock
    _problems: collections.Counter[str]
    _run: Callable[[Coroutine[Any, Any, Any]], Any]
    _call: Callable[..., Coroutine[Any, Any, Any]]
    _failed: Callable[[str, BaseException], CacheUnavailable]
    down: Callable[[], bool]
    settle: Callable[..., list[str]]
    path: Callable[[bytes], str]
    lease_path: Callable[[bytes], str]

    @contextlib.contextmanager
    def lease(self, key: bytes, ttl: float = LEASE_TTL) -> Iterator[None]:
        """Hold the lease of `key` while computing it, or wait until its entry is published.

        The lease is an object created with If-None-Match (one holder), renewed every ttl/3 with
        If-Match on its ETag, and taken over with If-Match once the server's clock says it has not
        been renewed for `ttl` seconds (its holder died): expiry is judged by the server's
        LastModified and Date, so the machines' clocks need not agree. Returns (enters) when this
        process holds the lease or the entry exists; any failure enters without a lease (the
        node computes; duplicated work is only time). Leases are signed (`lease_key`): one that
        does not verify is not waited on but taken over, and a bucket without the key has none."""
        if self.down() or self.lease_key is None:
            yield
            return
        held = self._run(self._acquire(key, ttl))
        if held is None:
            yield
            return
        stop = threading.Event()
        renewer = threading.Thread(target=self._renew, args=(key, held, ttl, stop), name="hardy-lease-renew",
                                   daemon=True)
        renewer.start()
        try:
            yield
        finally:
            stop.set()
            renewer.join()
            self.settle()  # the entry is published before the lease goes: waiters then find it
            with contextlib.suppress(Exception):
                self.delete_lease(key, held[0])

    def delete_lease(self, key: bytes, etag: str) -> None:
        self._run(self._call("delete_object", Key=self.lease_path(key), IfMatch=etag))

    def _lease_body(self, key: bytes, holder: str, ttl: float) -> bytes:
        return json.dumps({"holder": holder, "ttl": ttl, "mac": self._lease_mac(key, holder, ttl)}).encode()

    def _lease_mac(self, key: bytes, holder: str, ttl: float) -> str:
        assert self.lease_key is not None
        return sign(self.lease_key, f"{self.lease_path(key)}\0{holder}\0{float(ttl)!r}".encode()).hex()

    def _lease_ttl(self, key: bytes, raw: bytes) -> float | None:
        """The lease's ttl if it is signed with this secret's lease key, else None (forged or garbled)."""
        try:
            held = json.loads(raw)
            holder, ttl, mac = held["holder"], float(held["ttl"]), held["mac"]
        except (ValueError, TypeError, KeyError):
            return None
        if not isinstance(holder, str) or not isinstance(mac, str) or not math.isfinite(ttl):
            return None
        return ttl if hmac.compare_digest(mac, self._lease_mac(key, holder, ttl)) else None

    async def _acquire(self, key: bytes, ttl: float) -> list[str] | None:
        """[the lease's ETag] once held; None when the entry exists, the bucket fails, or a forged
        lease is put back each time it is taken over (CONFLICT_TRIES times: then computed alone)."""
        body = self._lease_body(key, f"{os.uname().nodename}:{os.getpid()}:{os.urandom(4).hex()}", ttl)
        path, delay, forged = self.lease_path(key), 0.05, 0
        try:
            while True:
                with contextlib.suppress(FileNotFoundError):
                    await self._call("head_object", Key=self.path(key))
                    return None  # published: no need to compute
                condition, fake = await self._expired(key, path)
                if condition is not None:
                    try:
                        put = await self._call("put_object", Key=path, Body=body, **condition)
                        return [put["ETag"]]
                    except Exception as exc:
                        if code_of(exc) not in ("PreconditionFailed", "ConditionalRequestConflict"):
                            raise
                forged += fake
                if forged >= CONFLICT_TRIES:
                    with self._lock:
                        self._problems[FORGED_LEASE] += 1
                    return None
                await asyncio.sleep(delay * random.uniform(0.5, 1.5))
                delay = min(2 * delay, ttl / 10, 1.0)
        except Exception as exc:
            self._failed("single-flighted", exc)
            return None

    async def _expired(self, key: bytes, path: str) -> tuple[dict[str, str] | None, bool]:
        """The condition to take the lease with: none there (If-None-Match), expired or forged (If-Match
        on its ETag); None while a holder of the secret holds it. And whether it was forged."""
        try:
            resp = await self._call("get_object", Key=path)
            raw = await read_capped(resp, LEASE_MAX)  # (one of ours is a short line: a longer one is forged)
        except FileNotFoundError:
            return {"IfNoneMatch": "*"}, False
        ttl = self._lease_ttl(key, raw) if raw is not None else None
        if ttl is None:
            return {"IfMatch": resp["ETag"]}, True
        from email.utils import parsedate_to_datetime
        now = parsedate_to_datetime(resp["ResponseMetadata"]["HTTPHeaders"]["date"]).timestamp()
        if now - resp["LastModified"].timestamp() > ttl:
            return {"IfMatch": resp["ETag"]}, False
        return None, False

    def _renew(self, key: bytes, held: list[str], ttl: float, stop: threading.Event) -> None:
        body = self._lease_body(key, "renewed", ttl)
        while not stop.wait(ttl / 3):
            try:
                put = self._run(self._call("put_object", Key=self.lease_path(key), Body=body, IfMatch=held[0]))
                held[0] = put["ETag"]
            except Exception:  # taken over or unreachable: computing on costs only time
                return
