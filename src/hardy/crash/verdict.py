"""What becomes of the item a worker died on: the error it fails with, and whether it runs again.

The worker pool (`workers/deaths.py`) knows which item was in flight and keeps the queues; it
asks `charge` what the death means for that item and applies the `Verdict`: fail the item, run
it again (its node's retries), or, for a crash inside a nested map that keeps going
(on_error="continue"), run it again with that inner item failed as it crashed (`poison`), so
that only the inner item is lost, as in-process. `split` is the same decision for a batched
node's call that several items shared.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import NodeCrashed, NodeTimeout
from .autopsy import Ending, examine
from .containment import BATCH

if TYPE_CHECKING:
    from ..model.node import Node

MAX_NESTED_CRASHES = 100  # inner items of one nested map that may crash workers before its outer item fails

Poisoned = tuple[tuple[Any, ...], Any, NodeCrashed]  # (the nested map's (node, item) chain, inner item, its error)


@dataclass(frozen=True)
class Verdict:
    """`error`: what the item fails with (or what its retry is logged with: `said`); `retry`: it
    runs again, its node having retries left; `poison`: it runs again with the inner item of a
    nested map failed as it crashed (`crash.containment.poisoned_here`)."""

    error: NodeCrashed
    said: str
    retry: bool = False
    poison: Poisoned | None = None


def charge(end: Ending, item: int, node: Node | None, inputs: dict[str, Any] | None, attempts: int,
           poison: Mapping[tuple[Any, ...], Mapping[Any, Any]], thread: str = "") -> Verdict:
    """The verdict on `item`, in flight in node `node` when its worker ended so. `attempts`: its
    runs that failed before; `poison`: the inner items already failed so, per nested map;
    `thread`: where a Python thread it died in came from (`, in thread 'x' (started by ...)`)."""
    record = end.record
    chain = record.nesting
    named = "/".join(str(level[0]) for level in chain) if len(chain) > 1 else node.name if node else "?"
    text = end.reason
    if record.exit_how and end.signal is None and not end.killed_for:  # it left on a node's word: which
        text = f"{text.partition(' (')[0]}: {record.exit_how}"
    death = examine(record, end.signal, text, named, record.stack, end.hang if end.killed_for == "timeout" else None)
    said = death.reason + thread
    cls = NodeTimeout if end.killed_for == "timeout" else NodeCrashed
    err = cls(node.name if node else "?", item, said, signal=end.signal, exitcode=end.exitcode, stack=record.stack,
              native_frames=death.frames, native_stack=death.native_stack, diagnosis=death.diagnosis, inputs=inputs)
    if isinstance(err, NodeTimeout):
        err.stacks = death.stacks
    err.threads = record.threads
    if len(chain) > 1:
        poisoned = _without(chain, err, _nested(err, chain, end.killed_for), poison)
        if poisoned is not None:
            return Verdict(err, said, poison=poisoned)
    return Verdict(err, said, retry=attempts + 1 <= (node.retries if node else 0))


def split(unsent: list[int], group: int) -> tuple[int | None, list[int], list[int]]:
    """A worker died in a batched node's call (docs/batching.md) whose batch is the first `group`
    of the items it had not answered (`unsent`; those before had their results sent, last words
    included): (the culprit, when the batch is one item, to charge as any item in flight; else
    the batch, to run again as one chunk whose batched calls take one item each, so that the
    culprit kills the worker running it alone; the items after it, which never reached the
    call, to run again as they were). Why not halves: each level of a bisection costs a worker
    death and start (~0.2 s with torch imported), so 64 items cost 7 deaths where this costs 2,
    and an innocent item alone costs only its own call."""
    suspects, rest = unsent[:group], unsent[group:]
    if len(suspects) == 1:
        return suspects[0], [], []  # the items after it stay unsent: they go back as a chunk
    return None, suspects, rest


def _without(chain: tuple[tuple[Any, ...], ...], err: NodeCrashed, crash: str,
             poison: Mapping[tuple[Any, ...], Mapping[Any, Any]]) -> Poisoned | None:
    """The inner item to fail when the item runs again, for a crash inside a nested map whose
    pipeline node keeps going (on_error="continue"). A crash in a batched node's call over several
    inner items names none of them: the item runs again with that map's batch calls taking one
    item each (inner item None), so that a second crash names it. None when no such map encloses
    the crash, or its inner item crashed before (the item itself fails)."""
    for k in range(len(chain) - 1, 0, -1):
        item = chain[k][1]
        if chain[k - 1][2] != "continue" or (item is None and chain[k][2] != BATCH):
            continue
        key = tuple((level[0], level[1]) for level in chain[:k])
        crashed = poison.get(key, {})
        if item in crashed or len(crashed) >= MAX_NESTED_CRASHES:
            return None
        inner = copy.copy(err)
        inner.node = "/".join(str(level[0]) for level in chain[k:])
        inner.inputs_summary = ""  # the inner item's inputs are not the outer item's
        inner.reason = crash
        return key, item, inner
    return None


def _nested(err: NodeCrashed, chain: tuple[tuple[Any, ...], ...], killed_for: str | None) -> str:
    """Names the crash of a worker inside a nested pipeline as an in-process failure would be: the
    path of nodes (`prep/tokenize`) and the item of each nested map on the way. Returns what
    happened, without where (the inner item's own error says that)."""
    err.node = "/".join(str(level[0]) for level in chain)
    if killed_for == "timeout" and chain[-1][3]:
        err.reason = f"node ran past its timeout of {chain[-1][3]:g} s"
    crash = err.reason or ""
    inner = [f"{level[0]!r} item {level[1]}" for level in chain[1:] if level[1] is not None]
    if inner:
        err.reason = f"{crash}, in nested map at {', '.join(inner)}"
    return crash
