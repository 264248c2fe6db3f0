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
  node's `retries`/`retry_on` apply to each call (`hardy.model.policy`). A crash or a timeout in a worker
  process runs the batch again one item per call on a fresh worker (`crash/verdict.py`: each
  death costs a worker start, so halving would cost more deaths). Inside a nested map, the
  enclosing item runs again with that map's calls one item each (`_call` names its items for
  `crash.containment.nesting`), then without the culprit.
- **events**: items start, end and fail one by one; each item's event for the batched node lasts
  its share of the call that computed it (the call's time over its items), so a node's total is
  the time its calls took. Each call is also reported whole (`called`: the node's step, its
  items, when it began and ended): callbacks' `on_batch_end`, the progress bar and the run
  report's batch sizes and time per batch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..errors import BatchShapeError, NodeError
from ..model.node import Node
from ..model.policy import guard, passes
from ..plan.compiled import KEYS, Plan
from ..plan.rows import batch_outputs
from .stages import cut

Outcome = tuple[int, bool, Any]  # (item, ok, its outputs or its NodeError)
Span = tuple[float, float]  # an item's share of the call that computed it: (start, start + share), monotonic
Called = Callable[[int, int, float, float], None]  # (step, items, start, end) of each batch call
At = Callable[..., None]  # at(item) or at(item, span): see `Batched.run`


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
                 step: int, direct: bool = False):
        self.node, self.plan, self.probe, self.call, self.step = node, plan, probe, call, step
        self.args: tuple[tuple[str, str], ...] = plan.steps[0].args if node is not None else ()
        # `direct`: an item's outputs are handed out without running its plan (no cache entry to
        # key or write, no wrap observing the call): what it would return, built here. Each of the
        # plan's outputs, with the index of the node's output it is, or -1 for a value the item
        # already holds (an earlier node's, or an input, asked for as well)
        outs = node.outputs if node is not None else ()
        self.direct = [(name, outs.index(name) if name in outs else -1) for name in plan.outputs] if (
            direct and node is not None) else None
        # the common case, one output handed out and nothing else: its name
        self.alone = outs[0] if len(outs) == 1 and self.direct == [(outs[0], 0)] else None
        self.single = node is not None and len(node.outputs) == 1  # its value is the output, not a tuple


