"""The calling process's state that a node can read besides its inputs and modules: environment
variables, working directory, `sys.argv` and `sys.path`. A worker takes them at each call, as the
caller has them then (docs/same-answer.md), so a node reading `os.environ["MODE"]` or a relative
path computes what it would compute in the caller.

`current()` is on every call's path, so it answers from the snapshot it made last whenever nothing
changed: four comparisons, about a microsecond, and the same object, which a worker that already
has it recognises by identity.
"""

from __future__ import annotations

import os
import sys
from typing import Any, NamedTuple


class Snapshot:
    """The process state at one moment; compared by identity (`current` reuses one while it holds)."""

    __slots__ = ("environ", "cwd", "argv", "sys_path", "umask", "_raw")

    def __init__(self) -> None:
        self._raw: Any = dict(_raw_environ())
        self.environ: dict[str, str] = dict(os.environ)
        self.cwd = _cwd()
        self.argv: list[str] = list(sys.argv)
        self.sys_path: list[str] = list(sys.path)
        self.umask = _umask()

    def travelling(self) -> Travelling:
        """What of this state goes to an engine's worker on another machine (`arrived`): the
        variables this process set or removed since it started (not the machine's own; a variable
        set at an earlier call and removed since counts as removed), its working directory, argv,
        umask and sys.path (its entries that exist there, ahead of that machine's own)."""
        started = _started_with()
        changed, unset = environ_delta(started, self.environ)
        _SET.update(changed)
        unset += [name for name in _SET if name not in self.environ and name not in started]
        return Travelling(changed, unset, self.cwd, self.argv, self.umask, self.sys_path)

    def holds(self) -> bool:
        return (self.sys_path == sys.path and self.argv == sys.argv and self._raw == _raw_environ()
                and self.cwd == _cwd())


def _raw_environ() -> Any:
    """os.environ's own mapping (encoded keys and values on POSIX): comparing it is the cheap way
    to learn that nothing was set or removed (the public mapping decodes every item)."""
    return getattr(os.environ, "_data", os.environ)


def _cwd() -> str:
    try:
        return os.getcwd()
    except OSError:  # removed under us: a worker keeps its own
        return ""


_LAST: list[Snapshot] = []


def current() -> Snapshot:
    """The process state now: the last snapshot while nothing changed, else a new one."""
    last = _LAST[0] if _LAST else None
    if last is not None and last.holds():
        return last
    snapshot = Snapshot()
    _LAST[:] = [snapshot]
    return snapshot


class Travelling(NamedTuple):
    """The caller's state as it travels to an engine's worker (`Snapshot.travelling`)."""

    environ: dict[str, str]
    unset: list[str]
    cwd: str
    argv: list[str]
    umask: int
    sys_path: list[str]

    def arrived(self) -> Snapshot:
        """This process's state with the caller's on top: its variables, its argv, and its working
        directory where that exists here (on another machine it may not: the worker keeps its own)."""
        here = Snapshot()
        for name in self.unset:
            here.environ.pop(name, None)
        here.environ.update(self.environ)
        here.argv = list(self.argv)
        here.umask = self.umask
        here.sys_path = self.import_path()
        if self.cwd and os.path.isdir(self.cwd):
            here.cwd = self.cwd
        return here

    def import_path(self) -> list[str]:
        """The caller's sys.path entries that exist here, in its order, then this process's others:
        what an engine's worker imports the caller's modules with (`take_import_path`)."""
        theirs = [p for p in self.sys_path if not p or os.path.isdir(p)]  # ('': the working directory)
        return theirs + [p for p in sys.path if p not in theirs]

    def take_import_path(self) -> None:
        """Make this process's sys.path `import_path()`: an engine's worker process, before it loads
        a plan whose modules the caller may have imported from a folder it added at run time. (In
        the caller's own process, an engine running tasks in threads, it is the same list.)"""
        if sys.path != self.sys_path:
            sys.path[:] = self.import_path()


_SET: set[str] = set()  # the variables this process set since it started, as far as calls saw them


def _umask() -> int:
    """This process's umask, read where reading does not mean setting it (os.umask would change it
    for the other threads meanwhile). Read as a snapshot is made, not at every call: a umask set
    between two calls that change nothing else is not seen (docs/same-answer.md)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def _started_with() -> dict[str, str]:
    """The environment this process was started with (Linux keeps it in /proc/self/environ;
    elsewhere, none: every variable counts as set)."""
    try:
        with open("/proc/self/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    pairs = (entry.split(b"=", 1) for entry in raw.split(b"\0") if b"=" in entry)
    return {os.fsdecode(k): os.fsdecode(v) for k, v in pairs}


def environ_delta(before: dict[str, str], after: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """(variables set or changed, variables removed) from `before` to `after`."""
    changed = {k: v for k, v in after.items() if before.get(k) != v}
    return changed, [k for k in before if k not in after]
