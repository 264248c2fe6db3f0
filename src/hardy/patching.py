"""Patching a library the moment it is imported, whoever imports it, without importing it first.

A worker adjusts two libraries a node may use: numba (its functions' unique ids,
`safety.environment`) and multiprocessing (the pickler of a pool a node starts,
`shipping.pickling`). Importing them up front would cost every fork server, and so every first
map, their import, whether or not a node ever uses them, and would give each worker modules its
caller may never have loaded. So each is patched now if it is loaded, else as its import runs.

A finder needs only `find_spec`: not `importlib.abc.MetaPathFinder`, whose import loads `pathlib`
and more into every fork server.
"""

from __future__ import annotations

import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any


def when_imported(name: str, patch: Callable[[ModuleType], None]) -> None:
    """`patch(module)` now if module `name` is loaded, else right after its import runs."""
    module = sys.modules.get(name)
    if module is not None:
        patch(module)
    elif not any(isinstance(f, _Patcher) and f.target == name for f in sys.meta_path):
        sys.meta_path.insert(0, _Patcher(name, patch))


class _Patcher:
    """Finds `target` as the path finder would, and patches the module once its code has run."""

    def __init__(self, target: str, patch: Callable[[ModuleType], None]):
        self.target, self.patch = target, patch

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.target:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        original, patch = spec.loader.exec_module, self.patch

        def exec_module(module: ModuleType) -> None:
            original(module)
            patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
