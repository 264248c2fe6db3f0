"""Which installed distribution a module's code comes from, and what identifies that code in a key.

Library code is keyed by the distribution that installed it — its name and version, read from its
`.dist-info` directory as `importlib.metadata` reads them — together with the distributions it
requires, transitively: scikit-learn's results depend on the SciPy it calls. That holds for modules
without `__version__` and for namespace packages (`google.*`, `opentelemetry.*`), whose subpackages
come from different distributions: a file belongs to the distribution whose RECORD lists it. A
distribution installed from a local directory or file (`pip install ./mypkg`, `pip install -e`) is
the user's code, keyed by content like any other (`origin.py` asks `is_local_install`); one
installed from version control adds its commit, one from a remote archive its hash. Each adds a
digest of the file hashes its RECORD lists: a wheel built locally, installed from a folder of wheels
or a private index (`--find-links`: no `direct_url.json`) and rebuilt with changed code under the
same version, is another distribution. The standard library and builtins are keyed by the Python
version, and a compiled module that no distribution installed (a C extension the user built in
place) by its file's content.

Not `importlib.metadata.packages_distributions()`: it reads every distribution's RECORD (about
170 ms with 200 distributions installed), which every worker process building a plan would pay.
Here one listing of a site directory finds the distributions whose name is the module's (numpy,
torch, pandas); RECORDs are read only for names that differ (`sklearn` from scikit-learn) and for
namespace packages, once per process.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

from blake3 import blake3

PYTHON = f"python {sys.implementation.name} {'.'.join(map(str, sys.version_info[:3]))} {sys.version_info[3]}"

_SEPARATORS = re.compile(r"[-_.]+")
_REQUIREMENT = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def normalize(name: str) -> str:
    """A distribution's or import name's comparable form (PEP 503, with `_` for `-`)."""
    lower = name.lower()
    return _SEPARATORS.sub("_", lower) if "-" in lower or "." in lower or "__" in lower else lower


class Distribution:
    """One installed distribution, read lazily from its `.dist-info` (or `.egg-info`) directory."""

    __slots__ = ("name", "version", "path", "site", "_record", "_tops", "_url", "_identity", "_content")

    def __init__(self, site: str, entry: str):
        self.site, self.path = site, os.path.join(site, entry)
        stem = entry.rsplit(".", 1)[0]
        name, _, rest = stem.partition("-")
        self.name, self.version = normalize(name), rest.split("-")[0]  # egg-info: name-version-pyX.Y
        self._record: bytes | None = None
        self._tops: frozenset[str] | None = None
        self._url: Any = ...
        self._identity: bytes | None = None
        self._content: str | None = None

    def record(self) -> bytes:
        """Its RECORD (or, for an egg, installed-files.txt made relative to the site directory):
        one installed file per line, '/'-separated, first."""
        if self._record is None:
            if self.path.endswith(".egg-info"):
                lines = _lines(os.path.join(self.path, "installed-files.txt"))
                found = (os.path.relpath(os.path.normpath(os.path.join(self.path, line)), self.site) for line in lines)
                self._record = "\n".join(f.replace(os.sep, "/") for f in found).encode()
            else:
                try:
                    with open(os.path.join(self.path, "RECORD"), "rb") as f:
                        self._record = f.read()
                except OSError:
                    self._record = b""
        return self._record

    def installed(self, rel: str) -> bool:
        """Whether it installed the file `rel`: a search of RECORD's text, not a parse (torch's
        lists 20,000 files)."""
        name = rel.encode()
        text = b"\n" + self.record()
        return any(b"\n" + form + end in text for form in (name, b'"' + name + b'"') for end in (b",", b"\n"))

    def tops(self) -> frozenset[str]:
        """The top-level import names it provides: top_level.txt, else the first part of each file."""
        if self._tops is None:
            listed = _lines(os.path.join(self.path, "top_level.txt"))
            firsts = listed or {line.split(b"/", 1)[0].split(b",", 1)[0].decode(errors="replace")
                                for line in self.record().splitlines() if not line.startswith(b"..")}
            self._tops = frozenset(t.split(".")[0] for t in firsts if t and not t.endswith(("-info", "__pycache__")))
        return self._tops

    def direct_url(self) -> dict[str, Any] | None:
        """PEP 610's record of where it was installed from; None when from an index."""
        if self._url is ...:
            import json  # only for a distribution asked about: `import hardy` stays light
            try:
                with open(os.path.join(self.path, "direct_url.json")) as f:
                    self._url = json.load(f)
            except (OSError, ValueError):
                self._url = None
        return self._url  # type: ignore[no-any-return]

    def is_local(self) -> bool:
        url = self.direct_url()
        return bool(url) and str(url.get("url", "")).startswith("file:")  # type: ignore[union-attr]

    def requires(self) -> list[str]:
        """The distributions it requires whatever extras were asked for (normalized names)."""
        meta = os.path.join(self.path, "PKG-INFO" if self.path.endswith(".egg-info") else "METADATA")
        found = []
        for line in _lines(meta, headers=True):
            if line.startswith("Requires-Dist:"):
                requirement, _, marker = line[len("Requires-Dist:"):].partition(";")
                name = _REQUIREMENT.match(requirement)
                if name and "extra" not in marker:
                    found.append(normalize(name.group(1)))
        return found

    def origin(self) -> str:
        """What besides its version tells two installs apart: a VCS commit, a remote archive's hash."""
        url = self.direct_url() or {}
        vcs, archive = url.get("vcs_info") or {}, url.get("archive_info") or {}
        if vcs:
            return f"@{vcs.get('commit_id', '')}"
        if archive:
            return f"@{url.get('url', '')}#{archive.get('hash') or archive.get('hashes') or ''}"
        return ""

    def content(self) -> str:
        """A digest of the files it installed, as its RECORD hashes them: what tells apart two builds
        of one version (a wheel rebuilt locally with changed code and installed from a folder of
        wheels); "" without a RECORD that hashes them (an egg, a conda or distro package), where
        the version alone tells. Read once per process, like the code loaded from it."""
        if self._content is None:
            self._content = "" if self.path.endswith(".egg-info") else _record_digest(self.record())
        return self._content


