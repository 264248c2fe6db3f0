"""What becomes of the items a worker died with: the error each fails with, and whether it runs again.

The worker pool (`workers/deaths.py`) knows which item was in flight and keeps the queues; it asks
this module what the death means and applies the answer. `charge`: the item in flight fails, runs
again (its node's retries), or, for a crash inside a nested map that keeps going
(on_error="continue"), runs again with that inner item failed as it crashed (`poison`), so that
only the inner item is lost, as in-process. `split`: the same decision for a batched node's call
that several items shared. `opening` and `between_items`: a death with no node running (unpickling
an input, a chunk or the pipeline, pickling results), where the chunk is sent again sealed
(`reseal`) or its items fail. A death in a thread the work did not start is `blame.elsewhere`'s.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import NodeCrashed, NodeTimeout, ShippingError
from .autopsy import Ending, examine
from .blame import Map, thread_clause
from .containment import BATCH
from .doing import LOADING, READING

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
           poison: Mapping[tuple[Any, ...], Mapping[Any, Any]], run: Map, spared: int) -> Verdict:
    """The verdict on `item`, in flight in node `node` of the map `run` when its worker ended so.
    `attempts`: its runs that failed before; `poison`: the inner items already failed so, per
    nested map; `spared`: the times it ran again after crashes in threads it did not start
    (`blame.elsewhere`), said with the thread it died in (`blame.thread_clause`)."""
    record = end.record
    chain = record.nesting
    named = "/".join(str(level[0]) for level in chain) if len(chain) > 1 else node.name if node else "?"
    text = end.reason
    if record.exit_how and end.signal is None and not end.killed_for:  # it left on a node's word: which
        text = f"{text.partition(' (')[0]}: {record.exit_how}"
    death = examine(record, end.signal, text, named, record.stack, end.hang if end.killed_for == "timeout" else None)
    said = death.reason + thread_clause(end, run, spared)
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


def opening(end: Ending, item: int, node: str, what: str) -> NodeCrashed:
    """The error of `item`, whose input `what` (`input 'x' (a dict of 3 items)`) killed the worker
    as it was unpickled there, one by one (a sealed chunk's, `reseal`): `node`, the nodes that
    read that input."""
    return _died(end, node, item, f"while unpickling its {what}, before the node ran")


@dataclass(frozen=True)
class Between:
    """What a death with no node running means: `seal`, items to send again sealed (`reseal`;
    `alone`: each result sent alone) for the reason `why`; `failed`, items that fail, with their
    errors; `unsent`, the worker's items that run again as they were."""

    seal: list[int]
    why: str = ""
    alone: bool = False
    failed: list[tuple[int, NodeCrashed]] = field(default_factory=list)
    unsent: list[int] = field(default_factory=list)


def between_items(end: Ending, doing: float, count: int, unsent: list[int], producers: str) -> Between:
    """A worker died with the items `unsent` not answered and no node running, `doing` (a status
    word): READING a chunk (it is sent again sealed, each item's inputs unpickled one by one, so
    that the item at fault fails alone: `opening`), LOADING the pipeline (the chunk's items fail,
    as when loading raises), or pickling a batch of `count` results (SENDING: those items run
    again sealed, each result sent alone; an item alone fails, in the nodes `producers`)."""
    if doing == READING:
        return Between(unsent, f"the worker process died ({end.reason}) unpickling it")
    if doing == LOADING:
        return Between([], failed=[(i, _died(end, "<pipeline>", i, "while loading the pipeline (unpickling its "
                                             "nodes, importing their modules)")) for i in unsent])
    batch = unsent[:max(1, count)]
    if len(batch) > 1:
        return Between(batch, f"the worker process died ({end.reason}) pickling their results", alone=True,
                       unsent=unsent[len(batch):])
    return Between([], failed=[(batch[0], _died(
        end, producers or "?", batch[0], "while pickling the item's result to send it back, after its nodes ran; "
        "return plain data (numbers, arrays, dicts, paths)"))], unsent=unsent[len(batch):])


def _died(end: Ending, node: str, item: int, doing: str) -> NodeCrashed:
    return NodeCrashed(node, item, f"the worker process died ({end.reason}) {doing}", signal=end.signal,
                       exitcode=end.exitcode, stack=end.record.stack)


def reseal(chunk: list[int], sealed: Mapping[int, int], alone: bool, node: str,
           why: str) -> list[tuple[int, ShippingError]]:
    """Whether a chunk that could not be unpickled in the worker, or whose unpickling or results
    killed it (`why`), is sent again sealed (`alone`: each result sent alone too; `sealed`: how
    each item was sent before): the errors its items fail with when it was sealed so already
    (nothing an item holds can make a sealed chunk fail so: no loop), else none."""
    if sealed.get(chunk[0], 0) < 1 + alone:
        return []
    return [(i, ShippingError(node, None, i, f"its chunk could not be unpickled in the worker process, even sealed: "
                              f"{why}")) for i in chunk]


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
