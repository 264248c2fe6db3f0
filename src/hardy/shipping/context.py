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
from typing import Any


class Snapshot:
    """The process state at one moment; compared by identity (`current` reuses one while it holds)."""

    __slots__ = ("environ", "cwd", "argv", "sys_path", "_raw")

    def __init__(self) -> None:
        self._raw: Any = dict(_raw_environ())
        self.environ: dict[str, str] = dict(os.environ)
        self.cwd = _cwd()
        self.argv: list[str] = list(sys.argv)
        self.sys_path: list[str] = list(sys.path)

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


def environ_delta(before: dict[str, str], after: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """(variables set or changed, variables removed) from `before` to `after`."""
    changed = {k: v for k, v in after.items() if before.get(k) != v}
    return changed, [k for k in before if k not in after]
