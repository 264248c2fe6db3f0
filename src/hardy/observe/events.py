"""Delivering lifecycle events to a pipeline's callbacks: `Events`.

Node events are produced by wrapping each node function at plan-compile time (see `instrument`),
which is why registering no callback costs nothing per call. Nodes that run in worker processes
log their calls there, and the log is replayed here (`Events.replay`, `nodelog.py`) with the
results it came with; map-item events always fire in the caller. A callback that raises is warned
about and keeps getting events: observing a pipeline never costs its results.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Protocol

from ..model.executor import IsolatedCall
from ..model.node import Node
from .callbacks import (
    NODE_EVENTS,
    CallbackContext,
    PipelineCallback,
    call_context,
    current_context,
    item_scope,
    listened,
)
from .nodelog import BATCHED, CACHED, END, ERROR, NodeLogBatch
from .nodelog import Events as LogEvents


def _position(cursor: Iterator[Any], size: int) -> int:
    """Where a loop over `cursor` (an iterator over a list of `size`) stands: the index of the
    element it took last. The lazy scopes below read it instead of the loop storing it per element."""
    return size - 1 - operator.length_hint(cursor)


class _Replayed(Mapping[str, Any]):
    """The item-scoped values of the node event being replayed (`Events.replay`), made when read:
    most callbacks never read them, so the replay sets nothing per event. Which event it is, is
    where the replay's iterator over the events' node names stands (`cursor`)."""

    __slots__ = ("events", "cursor", "size", "pid", "clock", "offset", "retries", "which")
    KEYS = ("hardy.item", "hardy.worker_pid", "hardy.event_ns", "hardy.retry")

    def __init__(self, which: Callable[[int], int], offset: int, retries: Mapping[int, int] | None):
        self.events: LogEvents | None = None
        self.cursor: Iterator[str] = iter(())
        self.size = self.pid = self.clock = 0  # clock: the log's offset to wall-clock nanoseconds
        self.which, self.offset, self.retries = which, offset, retries

    def replaying(self, log: NodeLogBatch) -> Iterator[str]:
        """The node name of each event of `log`, in order: the replay's loop walks them."""
        events = self.events = log.events()
        self.pid, self.clock = log.pid, log.offset
        names = list(log.names) * (len(events.bounds) - 1) if events.regular else [
            log.names[k] for k in events.steps]
        self.size, self.cursor = len(names), iter(names)
        return self.cursor

    @property
    def event(self) -> int:
        return _position(self.cursor, self.size)

    def __getitem__(self, key: str) -> Any:
        events, e = self.events, self.event
        assert events is not None
        if key == "hardy.item":
            return self.offset + self.which(events.items[e])
        if key == "hardy.worker_pid":
            return self.pid
        if key == "hardy.event_ns":
            return round(events.starts[e] * 1e9) + self.clock, round(events.ends[e] * 1e9) + self.clock
        if key == "hardy.retry":
            return self.retries.get(self.which(events.items[e]), 0) if self.retries else 0
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.KEYS)

    def __len__(self) -> int:
        return len(self.KEYS)


class _Ending(Mapping[str, Any]):
    """The item-scoped values while a batch's item ends are delivered (`Events.items_done`):
    the item is the row the loop's iterator has reached, read only when a callback asks, as is
    how many times it ran before (`retries`, by row index)."""

    __slots__ = ("rows", "cursor", "offset", "base", "retries")

    def __init__(self, rows: Sequence[tuple[Any, ...]], cursor: Iterator[tuple[Any, ...]], offset: int,
                 base: Mapping[str, Any], retries: Mapping[int, int]):
        self.rows, self.cursor, self.offset, self.base, self.retries = rows, cursor, offset, base, retries

    def __getitem__(self, key: str) -> Any:
        if key in ("hardy.item", "hardy.retry"):
            i = self.rows[_position(self.cursor, len(self.rows))][0]
            return self.offset + i if key == "hardy.item" else self.retries.get(i, 0)
        return self.base[key]

    def __iter__(self) -> Iterator[str]:
        return iter({**self.base, "hardy.item": None, "hardy.retry": None})

    def __len__(self) -> int:
        return len({**self.base, "hardy.item": None, "hardy.retry": None})


