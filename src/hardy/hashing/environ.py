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

The local time zone is part of the environment too (`TZ`, else /etc/localtime, as `time.tzset()`
last read them): `datetime.fromtimestamp(ts)` computes another value under another zone. A function
whose code uses local time (`reads_zone`) has the zone in its key, by what `time.localtime`
computes with it (`zone`), so a cache shared across zones keeps the entries of every other node.
"""

from __future__ import annotations

import functools
import os
import re
import time
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


def keyed_environment(func: Any, chains: dict[tuple[str, str], set[tuple[str, ...]]],
                      out: Callable[[bytes], Any]) -> None:
    """What of the environment the function's code reads, into its key: each variable it may name,
    with its value now, where it reads variables (`reads_variables`), and the local time zone
    where it uses local time (`reads_zone`); each noted as read, so that a plan made under one
    value is stale under another."""
    if reads_zone(func, chains):
        keyed_zone(out)
    if reads_variables(func, chains):
        keyed_variables(func, out)


def reads_variables(func: Any, chains: dict[tuple[str, str], set[tuple[str, ...]]]) -> bool:
    """Whether the function's code reads environment variables: through `os` (a global, a closure
    value, or imported inside it) by one of `_READERS`, or through what `from os import ...` bound."""
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
    """Each variable the function may name, with its value now (or that it is unset), into the key."""
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


# Names whose call computes with the local zone whatever object they are read from (a datetime
# given as an input: `dt.timestamp()` of a naive one, `dt.astimezone()`), and the `time` module's
# own (`time.strftime("%Z", t)`, `time.timezone`; not `time.time()`, the same in every zone).
LOCAL_TIME = frozenset({"fromtimestamp", "timestamp", "astimezone", "localtime", "mktime", "tzlocal", "gettz",
                        "get_localzone", "tzset"})
TIME_ZONED = frozenset({"localtime", "mktime", "ctime", "asctime", "strftime", "strptime", "tzname", "timezone",
                        "altzone", "daylight", "tzset"})


def reads_zone(func: Any, chains: dict[tuple[str, str], set[tuple[str, ...]]]) -> bool:
    """Whether the function's code computes with the local time zone: it names one of `LOCAL_TIME`
    (its nested code too), reads one of `TIME_ZONED` from the `time` module or the module whole, or
    holds such a function (`from time import strftime`, `to_local = datetime.fromtimestamp` as a
    global, a closure value or a default). A library that reads the zone inside its own code
    (`email.utils.formatdate(localtime=True)`) is not seen (docs/caching.md)."""
    stack = [func.__code__]
    while stack:
        code = stack.pop()
        if not LOCAL_TIME.isdisjoint(code.co_names):
            return True
        stack.extend(k for k in code.co_consts if isinstance(k, types.CodeType))
    globs = getattr(func, "__globals__", {})
    cells = dict(zip(func.__code__.co_freevars, getattr(func, "__closure__", None) or ()))
    held: list[Any] = [*(func.__defaults__ or ()), *(func.__kwdefaults__ or {}).values()]
    for (kind, name), attrs in chains.items():
        value = (globs.get(name) if kind == "g" else _contents(cells.get(name)) if kind == "c"
                 else time if kind in ("import", "from") and name == "time" else None)
        if value is time:
            if any(not chain or chain[0] in TIME_ZONED for chain in attrs):
                return True
        else:
            held.append(value)
    return any(_zoned(value) for value in held)


def _zoned(value: Any, depth: int = 0) -> bool:
    """A function that computes with the local zone: the `time` module's (`TIME_ZONED`), or one
    named as `LOCAL_TIME` are (`datetime.fromtimestamp`, a bound method of the class); also inside
    a `partial`, or as a value of a dict, list or tuple (`CONVERTERS = {"local": ...}`)."""
    if isinstance(value, functools.partial):
        return _zoned(value.func, depth)
    if type(value) in (dict, list, tuple) and depth < 2:
        return any(_zoned(v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    name = getattr(value, "__name__", None) if callable(value) else None
    if not isinstance(name, str):
        return False
    return name in LOCAL_TIME or (name in TIME_ZONED and getattr(value, "__module__", None) == "time")


def keyed_zone(out: Callable[[bytes], Any]) -> None:
    """The local zone (`zone`) into the key, noted as read: a plan keyed under one zone is stale
    after `time.tzset()` (which makes `time.tzname` a new tuple) and after `TZ` is set or removed
    (a worker takes it, with `tzset`, at its next call)."""
    out(b"zone:" + zone())
    note_read(vars(time), "tzname")
    note_read(Variable("TZ", os.environ.get("TZ")), "TZ")


def zone() -> bytes:
    """The local zone as `time.localtime` computes with it, by what it computes: its offset, daylight
    saving flag and abbreviation at the start of 1900 and at each change up to 2040 (found every 27
    days, then to the second). Two names for one zone (`Asia/Tokyo`, `Japan`), or one zone from two
    installs of the time zone database that agree, give one key; the zone as the C library holds it,
    not as `TZ` says (`TZ` set without `time.tzset()` changes nothing it computes). About 2 to 9 ms, once
    per zone a process takes (kept until `time.tzset()` makes `time.tzname` a new tuple)."""
    kept = _ZONE[0]
    if kept is not None and kept[0] is time.tzname:
        return kept[1]
    names = time.tzname
    state = _local_state
    changes, t, before = [(_START, state(_START))], _START, state(_START)
    while t < _END:
        nxt = t + _STEP
        after = state(nxt)
        if after != before:
            low, high = t, nxt
            while high - low > 1:  # (one change within 27 days: a zone's changes lie a month and more apart)
                mid = (low + high) // 2
                low, high = (mid, high) if state(mid) == before else (low, mid)
            changes.append((high, after))
        t, before = nxt, after
    made = repr((names, time.timezone, time.altzone, time.daylight, changes)).encode()
    _ZONE[0] = (names, made)
    return made


def _local_state(t: int) -> tuple[int, int, str]:
    lt = time.localtime(t)
    return lt.tm_gmtoff, lt.tm_isdst, lt.tm_zone


_START, _END, _STEP = -2208988800, 2208988800, 27 * 86400  # 1900-01-01 to 2040-01-01, UTC
_ZONE: list[tuple[Any, bytes] | None] = [None]  # (time.tzname when it was read, `zone()`)
