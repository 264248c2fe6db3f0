"""Environment variables a function reads, in its fingerprint.

`os.environ.get("MODE")`, `os.environ["MODE"]`, `os.getenv("MODE")`, `"MODE" in os.environ`, and
the same through `from os import environ, getenv` or `import os` inside the function: the node
computes with the value, so the value is part of its key (a result cached under `MODE=fast` is
never served under `MODE=exact`), and a pipeline compiles its plan again when one changes between
two calls. Which variables: every name written as environment variables are (upper case: `MODE`,
`HF_HOME`) that the function's code holds as a string constant (its nested code's too) or reads
as a global string (`NAME = "MODE"; os.environ.get(NAME)`), wherever that code reads the
environment at all. The bytecode cannot tell which constant reaches the lookup (`key = "MODE";
os.environ[key]`), and a constant that names no variable costs one lookup a call (about 0.5 us)
and nothing else. A lower-case name (`http_proxy`), a name built at run time (`os.environ[prefix +
"MODE"]`) or the environment read whole (`dict(os.environ)` handed to a subprocess) is not seen
(docs/caching.md). A variable a node sets in this process is read as any other: the next call
compiles its plan again, with the value it then holds.
"""

from __future__ import annotations

import os
import re
import types
from collections.abc import Callable
from typing import Any

from .reach import note_read

_READERS = ("environ", "environb", "getenv", "getenvb")  # what `os` reads the environment through
_NAME = re.compile(r"(?=[A-Z0-9_]*[A-Z])[A-Z_][A-Z0-9_]{0,254}\Z")  # written as a variable's name is


def is_environment(value: Any) -> bool:
    """`os.environ` or `os.environb` itself, read as a global (`from os import environ`): its
    variables count by name (`keyed_variables`), not as one mapping whose content is every
    variable of the process (which would change the key in every shell)."""
    return value is os.environ or value is getattr(os, "environb", None)


def reads_environment(func: Any, chains: dict[tuple[str, str], set[tuple[str, ...]]]) -> bool:
    """Whether the function's code reads the environment: through `os` (a global, a closure value,
    or imported inside it) by one of `_READERS`, or through what `from os import ...` bound."""
    globs = getattr(func, "__globals__", {})
    cells = dict(zip(func.__code__.co_freevars, getattr(func, "__closure__", None) or ()))
    for (kind, name), attrs in chains.items():
        if kind == "g":
            value = globs.get(name)
        elif kind == "c":
            value = _contents(cells.get(name))
        elif kind in ("import", "from"):
            value = os if name == "os" else None
        else:
            continue
        if value is os:
            if any(chain and chain[0] in _READERS for chain in attrs):
                return True
        elif value is not None and any(value is getattr(os, r, None) for r in _READERS):
            return True
    return False


def keyed_variables(func: Any, out: Callable[[bytes], Any]) -> None:
    """Each variable the function may name, with its value now (or that it is unset), into the
    key; and noted as read, so that a plan made with one value is stale under another."""
    for name in sorted(_names(func)):
        value = os.environ.get(name)
        said = b"\0unset" if value is None else b"=" + value.encode("utf-8", "surrogateescape")
        out(b"env:" + name.encode("utf-8", "surrogateescape") + said)
        note_read(Variable(name, value), name)


def _names(func: Any) -> set[str]:
    """The strings the function can pass as a name: its code's constants (a tuple of them too:
    `for k in ("A", "B")`), the globals its code reads (a string, or a tuple, list or set of
    them), and its defaults (`def f(x, key="MODE")`), its nested code's as well."""
    globs = getattr(func, "__globals__", {})
    names: set[str] = set()
    values: list[Any] = [*(func.__defaults__ or ()), *(func.__kwdefaults__ or {}).values()]
    stack = [func.__code__]
    while stack:
        c = stack.pop()
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
        values += [*c.co_consts, *(globs.get(n) for n in c.co_names)]
    for value in values:
        for text in value if isinstance(value, (tuple, list, set, frozenset)) else (value,):
            if isinstance(text, str) and _NAME.match(text):
                names.add(text)
    return names


def _contents(cell: Any) -> Any:
    try:
        return cell.cell_contents if cell is not None else None
    except ValueError:  # an empty cell
        return None


class Variable:
    """One environment variable read as a namespace of one name (`Reach.changed` calls `get`):
    True while it holds the value the key was made with (None: unset). Looked up in `os.environ`'s
    encoded mapping (`_data`, where every set puts a new object): a dict look-up, where
    `os.environ.get` encodes and decodes (0.5 us a name); by value where a test or a script
    replaced `os.environ` with a mapping of its own (`monkeypatch.setattr(os, "environ", ...)`)."""

    __slots__ = ("key", "found", "value")

    def __init__(self, name: str, value: str | None):
        self.value = value
        own = os.environ is _ENVIRON
        self.key = _ENVIRON.encodekey(name) if own else None
        self.found = _DATA.get(self.key) if own else None

    def get(self, name: str, default: Any = None) -> Any:
        if self.key is not None and os.environ is _ENVIRON:
            return True if _DATA.get(self.key) is self.found else default
        return True if os.environ.get(name) == self.value else default


_ENVIRON = os.environ  # the process's own: its mapping `_data` is replaced by no one
_DATA: dict[Any, Any] = os.environ._data  # type: ignore[attr-defined]