class Ran(Protocol):
    """Where a run report notes when and where work ran in worker processes (report.py's `LiveReport`)."""

    def item_ran(self, i: int, start_ns: int, end_ns: int, pid: int) -> None: ...

    def nodes_ran(self, names: Iterable[str], pid: int) -> None: ...



class Events:
    """Fans one event out to a pipeline's callbacks, each call guarded by the same context.

    A map reports as HyperNodes' does: on_map_start, then for each item on_map_item_start and the
    item's own on_pipeline_start/_end (with that item's inputs and outputs) around its node events,
    then on_map_end; `pipeline_id` and `items` (given for a map) name what the item events report.
    """

    def __init__(self, callbacks: Sequence[PipelineCallback], pipeline_id: str = "",
                 items: Sequence[dict[str, Any]] = ()):
        self.callbacks = tuple(callbacks)
        self.pipeline_id = pipeline_id
        self.items = items
        self._handlers: dict[str, tuple[Callable[..., None], ...]] = {}
        self._replayed: tuple[Callable[..., None] | None, ...] | None = None
        self._item_ends: tuple[Callable[..., None] | None, Callable[..., None] | None] | None = None
        self._warned: set[str] = set()

    def handlers(self, event: str) -> tuple[Callable[..., None], ...]:
        """The callbacks' methods for `event`, leaving out the inherited no-ops: an event nobody
        overrides costs one dict lookup, and node events nobody listens to are not even produced."""
        found = self._handlers.get(event)
        if found is None:
            found = self._handlers[event] = tuple(getattr(cb, event) for cb in self.callbacks
                                                  if event in listened(type(cb)))  # type: ignore[arg-type]  # mypy: a class is Hashable
        return found

    def listens(self, *events: str) -> bool:
        return any(self.handlers(e) for e in events)

    def emit(self, event: str, *args: Any) -> None:
        handlers = self._handlers.get(event)
        if handlers is None:
            handlers = self.handlers(event)
        if handlers:
            ctx = current_context()
            for handler in handlers:
                try:  # inline, not `_deliver`: a node call emits two of these
                    handler(*args, ctx)
                except Exception as exc:
                    self._raised(handler, event, exc)

    def _deliver(self, handler: Callable[..., None], event: str, *args: Any) -> None:
        try:
            handler(*args)
        except Exception as exc:
            self._raised(handler, event, exc)

    def _raised(self, handler: Callable[..., None], event: str, exc: Exception) -> None:
        """A callback raised: a warning says which and where (once per callback method and call),
        and the events go on, to it and to the others: observing a pipeline never costs its
        results, nor blames a node for the observer's error. (Hot loops call handlers inline in a
        `try`, which costs nothing until something raises.)"""
        owner = getattr(handler, "__self__", None)
        who = f"{type(owner).__qualname__}.{event}" if owner is not None else getattr(handler, "__qualname__", event)
        if who in self._warned:
            return
        self._warned.add(who)
        import traceback  # (here: `import hardy` stays light)
        frames = traceback.extract_tb(exc.__traceback__)
        where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        warnings.warn(f"hardy: callback {who} raised {type(exc).__name__}: {exc}{where}; the pipeline goes on "
                      "(its results are not affected) and the callback keeps getting events", RuntimeWarning,
                      stacklevel=2)

    def _fanout(self, event: str) -> Callable[..., None] | None:
        """One callable for the handlers of `event`: None for none, the handler itself for one
        (most often: a replay's loop makes hundreds of thousands of these calls a second)."""
        handlers = self.handlers(event)
        if len(handlers) < 2:
            return handlers[0] if handlers else None

        def each(*args: Any) -> None:
            for handler in handlers:
                self._deliver(handler, event, *args)
        return each

    def pipeline(self, pipeline_id: str, inputs: dict[str, Any], call: Callable[[], dict[str, Any]],
                 node_ids: Sequence[str] = (), announce: bool = True) -> dict[str, Any]:
        """Runs `call` as pipeline `pipeline_id` in the callback context; `announce=False` (a map,
        whose items announce themselves) emits no on_pipeline_start/_end of its own."""
        with self.opened(pipeline_id, inputs, node_ids, announce) as finish:
            return finish(call())

    @contextlib.contextmanager
    def opened(self, pipeline_id: str, inputs: dict[str, Any], node_ids: Sequence[str] = (),
               announce: bool = True) -> Iterator[Callable[[dict[str, Any]], dict[str, Any]]]:
        """Pipeline `pipeline_id` open in the callback context for the `with` block (a streamed map
        stays open while it is consumed); the block reports its outputs through the yielded function."""
        token = scope = None
        if call_context.get() is None:  # a top-level call: no item of an earlier map is current
            token, scope = call_context.set(CallbackContext()), item_scope.set(MappingProxyType({}))
        ctx = current_context()
        ctx.set_pipeline_metadata(pipeline_id, {"total_nodes": len(node_ids), "pipeline_name": pipeline_id,
                                                "node_ids": list(node_ids)})
        ctx.push_pipeline(pipeline_id)
        if announce:
            self.emit("on_pipeline_start", pipeline_id, inputs)
        start = time.perf_counter()

        def finish(out: dict[str, Any]) -> dict[str, Any]:
            if announce:
                self.emit("on_pipeline_end", pipeline_id, out, time.perf_counter() - start)
            return out
        try:
            yield finish
        finally:
            ctx.pop_pipeline()
            if token is not None and scope is not None:
                call_context.reset(token)
                item_scope.reset(scope)

    def item_started(self, i: int, worker: int | None = None) -> None:
        """`worker`: the pid of the worker process the item was handed to (None: this process).
        The context's `hardy.item` names the item that the node events which follow belong to
        (in this thread or task; a worker's events are replayed with theirs, see `replay`)."""
        if worker is not None:
            self.items_started([i], worker)
            return
        item_scope.set({"hardy.item": i, "hardy.worker_pid": None})
        for handler in self.handlers("on_map_item_start"):
            self._deliver(handler, "on_map_item_start", i, current_context())
        if self.handlers("on_pipeline_start"):
            self.emit("on_pipeline_start", self.pipeline_id, dict(self.items[i]) if self.items else {})

    def items_started(self, indices: Sequence[int], worker: int) -> None:
        """Items handed to worker process `worker` together (a chunk): each one's
        on_map_item_start and on_pipeline_start, the context naming the item and the worker."""
        starts, pipeline_starts = self.handlers("on_map_item_start"), self.handlers("on_pipeline_start")
        if not (starts or pipeline_starts):
            return
        ctx, items = current_context(), self.items
        scope: dict[str, Any] = {"hardy.item": None, "hardy.worker_pid": worker}
        token = item_scope.set(scope)
        try:
            for i in indices:
                scope["hardy.item"] = i
                for handler in starts:
                    self._deliver(handler, "on_map_item_start", i, ctx)
                for handler in pipeline_starts:
                    self._deliver(handler, "on_pipeline_start", self.pipeline_id, dict(items[i]) if items else {}, ctx)
        finally:
            item_scope.reset(token)

    def names(self, i: int) -> bool:
        """Whether this thread's or task's context names item i already (it runs here)."""
        return bool(item_scope.get().get("hardy.item") == i)

    def in_item(self, i: int) -> None:
        """The node events that follow in this thread or task belong to item i (no item event is
        listened to, so `item_started` is not called)."""
        item_scope.set({"hardy.item": i, "hardy.worker_pid": None})

    def items_done(self, rows: Sequence[tuple[Any, ...]], offset: int, started: Sequence[float],
                   now: float, name_items: bool = False, retries: Mapping[int, int] = MappingProxyType({})) -> None:
        """Items finished at `now`, as rows `(i, ok, outputs)` (item `offset + i`, handed out at
        `started[i]`): each one's on_pipeline_end and on_map_item_end, in one loop (a fast map
        delivers a million a second). `name_items`: the context names each item while its end is
        delivered (a worker's batch; an item run here is named already, since its start), with
        its `retries` (runs before, on workers that died)."""
        found = self._item_ends
        if found is None:
            found = self._item_ends = (self._fanout("on_pipeline_end"), self._fanout("on_map_item_end"))
        end, item_end = found
        if not (end or item_end):
            return
        ctx, pipeline_id = current_context(), self.pipeline_id
        cursor = iter(rows)
        token = item_scope.set(_Ending(rows, cursor, offset, item_scope.get(), retries)) if name_items else None
        try:
            for row in cursor:
                i, duration = offset + row[0], now - started[row[0]]
                if end:
                    try:
                        end(pipeline_id, row[2], duration, ctx)
                    except Exception as exc:
                        self._raised(end, "on_pipeline_end", exc)
                if item_end:
                    try:
                        item_end(i, duration, ctx)
                    except Exception as exc:
                        self._raised(item_end, "on_map_item_end", exc)
        finally:
            if token is not None:
                item_scope.reset(token)

    def item_failed(self, i: int, error: Exception, retry: int = 0) -> None:
        """Item i's on_map_item_error, the context naming the item (a worker's, whose scope is not
        set here) and how many times it ran before on workers that died."""
        if not self.handlers("on_map_item_error"):
            return
        token = item_scope.set({**item_scope.get(), "hardy.item": i, "hardy.retry": retry})
        try:
            self.emit("on_map_item_error", i, error)
        finally:
            item_scope.reset(token)

    def replay(self, logs: Iterable[NodeLogBatch], which: Callable[[int], int],
               errors: Mapping[int, Exception] | None = None, offset: int = 0,
               retries: Mapping[int, int] | None = None, ran: Ran | None = None) -> None:
        """The node events in `logs`, logged where they ran (`hardy.observe.nodelog`), as if they
        happened here. A log numbers its items in the order they ran: `which(r)` is the sink's
        index of the r-th (the map's is `offset` more). `errors`: the failures of the items that
        failed, by index, reported for the node that raised; `retries`: runs before, per index;
        `ran`: told where and when each item ran, and which nodes each worker ran. The context's
        item-scoped values (see `CallbackContext.get`) are read from the event being replayed
        when asked for: a fast map replays hundreds of thousands of events a second."""
        if self._replayed is None:  # one callable per event kind, for the whole map
            self._replayed = tuple(self._fanout(e) for e in (
                "on_node_start", "on_node_end", "on_error", "on_node_cached", "on_map_item_cached", "on_batch_end"))
        start, end = self._replayed[:2]
        ctx = current_context()
        scope = _Replayed(which, offset, retries)
        token = item_scope.set(scope)
        try:
            for log in logs:
                names = scope.replaying(log)
                events = scope.events
                assert events is not None
                if events.regular and end and not start:  # a fast map's usual batch, most listeners' need
                    for name, began, ended in zip(names, events.starts, events.ends):
                        try:
                            end(name, {}, ended - began, ctx)
                        except Exception as exc:
                            self._raised(end, "on_node_end", exc)
                else:
                    self._replay_each(names, scope, errors, ctx)
                if ran:
                    for r, (began, ended) in enumerate(events.ran()):
                        ran.item_ran(offset + which(r), round(began * 1e9) + log.offset,
                                     round(ended * 1e9) + log.offset, log.pid)
                    ran.nodes_ran(log.names if events.regular else [log.names[k] for k in set(events.steps)], log.pid)
        finally:
            item_scope.reset(token)

    def _replay_each(self, names: Iterator[str], scope: _Replayed, errors: Mapping[int, Exception] | None,
                     ctx: CallbackContext) -> None:
        """`replay` for the log in `scope`, whatever its events (`names`: its cursor)."""
        assert self._replayed is not None and scope.events is not None
        start, end, raised, cached, item_cached, batch_end = self._replayed
        events = scope.events
        codes = events.codes if events.codes is not None else itertools.repeat(END)
        # an item's failure is its last error's: an attempt its node's policy retried raised its own
        last_error = {events.items[e]: e for e, code in enumerate(events.codes or ()) if code == ERROR}
        for e, name, code, began, ended in zip(itertools.count(), names, codes, events.starts, events.ends):
            if code == END:
                if start:
                    self._deliver(start, "on_node_start", name, {}, ctx)
                if end:
                    self._deliver(end, "on_node_end", name, {}, ended - began, ctx)
            elif code == BATCHED:
                if batch_end:
                    self._deliver(batch_end, "on_batch_end", name, events.details[e], ended - began, ctx)
            elif code == CACHED:
                if cached:
                    self._deliver(cached, "on_node_cached", name, events.details[e], ctx)
                if item_cached:
                    item = scope.offset + scope.which(events.items[e])
                    self._deliver(item_cached, "on_map_item_cached", item, events.details[e], ctx)
            else:
                if start:
                    self._deliver(start, "on_node_start", name, {}, ctx)
                item = events.items[e]
                final = errors.get(scope.which(item)) if errors and last_error[item] == e else None
                error = final or events.details.get(e)
                if raised:
                    self._deliver(raised, "on_error", name, error or RuntimeError("failed in a worker"), ctx)

    def batch_called(self, node_id: str, size: int, duration: float) -> None:
        """A batched node's call in this process (`hardy.parts.batching`): its on_batch_end."""
        self.emit("on_batch_end", node_id, size, duration)

    def crashed(self, i: int, error: Exception, worker: int, retry: int = 0) -> None:
        """Item i's worker died running `error.node`: the node's on_error, the worker's own log
        having died with it."""
        token = item_scope.set({"hardy.item": i, "hardy.worker_pid": worker or None, "hardy.retry": retry})
        self.emit("on_error", error.node, error)  # type: ignore[attr-defined]
        item_scope.reset(token)

    def nested(self, child_id: str, call: Callable[[], Any]) -> Any:
        """Run a nested pipeline's call between on_nested_pipeline_start and _end."""
        parent = current_context().current_pipeline_id or ""
        self.emit("on_nested_pipeline_start", parent, child_id)
        start = time.perf_counter()
        out = call()
        self.emit("on_nested_pipeline_end", parent, child_id, time.perf_counter() - start)
        return out

    def cached(self, node_id: str, key: bytes, item: int | None) -> None:
        signature = key.hex() if isinstance(key, bytes) else str(key)
        self.emit("on_node_cached", node_id, signature)
        if item is not None:
            self.emit("on_map_item_cached", item, signature)

    def instrument(self, node: Node, func: Callable[..., Any]) -> Callable[..., Any]:
        """`func` (the node's function, or its call into a worker), wrapped to report events;
        `func` itself when no callback listens to node events."""
        if not self.listens(*NODE_EVENTS):
            return func
        name, params = node.name, node.inputs

        def outputs(value: Any) -> dict[Any, Any]:
            if getattr(node, "hypernodes_events", False):  # HyperNodes' own shape, for its callbacks
                return value if isinstance(value, dict) else {node.output_name: value}  # (`compat.hypernodes`)
            if len(node.outputs) == 1 and not node.unpacks:
                return {node.outputs[0]: value}
            if isinstance(value, (tuple, list)):  # (one name too, declared as a tuple: its 1-tuple)
                return dict(zip(node.outputs, value))
            return {node.output_name: value}  # (a generator the plan unpacks next: not read here)

        def inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
            return {**dict(zip(params, args)), **kwargs}

        # A call into a worker (Engine._isolated) also says where it ran and for how long there.
        located = func.located if isinstance(func, IsolatedCall) else None

        if node.is_async:
            @functools.wraps(func)
            async def observed_async(*args: Any, **kwargs: Any) -> Any:
                self.emit("on_node_start", name, inputs(args, kwargs))
                start, where = time.perf_counter(), None
                try:
                    if located is None:
                        value = await func(*args, **kwargs)
                    else:
                        where, outcome = await located(*args, **kwargs)
                        value = outcome()
                except Exception as exc:
                    self._located(where, "on_error", name, exc)
                    raise
                self._located(where, "on_node_end", name, outputs(value), time.perf_counter() - start)
                return value
            return observed_async

        @functools.wraps(func)
        def observed(*args: Any, **kwargs: Any) -> Any:
            self.emit("on_node_start", name, inputs(args, kwargs))
            start, where = time.perf_counter(), None
            try:
                if located is None:
                    value = func(*args, **kwargs)
                else:
                    where, outcome = located(*args, **kwargs)
                    value = outcome()
            except Exception as exc:
                self._located(where, "on_error", name, exc)
                raise
            self._located(where, "on_node_end", name, outputs(value), time.perf_counter() - start)
            return value
        return observed

    def _located(self, where: tuple[int, float | None] | None, event: str, *args: Any) -> None:
        """`event` for a node call; `where` (pid, seconds) it ran in a worker: its pid in the context
        and, for an end, the duration the worker measured (not the trip there; None: it died)."""
        if where is None:
            self.emit(event, *args)
            return
        pid, duration = where
        if event == "on_node_end" and duration is not None:
            args = (*args[:-1], duration)
        token = item_scope.set({**item_scope.get(), "hardy.worker_pid": pid})
        try:
            self.emit(event, *args)
        finally:
            item_scope.reset(token)
