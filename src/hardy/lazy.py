"""Names a package exports, each loaded with its module on first use (PEP 562).

Why: a fork server and its workers import a package for one module of it (`safety.environment`,
`native.loaded`), and everything that module's package imported eagerly would delay every first
map (the server imports before it can fork; `docs/benchmarks.md`, the first map)."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def exports(package: str, homes: dict[str, str]) -> Callable[[str], object]:
    """The `__getattr__` of `package`: each name in `homes` from its submodule there."""

    def __getattr__(name: str) -> object:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{homes[name]}"), name)

    return __getattr__
