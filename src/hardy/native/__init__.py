"""The native side of a Python process: loaded libraries, ELF dependencies, preload order.

Each name loads with its module on first use (`hardy.lazy`): a fork server asks `loaded` which
libraries it holds, and reading ELF files or planning a preload is the doctor's and the parent's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import exports

if TYPE_CHECKING:
    from .elf import Library, read_library
    from .libs import LoadPlan, Missing, analyse, package_dirs, preload, scan
    from .loaded import loaded_libraries, openmp_runtimes

__all__ = ["loaded_libraries", "openmp_runtimes", "Library", "read_library", "scan", "analyse", "LoadPlan",
           "Missing", "preload", "package_dirs"]
__getattr__, __dir__ = exports(__name__, {
    "loaded_libraries": "loaded", "openmp_runtimes": "loaded", "Library": "elf", "read_library": "elf",
    "scan": "libs", "analyse": "libs", "LoadPlan": "libs", "Missing": "libs", "preload": "libs",
    "package_dirs": "libs"})
