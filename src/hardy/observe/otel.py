"""OpenTelemetry spans for pipeline runs: `pip install "hardy[otel]"`.

Spans follow the call: `hardy.run` (a top-level `run()`), `hardy.map`, one `hardy.item` per map
item, one `hardy.node` per node call (a zero-length one with `hardy.cache_hit=true` for a node
answered from the cache), `hardy.pipeline` around a nested pipeline. The first span is a child of
the caller's current span, so a pipeline called inside a traced request shows up inside it.

Items are not nested by a stack: a process map starts many items before any ends, so item spans
are kept by index, and a node span's parent is the item (or other span) open in its own thread or
task (a contextvar), falling back to the innermost map or run for executor threads that start
with an empty context.
"""

from __future__ import annotations

import contextvars
import os
import threading
from typing import Any

from ..errors import install_hint
from .callbacks import CallbackContext, PipelineCallback

_Stack = tuple[tuple[str, Any], ...]  # of (kind, span), innermost last


class OpenTelemetryCallback(PipelineCallback):
    """Emits OpenTelemetry spans for every pipeline, map, item and node event.

    `tracer_provider` defaults to the global one (`opentelemetry.trace.set_tracer_provider`).
    """

    def __init__(self, tracer_provider: Any = None):
        try:
            from opentelemetry import trace
        except ImportError as exc:
            raise ImportError(f"OpenTelemetryCallback needs the OpenTelemetry API: {install_hint('otel')}") from exc
        from .. import __version__
        self._trace = trace
        self._tracer = trace.get_tracer("hardy", __version__, tracer_provider=tracer_provider)
        self._stack: contextvars.ContextVar[_Stack] = contextvars.ContextVar(f"hardy_otel_{id(self)}", default=())
        self._items: dict[tuple[int, int], Any] = {}
        self._outer: list[Any] = []  # open run/map spans, for threads that start with an empty context
        self._lock = threading.Lock()

    # --- span bookkeeping ---------------------------------------------------------------------------

    def _start(self, kind: str, name: str, attributes: dict[str, Any], push: bool = True,
               parent: Any = None, start_time: int | None = None) -> Any:
        stack = self._stack.get()
        if parent is None:
            candidates = stack
            if kind == "item":  # siblings, even when a process map has started several in this thread
                candidates = tuple(entry for entry in stack if entry[0] != "item")
            parent = candidates[-1][1] if candidates else (self._outer[-1] if self._outer else None)
        context = self._trace.set_span_in_context(parent) if parent is not None else None
        span = self._tracer.start_span(name, context=context, attributes=attributes, start_time=start_time)
        if push:
            self._stack.set((*stack, (kind, span)))
        return span

    def _end(self, kind: str, error: BaseException | None = None, end_time: int | None = None,
             pid: int | None = None) -> Any:
        """`pid`: where it ran, learnt at its end (an isolated node's call)."""
        stack = self._stack.get()
        for k in range(len(stack) - 1, -1, -1):
            if stack[k][0] == kind:
                span = stack[k][1]
                self._stack.set(stack[:k] + stack[k + 1:])
                if pid:
                    span.set_attribute("hardy.worker.pid", pid)
                self._finish(span, error, end_time)
                return span
        return None

    def _finish(self, span: Any, error: BaseException | None, end_time: int | None = None) -> None:
        if error is not None:
            from opentelemetry.trace import Status, StatusCode
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}".splitlines()[0][:200]))
            signal = getattr(error, "signal", None)
            if signal:
                span.set_attribute("hardy.signal", signal)
        span.end(end_time=end_time)

    def _top(self) -> str | None:
        stack = self._stack.get()
        return stack[-1][0] if stack else None

    # --- pipelines and maps -------------------------------------------------------------------------

    def on_pipeline_start(self, pipeline_id: str, inputs: dict[str, Any], ctx: CallbackContext) -> None:
        if self._top() in ("item", "nested"):  # a map item, or a nested pipeline: its span exists already
            return
        span = self._start("run", f"hardy.run {pipeline_id}", {"hardy.pipeline": pipeline_id})
        self._outer.append(span)

    def on_pipeline_end(self, pipeline_id: str, outputs: dict[str, Any], duration: float, ctx: CallbackContext) -> None:
        if self._top() not in ("item", "nested"):
            span = self._end("run")
            if span is not None:
                self._outer.remove(span)

    def on_nested_pipeline_start(self, parent_id: str, child_pipeline_id: str, ctx: CallbackContext) -> None:
        self._start("nested", f"hardy.pipeline {child_pipeline_id}", {"hardy.pipeline": child_pipeline_id})

    def on_nested_pipeline_end(self, parent_id: str, child_pipeline_id: str, duration: float,
                               ctx: CallbackContext) -> None:
        self._end("nested")

    def on_map_start(self, total_items: int, ctx: CallbackContext) -> None:
        pipeline = ctx.current_pipeline_id or ""
        span = self._start("map", f"hardy.map {pipeline}", {"hardy.pipeline": pipeline, "hardy.items": total_items})
        self._outer.append(span)

    def on_map_end(self, total_duration: float, ctx: CallbackContext) -> None:
        span = self._end("map")
        if span is not None:
            self._outer.remove(span)

    def _map_key(self, item_index: int) -> tuple[int, int]:
        """Items are numbered per map: a nested map's item 0 is not the outer map's item 0."""
        for kind, span in reversed(self._stack.get()):
            if kind == "map":
                return id(span), item_index
        return (id(self._outer[-1]) if self._outer else 0), item_index

    # --- items: kept by index (a process map starts many before any ends) ---------------------------

    def on_map_item_start(self, item_index: int, ctx: CallbackContext) -> None:
        pid = ctx.get("hardy.worker_pid") or os.getpid()
        span = self._start("item", f"hardy.item {item_index}", {"hardy.item": item_index, "hardy.worker.pid": pid})
        with self._lock:
            self._items[self._map_key(item_index)] = span

    def _item_done(self, item_index: int, error: BaseException | None) -> None:
        with self._lock:
            span = self._items.pop(self._map_key(item_index), None)
        if span is None:
            return
        stack = self._stack.get()
        self._stack.set(tuple(entry for entry in stack if entry[1] is not span))
        self._finish(span, error)

    def on_map_item_end(self, item_index: int, duration: float, ctx: CallbackContext) -> None:
        self._item_done(item_index, None)

    def on_map_item_error(self, item_index: int, error: Exception, ctx: CallbackContext) -> None:
        self._item_done(item_index, error)

    # --- nodes --------------------------------------------------------------------------------------

    # Node events replayed from a worker (nodelog.py) carry their item, pid and wall-clock times in
    # the context: their spans hang under that item's span and keep the worker's timing.

    def _node_span(self, node_id: str, ctx: CallbackContext, cached: bool, push: bool, by_item: bool = False,
                   **attributes: Any) -> Any:
        times = ctx.get("hardy.event_ns")
        item = ctx.get("hardy.item")
        by_item = by_item or times is not None  # from a worker: under its item, not this thread's stack
        parent = self._items.get(self._map_key(item)) if by_item and item is not None else None
        worker = ctx.get("hardy.worker_pid") if by_item else None
        if parent is not None and worker:  # where the item really ran: not known when it was handed
            parent.set_attribute("hardy.worker.pid", worker)  # to an engine, nor the worker a retry replaced
        return self._start("node", f"hardy.node {node_id}",
                           {"hardy.node": node_id, "hardy.cache_hit": cached,
                            "hardy.worker.pid": worker or os.getpid(),
                            "hardy.retry": ctx.get("hardy.retry") or 0,
                            **attributes}, push=push, parent=parent, start_time=times[0] if times else None)

    def on_node_start(self, node_id: str, inputs: dict[str, Any], ctx: CallbackContext) -> None:
        self._node_span(node_id, ctx, cached=False, push=True)

    def _end_time(self, ctx: CallbackContext) -> int | None:
        times = ctx.get("hardy.event_ns")
        return times[1] if times else None

    def on_node_end(self, node_id: str, outputs: dict[str, Any], duration: float, ctx: CallbackContext) -> None:
        self._end("node", end_time=self._end_time(ctx), pid=ctx.get("hardy.worker_pid"))

    def on_error(self, node_id: str, error: Exception, ctx: CallbackContext) -> None:
        if self._top() != "node":  # a crash reported by the parent: the node's span never started
            self._node_span(node_id, ctx, cached=False, push=True, by_item=True)
        self._end("node", error, end_time=self._end_time(ctx), pid=ctx.get("hardy.worker_pid"))

    def on_node_cached(self, node_id: str, signature: str, ctx: CallbackContext) -> None:
        attributes: dict[str, Any] = {"hardy.cache_key": signature}
        span = self._node_span(node_id, ctx, cached=True, push=False, **attributes)
        span.end(end_time=self._end_time(ctx))