# The installer's own files in `.dist-info`, which the wheel did not hold: they differ between two
# installs of one wheel (REQUESTED is there only for a distribution asked for by name).
_INSTALLER_FILES = frozenset({b"RECORD", b"INSTALLER", b"REQUESTED", b"direct_url.json"})


def _record_digest(record: bytes) -> str:
    """RECORD's lines that hash a file inside the site directory (path, hash, size), sorted, hashed.
    Left out: lines without a hash (the `.pyc` files pip compiles), paths out of the site directory
    (`../../../bin/` scripts, whose shebang and place differ by install layout) and the installer's
    own files. One pass of string tests, no CSV parse: torch's RECORD lists 15,000 files."""
    rows = sorted(line for line in record.splitlines()
                  if not line.endswith(b",,") and not line.startswith((b"..", b'"..'))
                  and (b".dist-info/" not in line or not _installer_file(line)))
    return "#record:" + blake3(b"\n".join(rows)).hexdigest(16) if rows else ""


def _installer_file(line: bytes) -> bool:
    """Whether a RECORD line is of a file the installer wrote into the top `.dist-info` folder."""
    folder, _, base = line.rsplit(b",", 2)[0].strip(b'"').rpartition(b"/")
    return base in _INSTALLER_FILES and folder.endswith(b".dist-info") and b"/" not in folder


