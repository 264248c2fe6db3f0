"""Shared libraries across split `sys.path` layouts: what is missing, and the order to load them.

In the incident behind it, torch could not be imported under Bazel: every wheel has its own
`sys.path` directory there, so `libcusparse` cannot find
`libnvJitLink` (its DT_NEEDED) by itself — the dynamic loader only searches RPATH/RUNPATH,
`LD_LIBRARY_PATH` as it was at process start, and the system directories. What does work: load the
dependencies first, by full path, in topological order. The loader then finds each DT_NEEDED among
the libraries already loaded (it matches their SONAME), whatever RTLD_LOCAL/GLOBAL says.

Loading a library runs its constructors as the user, so a library another user owns or could have
replaced is never indexed or loaded, and folders of other users' are not walked (`scan`): a
`sys.path` that starts with a shared working folder (`python -m hardy libs --preload` run there)
would otherwise load whatever someone left below it.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import os
import stat
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..system import others_may_write
from .elf import Library, open_regular, read_library

log = logging.getLogger("hardy.native")

SYSTEM_DIRS = ("/lib", "/usr/lib", "/lib64", "/usr/lib64", "/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu",
               "/lib/aarch64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/local/lib")


def scan(paths: Iterable[str], environment: bool = False, skipped: list[str] | None = None) -> list[Library]:
    """Every ELF shared library under `paths` (recursively), each real file once. With
    `environment` (`paths` are an interpreter's sys.path), a folder inside one of them that is
    another Python environment's packages (a `site-packages` or `dist-packages` that is not one of
    `paths`: the base interpreter's, under its standard library on a venv's sys.path) is not this
    interpreter's and is left out, and one of `paths` is walked once, as itself. A library another
    user owns or could have replaced (`_replaceable`) is left out, and a folder another user owns is
    not walked: each is said in one warning, and added to `skipped` (path and why) if given."""
    paths = list(paths)
    roots = {os.path.realpath(p) for p in paths} if environment else None
    seen: set[str] = set()
    found: list[Library] = []
    said: list[str] = []
    for root in paths:
        if not os.path.isdir(root):
            continue
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", ".git")
                       and (roots is None or not _elsewhere(folder, d, roots)) and not _theirs(folder, d, said)]
            for name in files:
                full = os.path.join(folder, name)
                real = os.path.realpath(full) if ".so" in name else ""
                if not real or real in seen:
                    continue
                seen.add(real)
                lib = read_library(full)
                why = _replaceable(full, root) if lib is not None else None
                if why:
                    said.append(f"{full} ({why})")
                elif lib is not None:
                    found.append(lib)
    if said:
        _say_skipped(said)
    if skipped is not None:
        skipped += said
    return found


def _owner(uid: int) -> str:
    try:
        import pwd
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def _theirs(folder: str, name: str, said: list[str]) -> bool:
    """Whether `folder/name` is a folder another user owns (not the user, not root): not walked,
    and said. Their libraries would be theirs to replace."""
    path = os.path.join(folder, name)
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if stat.S_ISDIR(st.st_mode) and st.st_uid not in (os.geteuid(), 0):
        said.append(f"{path}/ (a folder owned by {_owner(st.st_uid)}: not searched)")
        return True
    return False


def _replaceable(path: str, root: str) -> str | None:
    """Why loading `path` could run another user's code, or None: the file (a link's target) is not
    the user's or root's, or others may write it (anyone, or a group that is not the user's own:
    `others_may_write`, as the cache's folders), or it lies in a folder (from its own up to `root`,
    and its target's) that another user owns or others may write without the sticky bit keeping
    them from replacing what is not theirs."""
    me, stop = os.geteuid(), os.path.normpath(root)
    try:
        st = os.stat(path)
        if st.st_uid not in (me, 0):
            return f"owned by {_owner(st.st_uid)}, not by you or root"
        if others_may_write(st):
            return f"writable by {_writers(st)} (mode {stat.S_IMODE(st.st_mode):o})"
        folders, folder = {os.path.dirname(os.path.realpath(path))}, os.path.dirname(path)
        while True:
            folders.add(folder)
            if os.path.normpath(folder) == stop or os.path.dirname(folder) == folder:
                break
            folder = os.path.dirname(folder)
        for folder in sorted(folders):
            fs = os.stat(folder)
            if fs.st_uid not in (me, 0):
                return f"in {folder}, owned by {_owner(fs.st_uid)}"
            if others_may_write(fs) and not fs.st_mode & stat.S_ISVTX:
                return f"in {folder}, which {_writers(fs)} can write (mode {stat.S_IMODE(fs.st_mode):o})"
    except OSError as exc:
        return f"cannot be checked: {exc.strerror}"
    return None


def _writers(st: os.stat_result) -> str:
    """Who besides the user may write what `st` describes (`others_may_write` said someone may)."""
    if st.st_mode & stat.S_IWOTH:
        return "anyone"
    import grp
    try:
        return f"group {grp.getgrgid(st.st_gid).gr_name}"
    except KeyError:
        return f"group {st.st_gid}"


def _say_skipped(said: list[str]) -> None:
    """One warning for a scan's skipped libraries and folders (the first ten by name)."""
    more = f"; and {len(said) - 10} more" if len(said) > 10 else ""
    log.warning("skipped, neither indexed nor loaded, since another user owns or could replace them and loading "
                "a library runs its code as you: %s%s. If you trust one, copy it into a folder of yours (or have "
                "it chowned to you) and name that folder", "; ".join(said[:10]), more)


def _elsewhere(folder: str, name: str, roots: set[str]) -> bool:
    """Whether `folder/name` is walked as a root of its own, or is another environment's packages."""
    real = os.path.realpath(os.path.join(folder, name))
    return real in roots or name in ("site-packages", "dist-packages")


@functools.lru_cache(maxsize=1)
def system_libraries() -> frozenset[str]:
    """Names the dynamic loader finds by itself: its cache, LD_LIBRARY_PATH and the system dirs."""
    names: set[str] = set()
    for ldconfig in ("/sbin/ldconfig", "/usr/sbin/ldconfig", "ldconfig"):
        try:
            out = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        names.update(line.split()[0] for line in out.splitlines()[1:] if line.strip())
        break
    dirs = [*filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(":")), *SYSTEM_DIRS]
    for d in dirs:
        try:
            names.update(os.listdir(d))
        except OSError:
            pass
    return frozenset(names)


