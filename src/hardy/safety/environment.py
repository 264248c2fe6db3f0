"""What a worker applies to its own process: the thread caps on runtimes already loaded, and the
numba unique-id guard. (The variables it starts with: `workers.launch.worker_environment`.)

Numba guard: numba names compiled functions `qualname$<counter>`. The counter is
per-process state, so two fresh processes compiling same-qualname functions draw the same ids, and
with `cache=True` a later process that loads both caches can call the wrong body. Drawing ids from
16 random bytes (os.urandom) make every id globally unique. It replaces a private attribute, so it is applied only to
numba versions known to use it in the same way.
"""

from __future__ import annotations

import importlib.machinery
import itertools
import os
import sys
from typing import Any

from ..native.loaded import may_hold_thread_pools

NUMBA_GUARD_RANGE = ">=0.55,<0.69"  # the versions whose FunctionIdentity was read (a PEP 440 specifier)


def cap_loaded_runtimes() -> None:
    """Apply this process's OMP/OpenBLAS caps to OpenMP and BLAS runtimes already loaded.

    The variables reach only runtimes loaded after they are set: a worker forked from the parent
    (start_method="fork!") holds the parent's runtimes with the parent's thread counts. threadpoolctl
    finds the loaded runtimes and calls each one's own setter (~0.2 ms when none is loaded, 7 to 12 ms
    with torch's). It is imported only where a loaded library may be such a runtime: a fork server
    without `preload` (a fresh interpreter and hardy's modules) has none, and its first map does not
    wait for the import. A fork server applies its caps once, after `preload`: its workers fork with
    those runtimes, capped, and the same variables, so theirs is a comparison."""
    global _capped
    caps = {"openmp": os.environ.get("OMP_NUM_THREADS"), "blas": os.environ.get("OPENBLAS_NUM_THREADS")}
    limits = {api: int(n) for api, n in caps.items() if n and n.isdigit()}
    if limits == _capped:  # applied already, to the same runtimes (a fork server's, before its workers forked)
        return
    if may_hold_thread_pools():  # else none is loaded: those loaded later read the variables themselves
        from threadpoolctl import threadpool_limits
        threadpool_limits(limits=limits)
    _capped = limits


_capped: dict[str, int] | None = None  # the caps this process applied last (a fork server's workers inherit it)


class _UniqueIds:
    """An endless iterator of 128-bit random ids: no two processes ever draw the same one."""

    def __iter__(self) -> _UniqueIds:
        return self

    def __next__(self) -> int:
        return int.from_bytes(os.urandom(16), "big")


def version_in(version: str, specifier: str) -> bool:
    """Local labels (`2.11.0+cu130`) and pre-releases count as their release: the ranges hardy keeps
    are of internals it reads, which a local build or a release candidate shares with its release."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return SpecifierSet(specifier).contains(Version(version).public, prereleases=True)
    except InvalidVersion:
        return False


def numba_guard_supported(version: str) -> bool:
    return version_in(version, NUMBA_GUARD_RANGE)


def _patch_bytecode(module: Any) -> None:
    numba = sys.modules.get("numba")
    version = getattr(numba, "__version__", "0")
    identity = getattr(module, "FunctionIdentity", None)
    if identity is None or not isinstance(getattr(identity, "_unique_ids", None), itertools.count):
        return  # internals changed: never patch what we do not recognise
    if not numba_guard_supported(version):
        import warnings
        warnings.warn(f"hardy: numba {version} is outside the range the unique-id guard was checked "
                      f"against; not patched", RuntimeWarning, stacklevel=2)
        return
    identity._unique_ids = _UniqueIds()


class _NumbaHook:
    """Patches numba.core.bytecode the moment it is imported, whoever imports it. (A finder needs
    only `find_spec`: not `importlib.abc.MetaPathFinder`, whose import loads pathlib and more
    into every fork server.)"""

    target = "numba.core.bytecode"

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.target:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module: Any) -> None:
            original(module)
            if module.__name__ == _NumbaHook.target:  # (a zip's importer loads its other modules too)
                _patch_bytecode(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install_numba_guard() -> None:
    """Apply the guard now if numba is loaded, else as soon as it is imported."""
    module = sys.modules.get(_NumbaHook.target)
    if module is not None:
        _patch_bytecode(module)
    elif not any(isinstance(f, _NumbaHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _NumbaHook())