def _lines(path: str, headers: bool = False) -> list[str]:
    """A small text file's non-empty lines (`headers`: up to the first empty one); none if absent."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            found = []
            for line in f:
                line = line.strip()
                if not line:
                    if headers:
                        break
                    continue
                found.append(line)
            return found
    except OSError:
        return []


class Site:
    """A directory on sys.path and the distributions installed into it, listed once per process."""

    def __init__(self, root: str):
        self.root = root
        self.dists: dict[str, Distribution] = {}
        try:
            entries = sorted(e.name for e in os.scandir(root))
        except OSError:
            entries = []
        for entry in entries:
            if entry.endswith((".dist-info", ".egg-info")):
                d = Distribution(root, entry)
                self.dists.setdefault(d.name, d)
        self._entries = entries
        self._rounds: tuple[list[Distribution], ...] | None = None
        self._owners: list[dict[str, list[Distribution]]] = []

    def owner(self, rel: str) -> Distribution | None:
        """The distribution that installed `rel` (a path relative to this directory)."""
        top = rel.split("/")[0]
        name = top.split(".")[0]
        package = rel == top or os.path.isfile(os.path.join(self.root, top, "__init__.py"))  # not a namespace
        found = self.dists.get(normalize(name))
        if found is not None and package:
            return found  # a regular package or module named as its distribution: numpy, torch
        for owners in self.owners():
            candidates = owners.get(name, [])
            if len(candidates) == 1 and package:
                return candidates[0]
            found = next((d for d in candidates if d.installed(rel)), None)  # a namespace package's part
            if found is not None:
                return found
        return None

    def owners(self) -> Iterator[dict[str, list[Distribution]]]:
        """Top-level import name -> the distributions providing it, a round of distributions at a
        time (the second is read only if the first does not have the name)."""
        if self._rounds is None:
            importable = {normalize(e.split(".")[0]) for e in self._entries  # a package's folder, a module's file
                          if "." not in e or e.endswith((".py", *_EXTENSIONS))}
            # Read first for a name that is not a distribution's: those not named as any module here
            # (scikit-learn for sklearn, protobuf for google.protobuf).
            self._rounds = ([d for d in self.dists.values() if d.name not in importable],
                            [d for d in self.dists.values() if d.name in importable])
        for k, dists in enumerate(self._rounds):
            if len(self._owners) == k:
                owners: dict[str, list[Distribution]] = {}
                for d in dists:
                    for top in d.tops():
                        owners.setdefault(top, []).append(d)
                self._owners.append(owners)
            yield self._owners[k]

    def providers(self, name: str) -> list[Distribution]:
        """Every distribution providing a part of the top-level package `name`."""
        return [d for owners in self.owners() for d in owners.get(name, [])]

_SITES: dict[str, Site] = {}
_ROOTS: dict[tuple[tuple[str, ...], bool], tuple[str, ...]] = {}
_REAL: dict[str, str] = {}


@functools.cache
def folders(*kinds: str) -> tuple[str, ...]:
    """The real paths of these `sysconfig` folders ("stdlib", "purelib"...), each once and ending in
    a separator (a path is in one when it starts with it), asked for when first needed: a fork
    server imports this module before it can fork, and `sysconfig` takes a while to answer."""
    import sysconfig
    paths = sysconfig.get_paths()
    return tuple(dict.fromkeys(os.path.join(os.path.realpath(paths[k]), "") for k in kinds if paths.get(k)))


def _in_stdlib(root: str) -> bool:
    return "-packages" not in root and os.path.join(root, "").startswith(folders("stdlib", "platstdlib"))


def _real(path: str) -> str:
    found = _REAL.get(path)
    if found is None:
        found = _REAL[path] = os.path.realpath(path)
    return found


def _roots(longest_first: bool = True) -> tuple[str, ...]:
    """The directories on sys.path, real paths: longest first (the innermost one holding a file is
    where it was imported from), or in sys.path's order (where a name is imported from)."""
    key = (tuple(sys.path), longest_first)
    found = _ROOTS.get(key)
    if found is None:
        ordered = tuple(dict.fromkeys(_real(p or os.curdir) for p in sys.path))
        found = _ROOTS[key] = tuple(sorted(ordered, key=len, reverse=True)) if longest_first else ordered
    return found


def _site(root: str) -> Site:
    site = _SITES.get(root)
    if site is None:
        site = _SITES[root] = Site(root)
    return site


def site_of(path: str) -> tuple[Site, str] | None:
    """The sys.path directory holding `path`, and the path relative to it ('/'-separated)."""
    path = _real(path)
    for root in _roots():
        if path.startswith(root + os.sep):
            return _site(root), path[len(root) + 1:].replace(os.sep, "/")
    return None


def is_local_install(path: str) -> bool:
    """Whether the file was installed by a distribution from a local directory or file: the user's
    own package (`pip install ./mypkg`), keyed by content, not by a version it may keep while edited."""
    found = site_of(path)
    owner = found[0].owner(found[1]) if found is not None else None
    return owner is not None and owner.is_local()


def find(name: str, near: str) -> Distribution | None:
    """The installed distribution of that (normalized) name that Python would import from: looked
    for first in `near`, the site directory of the distribution requiring it."""
    found = _site(near).dists.get(name)
    if found is not None:
        return found
    for root in _roots(longest_first=False):
        if _in_stdlib(root):
            continue  # nothing is installed there
        found = _site(root).dists.get(name)
        if found is not None:
            return found
    return None