@dataclass(frozen=True)
class Missing:
    library: Library
    needed: str
    elsewhere: str | None  # a directory that has it, though the loader will not look there
    unnamed: str | None = None  # the file there, which has no SONAME: loading it first does not help

    def __str__(self) -> str:
        if self.unnamed:
            return (f"{self.library.path} needs {self.needed}: {self.unnamed} has that file name but no SONAME, so "
                    f"loading it first (preload_libs=, hardy libs --order) cannot satisfy it: the loader matches a "
                    f"loaded library by SONAME. Give it one (patchelf --set-soname {self.needed} {self.unnamed}) or "
                    f"put {self.elsewhere} on LD_LIBRARY_PATH before Python starts")
        where = f"; it is in {self.elsewhere}, which the loader does not search" if self.elsewhere else ""
        return f"{self.library.path} needs {self.needed}: not found{where}"


@dataclass(frozen=True)
class LoadPlan:
    order: list[Library]           # dependencies first
    missing: list[Missing]         # DT_NEEDED nothing provides
    needs_preload: list[Missing]   # DT_NEEDED only another indexed directory provides
    cycles: list[list[str]]


def analyse(libraries: Sequence[Library], search: Sequence[str] = ()) -> LoadPlan:
    """Resolve every DT_NEEDED the way the loader would, and order the libraries for preloading.

    `search`: more directories to look in for a missing library (to say where it is).
    """
    by_name: dict[str, Library] = {}
    for lib in libraries:
        by_name.setdefault(lib.soname, lib)
        by_name.setdefault(os.path.basename(lib.path), lib)
    system = system_libraries()
    missing, needs_preload = [], []
    edges: dict[str, list[Library]] = {}
    for lib in libraries:
        deps = []
        for need in lib.needed:
            dirs = lib.rpath + lib.runpath
            if any(os.path.exists(os.path.join(d, need)) for d in dirs):
                continue  # the loader finds it through RPATH/RUNPATH
            provider = by_name.get(need)
            if provider is not None and provider.directory != lib.directory and not _has_soname(provider):
                missing.append(Missing(lib, need, provider.directory, provider.path))
                deps.append(provider)
                continue
            if provider is not None:
                deps.append(provider)
                if provider.directory != lib.directory:
                    needs_preload.append(Missing(lib, need, provider.directory))
                continue
            if need in system:
                continue
            missing.append(Missing(lib, need, _find(need, search)))
        edges[lib.path] = deps
    order, cycles = _topological(libraries, edges)
    return LoadPlan(order, missing, needs_preload, cycles)


