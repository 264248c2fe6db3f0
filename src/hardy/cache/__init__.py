"""The cache: content-addressed node results, verified before use, shared by any number of processes.

Its modules load on first use (PEP 562): `hardy.cache.keys`, which every compiled plan and the
engine import, must not bring SQLite, the object store and the trust checks into `import hardy`
and into every fork server.
"""

from typing import TYPE_CHECKING, Any

from ..errors import UntrustedCacheError  # named here by docs/caching.md before it moved to hardy.errors

if TYPE_CHECKING:
    from .disk import CacheStats, DiskCache, VerifyReport
    from .files import FileStore
    from .store import EntryInfo, LocalStore, Store

__all__ = ["DiskCache", "CacheStats", "VerifyReport", "Store", "LocalStore", "FileStore", "EntryInfo",
           "UntrustedCacheError"]
_HOMES = {"DiskCache": "disk", "CacheStats": "disk", "VerifyReport": "disk", "FileStore": "files",
          "Store": "store", "LocalStore": "store", "EntryInfo": "store"}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'hardy.cache' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
