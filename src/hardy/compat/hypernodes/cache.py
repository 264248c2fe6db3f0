"""`hypernodes.cache`: hardy's DiskCache (keys cover code, closures and values; entries are verified
before they are read: docs/caching.md) with HyperNodes' keying of objects. `DiskCache(path)` takes
HyperNodes' argument; objects with `__cache_key__()` are keyed by it, other objects of user classes
by their class and public attributes (private ones, `_cache` or `_session`, are left out)."""

from ...cache import DiskCache as HardyDiskCache
from ...hashing import hash_public


class DiskCache(HardyDiskCache):
    hash_value = staticmethod(hash_public)


__all__ = ["DiskCache"]
