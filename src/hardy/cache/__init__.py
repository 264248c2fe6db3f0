"""The cache: content-addressed node results, verified before use, shared by any number of processes."""

from .disk import CacheStats, DiskCache, VerifyReport
from .store import EntryInfo, FileStore, LocalStore, Store
from .trust import UntrustedCacheError

__all__ = ["DiskCache", "CacheStats", "VerifyReport", "Store", "LocalStore", "FileStore", "EntryInfo",
           "UntrustedCacheError"]
