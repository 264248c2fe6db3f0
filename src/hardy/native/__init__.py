"""The native side of a Python process: loaded libraries, ELF dependencies, preload order."""

from .elf import Library, read_library
from .libs import LoadPlan, Missing, analyse, package_dirs, preload, scan
from .loaded import loaded_libraries, openmp_runtimes

__all__ = ["loaded_libraries", "openmp_runtimes", "Library", "read_library", "scan", "analyse", "LoadPlan",
           "Missing", "preload", "package_dirs"]
