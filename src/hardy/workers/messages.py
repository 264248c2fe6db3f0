"""What the parent and a worker say to each other (the picture in `hardy/workers/__init__.py`).

Parent → worker: one pickled message per `recv_bytes`, big array buffers out of band
(`shipping.transport`). Worker → parent: a `Header` packed in front of each batch of results, so the
parent learns what the batch is before it unpickles anything.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

from ..shipping.context import Settings


class Setup(NamedTuple):
    """The first message: the parent's environment now (a fork server's dates from its start)."""

    environ: dict[str, str]
    preload_libs: tuple[str, ...]
    sys_path: list[str]
    cwd: str
    argv: list[str]
    umask: int
    settings: Settings


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
    the umask and the interpreter's settings whole (docs/same-answer.md)."""

    environ: dict[str, str]
    unset: list[str]
    cwd: str
    argv: list[str]
    sys_path: list[str]
    umask: int
    settings: Settings


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
