"""The cache: content-addressed node results, verified before use, shared by any number of processes."""

from ..errors import UntrustedCacheError  # named here by docs/caching.md before it moved to hardy.errors
from .disk import CacheStats, DiskCache, VerifyReport
from .files import FileStore
from .store import EntryInfo, LocalStore, Store

__all__ = ["DiskCache", "CacheStats", "VerifyReport", "Store", "LocalStore", "FileStore", "EntryInfo",
           "UntrustedCacheError"]
