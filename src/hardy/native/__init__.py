"""The native side of a Python process: which shared libraries are loaded, and from where."""

from .loaded import loaded_libraries, openmp_runtimes

__all__ = ["loaded_libraries", "openmp_runtimes"]
