"""Names a package exports, each loaded with its module on first use (PEP 562).

Why: a fork server and its workers import a package for one module of it (`safety.environment`,
`native.loaded`), and everything that module's package imported eagerly would delay every first
map (the server imports before it can fork; `docs/benchmarks.md`, the first map)."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def exports(package: str, homes: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of `package`: each name in `homes` from its submodule
    there, and listed with the package's own (completion in a REPL or an editor)."""

    def __getattr__(name: str) -> object:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{homes[name]}"), name)

    def __dir__() -> list[str]:
        return sorted({*vars(importlib.import_module(package)), *homes})

    return __getattr__, __dir__
