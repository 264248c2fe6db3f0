"""What the parent and a worker say to each other (the picture in `hardy/workers/__init__.py`).

Parent → worker: one pickled message per `recv_bytes`, big array buffers out of band
(`shipping.transport`). Worker → parent: a `Header` packed in front of each batch of results, so the
parent learns what the batch is before it unpickles anything.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
from importlib.machinery import ExtensionFileLoader, SourceFileLoader, SourcelessFileLoader
from types import ModuleType
from typing import Any, NamedTuple

from ..shipping.context import Settings


class Origins:
    """Stands for `loaded_from()` in a message: pickled as that table when the message is (the
    worker receives the dict), from a pickle made once per table. A `Context` sent at each call
    that sets a variable pays a copy of bytes, not a pickling of the table."""

    def __reduce__(self) -> tuple[Any, ...]:
        table = loaded_from()
        kept = _PICKLED[0]
        if kept[0] is not table:
            kept = _PICKLED[0] = (table, pickle.dumps(table, protocol=5))
        return pickle.loads, (kept[1],)


def loaded_from() -> dict[str, tuple[str, ...]]:
    """By name, the folder each top-level module or package this process loaded from a file lies
    in (a namespace package's: each of its folders'). Left out: names whose file is not theirs (an
    alias, a module a custom importer named), relative or not loaded by a path-based loader. Made
    again only once the number of loaded modules changed."""
    count = len(sys.modules)
    known = _LOADED[0]
    if known[0] == count:
        return known[1]
    found: dict[str, tuple[str, ...]] = {}
    folders: dict[str, str] = {}  # each folder one string: pickled once
    for name, module in list(sys.modules.items()):
        if "." in name:
            continue
        try:  # (the module's own attribute: a lazy module's `__getattribute__` would load it)
            spec = ModuleType.__getattribute__(module, "__spec__")
        except (AttributeError, TypeError):  # (TypeError: not a module)
            continue
        places = _places(name, spec)
        if places:
            found[name] = tuple(folders.setdefault(d, d) for d in map(os.path.dirname, places))
    _LOADED[0] = (count, found)
    return found


def _places(name: str, spec: Any) -> list[str]:
    """Where module `name` was loaded from (a package: its folder; a namespace package: each of
    its folders), where each is absolute and named after it; else none."""
    if spec is None or spec.name != name:
        return []
    if isinstance(spec.loader, _PATH_LOADERS) and spec.origin:
        places = [spec.origin if spec.submodule_search_locations is None else os.path.dirname(spec.origin)]
    elif spec.origin is None and spec.submodule_search_locations is not None:  # (a namespace package)
        places = list(spec.submodule_search_locations)
    else:
        return []
    ok = all(os.path.isabs(p) and os.path.basename(p).partition(".")[0] == name for p in places)
    return places if ok else []


_LOADED: list[tuple[int, dict[str, tuple[str, ...]]]] = [(-1, {})]  # `loaded_from`'s last: modules loaded then, table
_PICKLED: list[tuple[Any, bytes]] = [(None, b"")]  # that table, and its pickle (`Origins`)
_PATH_LOADERS = (SourceFileLoader, SourcelessFileLoader, ExtensionFileLoader)  # (an editable install's too)
ORIGINS = Origins()


class Setup(NamedTuple):
    """The first message: the parent's environment now (a fork server's dates from its start).
    `origins`: where the parent's top-level modules came from, as it is sent (`Origins`)."""

    environ: dict[str, str]
    preload_libs: tuple[str, ...]
    sys_path: list[str]
    cwd: str
    argv: list[str]
    umask: int
    settings: Settings
    origins: Origins | dict[str, tuple[str, ...]] = ORIGINS


class PlanSpec(NamedTuple):
    """A pipeline to compile, once per worker per plan; chunks name it by `plan_id`. `dated`: its
    node calls note when they begin (the parent enforces a timeout, or reports stalls)."""

    plan_id: int
    spec: bytes
    dated: bool = True


class Chunk(NamedTuple):
    """Items to run: `items` are (index, inputs) pairs. `log`: log node events (the parent
    listens); `sealed`: each input pickled on its own (1), and each result sent alone (2);
    `singly`: batched nodes take one item per call; `poison`: nested items that crashed a worker
    before (`crash.containment.poisoned_here`)."""

    plan_id: int
    items: list[tuple[int, Any]]
    log: bool
    sealed: int
    singly: bool
    poison: dict[Any, Any] | None

    def wire(self) -> tuple[Any, ...]:
        """What is pickled: a plain (plan_id, items) pair when the rest is as usual (most chunks), read
        back as such by the worker; a named tuple costs a class lookup each way. (A chunk of
        consecutive items goes shorter still: (plan_id, first item, their inputs), `WorkerPool.chunk_message`.)"""
        if self.log or self.sealed or self.singly or self.poison:
            return self
        return self.plan_id, self.items


class Context(NamedTuple):
    """The caller's process state at this call, where it changed since the worker last heard: the
    environment's changed and removed variables, then the working directory, sys.argv, sys.path,
    the umask and the interpreter's settings whole (docs/same-answer.md); and, as `Setup`'s,
    where its top-level modules came from (a module loaded since changes the state: `Snapshot.holds`)."""

    environ: dict[str, str]
    unset: list[str]
    cwd: str
    argv: list[str]
    sys_path: list[str]
    umask: int
    settings: Settings
    origins: Origins | dict[str, tuple[str, ...]] = ORIGINS


class Values(NamedTuple):
    """The answer to a worker's `Header.need`: the caller's objects it asked for, by (module,
    name), or why one cannot be sent (`shipping.replica`)."""

    replica: int
    values: dict[tuple[str, str], Any] | str


class Resend(NamedTuple):
    """Results of the last chunk again, each pickled on its own (a batch was unreadable)."""

    items: list[int]


class Stop(NamedTuple):
    """Flush and leave (`os._exit`: no native finaliser runs)."""


class Header(NamedTuple):
    """In front of each batch of results: the chunk is done; the batch was pickled item by item
    (a `Resend`'s); it carries node logs; the chunk could not be unpickled (the batch is then
    why); log records ride with it; seconds the chunk took. `need`: no batch but a question: the
    worker, loading a plan, asks for the caller's objects named after it (answered by `Values`).
    `outputs`: every item of the batch succeeded, and it holds only their outputs, those of the
    items `first`, `first` + 1, ... (the common batch: no (item, ok) pair per item to pickle and
    read); `columns`: those outputs as a plan's own loop keeps them (`Plan.each`), a list of
    values per output, which the parent makes result dicts (`plan.source.columns_to_dicts`)."""

    done: bool
    each: bool
    logged: bool
    unread: bool
    logs: bool
    elapsed: float
    need: bool = False
    outputs: bool = False
    columns: bool = False
    first: int = -1

    def pack(self) -> bytes:
        return HEADER.pack(*self)

    @classmethod
    def unpack(cls, data: bytes) -> Header:
        return cls(*HEADER.unpack_from(data))


HEADER = struct.Struct("=?????d???q")  # `Header`'s layout (packed straight from its fields where speed counts)
HEADER_SIZE = HEADER.size
_PLAIN = HEADER.pack(True, False, False, False, False, 0.0, False, True, False, 0)
_FLAGS = slice(struct.calcsize("=?????d"), struct.calcsize("=?????d???"))  # need, outputs, columns


def plain_outputs(data: bytes) -> bool:
    """Whether `data` is a chunk done whose batch is outputs only (as dicts), with no log and no question."""
    return data.startswith(_PLAIN[:5]) and data[_FLAGS] == _PLAIN[_FLAGS]
