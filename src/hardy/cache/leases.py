"""Single flight across machines: a bucket's leases (`Leases.lease`), which `BucketStore` holds.

A process that misses takes the key's lease, an object created with If-None-Match (one holder),
computes and publishes, while the others wait for the entry. The holder renews it; a lease not
renewed for its ttl (its holder died) is taken over. Leases are signed with a key derived from
the cache's secret, so one written by someone without it is taken over at once instead of being
waited on, and one longer than any of ours is not even read (`s3.read_capped`). A bucket's writer
can still copy a genuine lease and put it back: the signed body therefore carries its holder's
time of writing and a nonce, so a copy runs out with the lease it copies, whatever the server's
LastModified says; and no lease is waited on past `LEASE_WAIT` (then the waiter computes: single
flight degrades to duplicate work, never a hang). Within a machine, lock files do the same
(`flight.py`).
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
import time
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
LEASE_SKEW = 30.0  # seconds two machines' clocks may differ: a lease lives its signed time + ttl + this
LEASE_WAIT = 600.0  # seconds a waiter waits for one key's lease in all, then computes the item itself
WAITED = "computed without single flight: its lease was still held after waiting {wait:g} s"


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
    def lease(self, key: bytes, ttl: float = LEASE_TTL, wait: float = LEASE_WAIT) -> Iterator[None]:
        """Hold the lease of `key` while computing it, or wait until its entry is published.

        The lease is an object created with If-None-Match (one holder), renewed every ttl/3 with
        If-Match on its ETag, each time with a new signed body (the holder's time of writing and a
        nonce). It is taken over with If-Match once its signed time + ttl + LEASE_SKEW has passed
        by this machine's clock, or once this process has seen the same nonce for `ttl` (its holder
        died, or someone puts a copy back): never by the server's LastModified, which any writer of
        the bucket refreshes. After `wait` seconds in all the node computes without the lease, said
        once in the map's warning with the lease's path. Returns (enters) when this process holds
        the lease or the entry exists; any failure enters without a lease (duplicated work is only
        time). Leases are signed (`lease_key`): one that does not verify (forged, or hardy's
        earlier format without a signed time) is taken over, and a bucket without the key has none."""
        if self.down() or self.lease_key is None:
            yield
            return
        held = self._run(self._acquire(key, ttl, wait))
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

    def _lease_body(self, key: bytes, holder: str, ttl: float, written: float | None = None) -> bytes:
        """A new lease body: signed, with the time of writing (`written`: now) and a fresh nonce, so
        that each renewal differs and a copy of any of them runs out with it."""
        lease = {"holder": holder, "ttl": float(ttl), "written": time.time() if written is None else written,
                 "nonce": os.urandom(8).hex()}
        return json.dumps({**lease, "mac": self._lease_mac(key, lease)}).encode()

    def _lease_mac(self, key: bytes, lease: dict[str, Any]) -> str:
        assert self.lease_key is not None
        signed = f"{self.lease_path(key)}\0{lease['holder']}\0{lease['ttl']!r}\0{lease['written']!r}\0{lease['nonce']}"
        return sign(self.lease_key, b"lease v2\0", signed.encode()).hex()

    def _lease_read(self, key: bytes, raw: bytes) -> dict[str, Any] | None:
        """The lease if it is signed with this secret's lease key, else None (forged, garbled, or
        hardy's earlier format, which has no signed time)."""
        try:
            held = json.loads(raw)
            lease = {"holder": held["holder"], "ttl": float(held["ttl"]), "written": float(held["written"]),
                     "nonce": held["nonce"]}
            mac = held["mac"]
        except (ValueError, TypeError, KeyError):
            return None
        if not all(isinstance(v, str) for v in (lease["holder"], lease["nonce"], mac)) \
                or not all(math.isfinite(lease[k]) for k in ("ttl", "written")):
            return None
        return lease if hmac.compare_digest(mac, self._lease_mac(key, lease)) else None

    async def _acquire(self, key: bytes, ttl: float, wait: float) -> list[str] | None:
        """[the lease's ETag] once held; None when the entry exists, the bucket fails, a forged
        lease is put back each time it is taken over (CONFLICT_TRIES times), or after `wait`
        seconds: then computed alone."""
        holder = f"{os.uname().nodename}:{os.getpid()}:{os.urandom(4).hex()}"
        path, delay, forged = self.lease_path(key), 0.05, 0
        seen: dict[str, float] = {}  # nonce -> when this process first saw it (monotonic)
        deadline = time.monotonic() + wait
        try:
            while True:
                with contextlib.suppress(FileNotFoundError):
                    await self._call("head_object", Key=self.path(key))
                    return None  # published: no need to compute
                condition, fake = await self._expired(key, path, seen)
                if condition is not None:
                    try:
                        put = await self._call("put_object", Key=path, Body=self._lease_body(key, holder, ttl),
                                               **condition)
                        return [put["ETag"]]
                    except Exception as exc:
                        if code_of(exc) not in ("PreconditionFailed", "ConditionalRequestConflict"):
                            raise
                forged += fake
                if forged >= CONFLICT_TRIES or time.monotonic() >= deadline:
                    self._gave_up(path, wait, forged >= CONFLICT_TRIES)
                    return None
                await asyncio.sleep(min(delay * random.uniform(0.5, 1.5), max(0.0, deadline - time.monotonic())))
                delay = min(2 * delay, ttl / 10, 1.0)
        except Exception as exc:
            self._failed("single-flighted", exc)
            return None

    def _gave_up(self, path: str, wait: float, forged: bool) -> None:
        """Count an item computed without its lease for the map's warning: the waits past `wait`
        under one line naming the first such lease's path (a map of many keys says it once)."""
        waited = WAITED.format(wait=wait)
        with self._lock:
            if forged:
                self._problems[FORGED_LEASE] += 1
                return
            said = next((what for what in self._problems if what.startswith(waited)), None)
            self._problems[said or f"{waited} (the first: {path}; a holder slower than that, or a lease "
                           "copied and put back by a writer of the bucket)"] += 1

    async def _expired(self, key: bytes, path: str, seen: dict[str, float]) -> tuple[dict[str, str] | None, bool]:
        """The condition to take the lease with: none there (If-None-Match), expired or forged (If-Match
        on its ETag); None while a holder of the secret holds it. And whether it was forged. Expired:
        past its signed time + ttl + LEASE_SKEW by this clock, or its nonce seen (`seen`) for ttl."""
        try:
            resp = await self._call("get_object", Key=path)
            raw = await read_capped(resp, LEASE_MAX)  # (one of ours is a short line: a longer one is forged)
        except FileNotFoundError:
            return {"IfNoneMatch": "*"}, False
        lease = self._lease_read(key, raw) if raw is not None else None
        if lease is None:
            return {"IfMatch": resp["ETag"]}, True
        first = seen.setdefault(lease["nonce"], time.monotonic())
        if time.time() > lease["written"] + lease["ttl"] + LEASE_SKEW or time.monotonic() - first > lease["ttl"]:
            return {"IfMatch": resp["ETag"]}, False
        return None, False

    def _renew(self, key: bytes, held: list[str], ttl: float, stop: threading.Event) -> None:
        while not stop.wait(ttl / 3):
            try:
                put = self._run(self._call("put_object", Key=self.lease_path(key),
                                           Body=self._lease_body(key, "renewed", ttl), IfMatch=held[0]))
                held[0] = put["ETag"]
            except Exception:  # taken over or unreachable: computing on costs only time
                return