def _has_soname(lib: Library) -> bool:
    """Whether `lib` has a DT_SONAME (`Library.soname` falls back to the file name): the loader
    matches a DT_NEEDED among loaded libraries by SONAME only, so one without is never matched."""
    if lib.soname != os.path.basename(lib.path):
        return True
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile
    f = open_regular(lib.path)
    if f is None:
        return True  # unreadable now: assumed named, as before
    try:
        with f:
            dynamic = ELFFile(f).get_section_by_name(".dynamic")
            return dynamic is None or any(t.entry.d_tag == "DT_SONAME" for t in dynamic.iter_tags())
    except (ELFError, OSError, ValueError):
        return True  # unreadable now: assumed named, as before


def _find(name: str, search: Sequence[str]) -> str | None:
    """A folder under `search` (an interpreter's sys.path: `scan`'s `environment`) holding `name`."""
    roots = {os.path.realpath(p) for p in search}
    for root in search:
        for folder, dirs, files in os.walk(root):
            if name in files:
                return folder
            dirs[:] = [d for d in dirs if not _elsewhere(folder, d, roots)]
    return None


def _topological(libraries: Sequence[Library],
                 edges: dict[str, list[Library]]) -> tuple[list[Library], list[list[str]]]:
    state: dict[str, int] = {}
    order: list[Library] = []
    cycles: list[list[str]] = []

    def visit(lib: Library, path: list[Library]) -> None:
        s = state.get(lib.path)
        if s == 2:
            return
        if s == 1:  # a cycle: report it, do not loop on it
            names = [p.soname for p in path[path.index(lib):]]
            if names not in cycles:
                cycles.append(names)
            return
        state[lib.path] = 1
        for dep in edges.get(lib.path, []):
            visit(dep, [*path, dep])
        state[lib.path] = 2
        order.append(lib)

    for lib in sorted(libraries, key=lambda lb: lb.path):
        visit(lib, [lib])
    return order, cycles


def package_dirs(packages: Sequence[str]) -> list[str]:
    """Every directory of each (possibly namespace) package, across all of sys.path."""
    dirs = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None:
            raise ModuleNotFoundError(f"package {name!r} is not importable from this interpreter's sys.path")
        dirs += list(spec.submodule_search_locations or [os.path.dirname(spec.origin or "")])
    return dirs


def preload(packages: Sequence[str] = (), paths: Sequence[str] = ()) -> list[str]:
    """dlopen every library under the packages / directories, dependencies first. Returns the paths.

    A library that still fails to load raises OSError naming it and what it is missing.
    """
    dirs = [*package_dirs(packages), *paths]
    plan = analyse(scan(dirs), search=[p for p in sys.path if p])
    loaded = []
    for lib in plan.order:
        try:
            ctypes.CDLL(lib.path)
        except OSError as exc:
            lacking = [str(m) for m in plan.missing if m.library.path == lib.path]
            why = f" ({'; '.join(lacking)})" if lacking else ""
            raise OSError(f"preloading {lib.path} failed: {exc}{why}") from exc
        loaded.append(lib.path)
    return loaded


_PRELOAD_AGAIN = """
import os, sys
sys.path[:] = [{root!r}, *{path!r}]
from hardy.native.libs import preload
names = {names!r}
try:
    preload(packages=[p for p in names if not os.path.isdir(p)], paths=[p for p in names if os.path.isdir(p)])
except Exception as exc:
    print(f"{{type(exc).__name__}}: {{exc}}")
"""


def preload_failure(names: Sequence[str], env: Mapping[str, str], path: Sequence[str], cwd: str | None) -> str | None:
    """The error a worker's `preload_libs=` raised, as a fresh interpreter with the worker's
    environment, sys.path and folder meets it again: a worker that fails there exits before its
    crash file is open, so the parent has nothing of its own to say. None if it loads there."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = _PRELOAD_AGAIN.format(root=root, path=list(path), names=list(names))
    try:
        out = subprocess.run([sys.executable, "-c", code], env=dict(env), cwd=cwd, capture_output=True, text=True,
                             timeout=120).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out or None