class Batched:
    """A plan with batched nodes, cut into parts (see the module docstring); `run` runs a chunk."""

    def __init__(self, plan: Plan):
        index = {s.node.name: k for k, s in enumerate(plan.steps)}
        outer = plan.wrap
        wrap = (lambda k, n: outer(index[n.name], n)) if outer is not None else None
        batched = {s.node.name: s.node for s in plan.steps if s.node.batch is not None}
        self.group = max(n.batch_size for n in batched.values())
        self.names = tuple(s.node.name for s in plan.steps)  # by step, as `called` reports them
        # how long a partial group of a stream waits for more items (`@node(batch_wait=)`): the least
        waits = [n.batch_wait for n in batched.values() if n.batch_wait is not None]
        self.wait: float | None = min(waits) if waits else None
        self.keyed = plan.keyed
        self._here = threading.local()  # the outcome `_Handed` gives, per thread running items
        handed = {name: _stand_in(n, _Handed(self._here)) for name, n in batched.items()}
        options: dict[str, Any] = dict(wrap=wrap, on_cached=plan.on_cached, name=plan.name, calls=handed)
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
                             on_cached=plan.on_cached, name=plan.name, calls={name: _stand_in(node, _defer)})
            direct = stage.cache is None and (outer is None or getattr(outer, "observes", True) is False)
            self.parts.append(_Part(node, stage, probe, guard(node, node.call_batch), index[name], direct))

    def run(self, items: Sequence[tuple[int, dict[str, Any]]], at: At | None = None,
            calling: Callable[[int], None] | None = None, offset: int = 0, size: int = 0,
            called: Called | None = None) -> Iterator[Outcome]:
        """Each item's outcome, in the items' order, a group of `size` items at a time (default
        `group`; a group's outcomes as soon as it is done). `at(i, span)`: item i's nodes run next
        (`span`: when they are a batched node's, handed out from a call, the item's share of it);
        `calling(k)`: step k's batch call runs next (a worker dates them for its parent); `called`:
        each batch call once it is over; `offset`: added to item numbers given to plans (cache
        events name the map's item)."""
        size = size or self.group
        hooks = (at, calling, called)
        for start in range(0, len(items), size):
            yield from self._group(items[start:start + size], hooks, offset)

    def _group(self, group: Sequence[tuple[int, dict[str, Any]]], hooks: tuple[Any, ...], offset: int
               ) -> Iterator[Outcome]:
        """The group's outcomes once its last part is done, in its items' order (an ordered stream
        hands them out as they come)."""
        failed: dict[int, NodeError] = {}
        alive = list(group)
        for n, part in enumerate(self.parts):
            merging = (part is self.parts[-1], n > 0)  # (last, own): own, the values are copies the first part made
            if part.node is None:
                alive = self._each(part, alive, hooks[0], offset, merging, failed)
            else:
                alive = self._batch(part, alive, hooks, offset, merging, failed)
        done = dict(alive)
        for i, _ in group:
            yield (i, True, done[i]) if i in done else (i, False, failed[i])

    def _each(self, part: _Part, alive: list[tuple[int, dict[str, Any]]], at: At | None, offset: int,
              merging: tuple[bool, bool], failed: dict[int, NodeError]) -> list[tuple[int, dict[str, Any]]]:
        """A per-item part over the group's items alive: those it ran, with their values after it."""
        run, merge, ran = part.plan.run, self._merge, []
        last, own = merging
        for i, values in alive:
            if at is not None:
                at(i)
            try:
                out = run(values, offset + i)
            except NodeError as err:
                failed[i] = err
                continue
            ran.append((i, merge(values, out, last, own)))
        return ran

    def _batch(self, part: _Part, alive: list[tuple[int, dict[str, Any]]], hooks: tuple[Any, ...], offset: int,
               merging: tuple[bool, bool], failed: dict[int, NodeError]) -> list[tuple[int, dict[str, Any]]]:
        """The batched node over the group's items alive: cache hits first, one call for the rest.
        An item whose outputs are handed out `direct`ly runs no code of its own here, so `at` is
        not told of it (a crash meanwhile is the batch call's, whose status words still stand)."""
        at, (last, own) = hooks[0], merging
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
                        failed[i] = err
                    continue
                done[i] = self._merge(values, out, last, own)
        size = part.node.batch_size if part.node is not None else 1
        outcomes = [outcome for start in range(0, len(todo), size)
                    for outcome in self._call(part, todo[start:start + size], hooks, offset)]
        here, direct, alone, single = self._here, part.direct, part.alone, part.single
        for (i, values), outcome in zip(todo, outcomes, strict=True):
            if direct is not None and outcome[0]:
                value = outcome[1]
                out = {alone: value} if alone is not None else {
                    name: values[name] if k < 0 else value if single else value[k] for name, k in direct}
                done[i] = self._merge(values, out, last, own)
                continue
            if at is not None:
                at(i, outcome[2])
            here.outcome = outcome
            try:
                out = part.plan.run(values, offset + i)  # keys, cache entry, errors: the item's own
            except NodeError as err:
                failed[i] = err
                continue
            finally:
                here.outcome = None
            done[i] = self._merge(values, out, last, own)
        return [(i, done[i]) for i, _ in alive if i in done]

    def _call(self, part: _Part, rows: list[tuple[int, dict[str, Any]]], hooks: tuple[Any, ...], offset: int
              ) -> list[tuple[bool, Any, Span]]:
        """(ok, the item's output or the exception, its share of the call) per item: one call,
        split in halves where it raises. `_hardy_batch` names the call's node and items for a
        crash inside it (`crash.containment.nesting`: which inner items of a nested map it held)."""
        assert part.node is not None and part.call is not None
        _, calling, called = hooks
        n = len(rows)
        _hardy_batch = (part.node.name, rows, offset, part.node.timeout)  # noqa: F841
        columns = {p: [values[v] for _, values in rows] for p, v in part.args}
        outputs = len(part.node.outputs)
        if calling is not None:
            calling(part.step)
        start = time.monotonic()
        failure: BaseException | None = None
        try:
            entries = batch_outputs(part.call(**columns), part.node.name, outputs, n)
        except BatchShapeError as exc:  # not an item's fault: every item says so, no split
            return [(False, exc, self._span(part, n, start, called))] * n
        except BaseException as exc:  # sys.exit() too: an item's failure, never the caller's end
            if passes(exc):
                raise
            failure = exc
        span = self._span(part, n, start, called)
        if failure is not None:
            if n == 1:
                return [(False, failure, span)]
            # the halves are called after the `except` block, not in it: there Python would make
            # this batch's exception each later one's `__context__`, and an item's error would
            # print every bisection level's attempt, hardy's frames included ("During handling...")
            del failure
            half = n // 2
            return self._call(part, rows[:half], hooks, offset) + self._call(part, rows[half:], hooks, offset)
        if outputs == 1:
            return [(True, value, span) for value in entries[0]]
        return [(True, values, span) for values in zip(*entries)]

    @staticmethod
    def _span(part: _Part, n: int, start: float, called: Called | None) -> Span:
        """A call of n items is over: reported whole (`called`); each item's share of it."""
        end = time.monotonic()
        if called is not None:
            called(part.step, n, start, end)
        return start, start + (end - start) / n

    def _merge(self, values: dict[str, Any], out: dict[str, Any], last: bool, own: bool) -> dict[str, Any]:
        """An item's values after a part: the last part leaves the plan's outputs (and their keys
        when the plan is keyed); the others add theirs to the values so far, in place when they
        are `own`, copies the first part made (the item's dict it was given is its caller's)."""
        keys = out.pop(KEYS, None)
        if last:
            if self.keyed and keys is not None:
                out[KEYS] = keys
            return out
        if own and keys is None:
            values.update(out)
            return values
        merged = {**values, **out}
        if keys is not None:
            merged[KEYS] = {**values.get(KEYS, {}), **keys}
        return merged


class _Handed:
    """The batched node's stand-in function in its per-item plan: hands out the item's outcome of
    the batch call (set in `here` by `Batched._batch`). Instrumented (`Events.instrument`), it
    says how long the item's share of the call took (`located`), not how long handing it out did."""

    def __init__(self, here: threading.local):
        self.here = here

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ok, value, _ = self.here.outcome
        if ok:
            return value
        raise value

    def located(self, *args: Any, **kwargs: Any) -> tuple[tuple[None, float], Callable[[], Any]]:
        start, end = self.here.outcome[2]
        return (None, end - start), lambda: self(*args, **kwargs)


def batched(plan: Plan) -> Batched | None:
    """The batched form of `plan`, made once per plan; None when it has no batched node, or is
    async (whose items run concurrently, one call each)."""
    if "_batched" not in plan.__dict__:
        plan.__dict__["_batched"] = (Batched(plan) if plan.mode != "async" and
                                     any(s.node.batch is not None for s in plan.steps) else None)
    found: Batched | None = plan.__dict__["_batched"]
    return found


__all__ = ["Batched", "Outcome", "batched"]
