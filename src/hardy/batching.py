"""Batched nodes: a barrier inside a chunk of items, with per-item results, cache entries and errors.

A batched node (`@node(batch_size=64)`, or a HyperNodes `DualNode`) has a function that takes one
list per parameter and returns one list per output. It is a plan *shape*, not a new engine: the
plan is cut (`stages.cut`) into per-item parts and one part per batched node, and a chunk of items
runs part after part, a group of `batch_size` items at a time:

    per-item nodes (each item)  ->  one call of the batch function  ->  per-item nodes (each item)

Every executor runs its chunks through `Batched.run` (the in-process loop, the worker process's
loop, and so Dask, Ray and Daft, whose chunks run in hardy's workers), so there is still one way to
run items. What stays per item:

- **cache**: the batched part is a keyed one-step plan, so each item's call has its own key, looked
  up before the call (a probe run of that plan whose node defers instead of computing); only the
  misses go into the batch, and each result is written to its own entry by the same plan
  (`_handed`: the plan's node call hands out the item's result).
- **errors**: a batch call that raises is split in halves, and again, until each failing item is
  alone; its error names the node and that item's inputs, every other item gets its result. The
  node's `retries`/`retry_on` apply to each call (`hardy.policy`). A crash or a timeout in a worker
  process runs the batch again one item per call on a fresh worker (`workers/deaths.py`: each
  death costs a worker start, so halving would cost more deaths).
- **events**: items start, end and fail one by one; the batched node's call is attributed to each
  of its items.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

from .errors import BatchShapeError, NodeError
from .node import Node
from .plan import KEYS, Plan, batch_outputs
from .policy import guard
from .stages import cut

Outcome = tuple[int, bool, Any]  # (item, ok, its outputs or its NodeError)


class _Deferred(Exception):
    """Raised by the probe's node call: the cache had no entry, the item joins the batch."""


def _defer(*args: Any, **kwargs: Any) -> Any:
    raise _Deferred


def _stand_in(node: Node, func: Callable[..., Any]) -> Node:
    """`node` calling `func` per item, with no policy of its own (the batch call had it) and the
    node's own fingerprint: instrumented and keyed as the node is, where a plan calls it."""
    clone = object.__new__(type(node))  # not copy.copy: a module's node pickles (and copies) by reference
    clone.__dict__.update(node.__dict__)
    clone.func, clone.batch, clone.batch_size = func, None, 0
    clone.retries, clone.retry_on, clone.timeout, clone.isolate = 0, (), None, False
    clone.fingerprint = node.fingerprint  # type: ignore[method-assign]
    return clone


class _Part:
    """One part of a batched plan: per-item steps, or one batched node (its plan, the probe that
    finds its cache hits, the batch function under the node's policy, its step in the whole plan)."""

    def __init__(self, node: Node | None, plan: Plan, probe: Plan | None, call: Callable[..., Any] | None,
                 step: int):
        self.node, self.plan, self.probe, self.call, self.step = node, plan, probe, call, step
        self.args: tuple[tuple[str, str], ...] = plan.steps[0].args if node is not None else ()


