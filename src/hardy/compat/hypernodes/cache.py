"""`hypernodes.cache`: the cache is hardy's DiskCache (keys cover code, closures and values;
entries are verified before they are read: docs/caching.md). `DiskCache(path)` takes HyperNodes'
argument; objects with `__cache_key__()` are keyed by it."""

from ...cache import DiskCache

__all__ = ["DiskCache"]