def identity(dist: Distribution) -> bytes:
    """A distribution with the ones it requires, transitively: name, version, origin and content of each."""
    if dist._identity is None:
        closure: dict[str, Distribution] = {}
        stack = [dist]
        while stack:
            d = stack.pop()
            if d.name in closure:
                continue
            closure[d.name] = d
            stack.extend(r for r in (find(name, d.site) for name in d.requires()) if r is not None)
        dist._identity = ";".join(f"{n}=={d.version}{d.origin()}{d.content()}"
                                  for n, d in sorted(closure.items())).encode()
    return dist._identity


_FILES: dict[str, bytes] = {}


def file_identity(path: str) -> bytes:
    """What identifies library code read from `path`: its distribution, Python's version for the
    standard library, else (no distribution installed it, or one from a local folder or file) the
    file's content."""
    found = _FILES.get(path)
    if found is None:
        found = _FILES[path] = _file_identity(path)
    return found


def _file_identity(path: str) -> bytes:
    if path.startswith("<frozen "):
        return PYTHON.encode()
    located = site_of(path)
    if located is not None:
        site, rel = located
        if _in_stdlib(site.root):
            return PYTHON.encode()  # the standard library, lib-dynload's extensions included
        dist = site.owner(rel)
        if dist is not None and not dist.is_local():  # installed from a local folder: the user's own build
            return identity(dist)
    return file_digest(path)


_DIGESTS: dict[str, bytes] = {}


def file_digest(path: str) -> bytes:
    """A file's content, hashed once per process: a loaded module's code does not change after
    import, whatever happens to its file."""
    found = _DIGESTS.get(path)
    if found is None:
        h = blake3()
        try:
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            found = b"file:" + h.hexdigest(16).encode()
        except OSError as exc:
            from ..errors import UnhashableError
            raise UnhashableError(f"cannot read {path} to key the code loaded from it: {exc}") from None
        _DIGESTS[path] = found
    return found


_MODULES: dict[tuple[str, str | None], bytes] = {}


def module_identity(name: str) -> bytes:
    """What identifies the library code of module `name` (see the module docstring)."""
    key = (name, getattr(sys.modules.get(name), "__file__", None))  # a name imported again from elsewhere
    found = _MODULES.get(key)
    if found is None:
        found = _MODULES[key] = _module_identity(name)
    return found


def _module_identity(name: str) -> bytes:
    if name.split(".")[0] == "hardy":
        return f"hardy {getattr(sys.modules.get('hardy'), '__version__', '')}".encode()
    module = sys.modules.get(name)
    if module is not None:
        return _spec_identity(getattr(module, "__file__", None), list(getattr(module, "__path__", None) or ()))
    spec = _unimported(name)  # imported inside a node, not here
    if spec is None:
        return PYTHON.encode() if name in sys.builtin_module_names else b"absent:" + name.encode()
    return _spec_identity(spec.origin, list(spec.submodule_search_locations or ()))


def _unimported(name: str) -> Any:
    """The spec of a module not imported, found without running any of its code: a top-level name
    by every finder, a submodule in its deepest imported parent's folders."""
    import importlib.util
    from importlib.machinery import PathFinder
    parts, spec, search = name.split("."), None, None
    for i in range(len(parts)):
        prefix = ".".join(parts[:i + 1])
        module = sys.modules.get(prefix)
        try:
            if module is not None:
                spec, search = getattr(module, "__spec__", None), getattr(module, "__path__", None)
                continue
            spec = importlib.util.find_spec(prefix) if i == 0 else PathFinder.find_spec(prefix, search)
        except (ImportError, ValueError):
            return spec
        search = getattr(spec, "submodule_search_locations", None)
        if search is None:  # a module, or nothing: what follows are attributes
            return spec
    return spec


def _spec_identity(origin: str | None, locations: list[str]) -> bytes:
    if origin and os.path.isabs(origin):
        return file_identity(origin)
    if locations:  # a namespace package: every distribution providing a part of it
        parts: set[bytes] = set()
        for location in locations:
            located = site_of(os.path.join(location, "__init__.py"))
            if located is not None:
                site, rel = located
                parts.update(identity(d) for d in site.providers(rel.split("/")[0]))
            else:
                parts.add(b"dir:" + location.encode())
        return b"|".join(sorted(parts))
    return PYTHON.encode()  # built into the interpreter: sys, builtins, _io


def is_extension(path: str | None) -> bool:
    """Whether a module's file is compiled code (a C extension, Cython), which has no bytecode to read."""
    return bool(path) and path.endswith(tuple(_EXTENSIONS))  # type: ignore[union-attr]


_EXTENSIONS = (".so", ".pyd", ".dylib")