class Batched:
    """A plan with batched nodes, cut into parts (see the module docstring); `run` runs a chunk."""

    def __init__(self, plan: Plan):
        index = {s.node.name: k for k, s in enumerate(plan.steps)}
        outer = plan._wrap
        wrap = (lambda k, n: outer(index[n.name], n)) if outer is not None else None
        batched = {s.node.name: s.node for s in plan.steps if s.node.batch is not None}
        self.group = max(n.batch_size for n in batched.values())
        self.keyed = plan.keyed
        self._here = threading.local()  # the outcome `_handed` gives, per thread running items
        handed = {name: _stand_in(n, self._handed) for name, n in batched.items()}
        options: dict[str, Any] = dict(wrap=wrap, on_cached=plan._on_cached, name=plan.name, calls=handed)
        stages = cut(plan, lambda n: n.name if n.batch is not None else None, **options)
        if stages[0][1] is plan:  # one batched node alone: still its own keyed plan
            stages = [(stages[0][0], Plan(plan.graph, plan.provided, plan.outputs, cache=plan.cache, keyed=True,
                                          **options))]
        self.parts: list[_Part] = []
        for name, stage in stages:
            if name is None:
                self.parts.append(_Part(None, stage, None, None, -1))
                continue
            node = batched[name]
            probe = None
            if stage.cache is not None and node.cache:
                probe = Plan(plan.graph, stage.provided, stage.outputs, cache=stage.cache, keyed=True,
                             on_cached=plan._on_cached, name=plan.name, calls={name: _stand_in(node, _defer)})
            self.parts.append(_Part(node, stage, probe, guard(node, node.call_batch), index[name]))

    def _handed(self, *args: Any, **kwargs: Any) -> Any:
        ok, value = self._here.outcome
        if ok:
            return value
        raise value

    def run(self, items: Sequence[tuple[int, dict[str, Any]]], at: Callable[[int], None] | None = None,
            calling: Callable[[int], None] | None = None, offset: int = 0, size: int = 0) -> Iterator[Outcome]:
        """Each item's outcome, a group of `size` items at a time (default `group`; a group's
        outcomes as soon as it is done). `at(i)`: item i's per-item nodes run next; `calling(k)`:
        step k's batch call runs next (a worker dates them for its parent); `offset`: added to
        item numbers given to plans (cache events name the map's item)."""
        size = size or self.group
        for start in range(0, len(items), size):
            yield from self._group(items[start:start + size], at, calling, offset)

    def _group(self, group: Sequence[tuple[int, dict[str, Any]]], at: Callable[[int], None] | None,
               calling: Callable[[int], None] | None, offset: int) -> Iterator[Outcome]:
        alive = list(group)
        for part in self.parts:
            last = part is self.parts[-1]
            if part.node is None:
                ran = []
                for i, values in alive:
                    if at is not None:
                        at(i)
                    try:
                        out = part.plan.run(values, offset + i)
                    except NodeError as err:
                        yield i, False, err
                        continue
                    ran.append((i, self._merge(values, out, last)))
                alive = ran
            else:
                alive = yield from self._batch(part, alive, at, calling, offset, last)
        for i, values in alive:
            yield i, True, values

    def _batch(self, part: _Part, alive: list[tuple[int, dict[str, Any]]], at: Callable[[int], None] | None,
               calling: Callable[[int], None] | None, offset: int, last: bool
               ) -> Generator[Outcome, None, list[tuple[int, dict[str, Any]]]]:
        """The batched node over the group's items alive: cache hits first, one call for the rest."""
        done: dict[int, dict[str, Any]] = {}
        todo = alive
        if part.probe is not None:
            todo = []
            for i, values in alive:
                if at is not None:
                    at(i)
                try:
                    out = part.probe.run(values, offset + i)
                except NodeError as err:
                    if isinstance(err.__cause__, _Deferred):
                        todo.append((i, values))
                    else:  # an input its key cannot hash: that item's error
                        yield i, False, err
                    continue
                done[i] = self._merge(values, out, last)
        size = part.node.batch_size if part.node is not None else 1
        outcomes = [outcome for start in range(0, len(todo), size)
                    for outcome in self._call(part, [values for _, values in todo[start:start + size]], calling)]
        here = self._here
        for (i, values), outcome in zip(todo, outcomes, strict=True):
            if at is not None:
                at(i)
            here.outcome = outcome
            try:
                out = part.plan.run(values, offset + i)  # keys, cache entry, errors: the item's own
            except NodeError as err:
                yield i, False, err
                continue
            finally:
                here.outcome = None
            done[i] = self._merge(values, out, last)
        return [(i, done[i]) for i, _ in alive if i in done]

    def _call(self, part: _Part, items: list[dict[str, Any]], calling: Callable[[int], None] | None
              ) -> list[tuple[bool, Any]]:
        """(ok, the item's output or the exception) per item: one call, split in halves where it raises."""
        assert part.node is not None and part.call is not None
        n = len(items)
        columns = {p: [values[v] for values in items] for p, v in part.args}
        outputs = len(part.node.outputs)
        try:
            if calling is not None:
                calling(part.step)
            out = batch_outputs(part.call(**columns), part.node.name, outputs, n)
        except BatchShapeError as exc:  # not an item's fault: every item says so, no split
            return [(False, exc)] * n
        except Exception as exc:
            if n == 1:
                return [(False, exc)]
            half = n // 2
            return self._call(part, items[:half], calling) + self._call(part, items[half:], calling)
        rows = [_entries(column) for column in out]
        if outputs == 1:
            return [(True, value) for value in rows[0]]
        return [(True, values) for values in zip(*rows, strict=True)]

    def _merge(self, values: dict[str, Any], out: dict[str, Any], last: bool) -> dict[str, Any]:
        """An item's values after a part: the last part leaves the plan's outputs (and their keys
        when the plan is keyed); the others add theirs to the values so far."""
        keys = out.pop(KEYS, None)
        if last:
            if self.keyed and keys is not None:
                out[KEYS] = keys
            return out
        merged = {**values, **out}
        if keys is not None:
            merged[KEYS] = {**values.get(KEYS, {}), **keys}
        return merged


def _entries(column: Any) -> list[Any]:
    """An output column as one entry per item. A torch tensor's rows are copied: a row would be a
    view of the whole batch's storage, which torch pickles whole (each item sent and cached with
    the entire batch)."""
    if type(column).__module__ == "torch" and "torch" in sys.modules:
        return [row.clone() for row in column]
    return list(column)


def batched(plan: Plan) -> Batched | None:
    """The batched form of `plan`, made once per plan; None when it has no batched node, or is
    async (whose items run concurrently, one call each)."""
    if "_batched" not in plan.__dict__:
        plan.__dict__["_batched"] = (Batched(plan) if plan.mode != "async" and
                                     any(s.node.batch is not None for s in plan.steps) else None)
    found: Batched | None = plan.__dict__["_batched"]
    return found


__all__ = ["Batched", "Outcome", "batched"]
