"""Lifecycle events for pipelines, nodes and map items.

The method names and signatures are HyperNodes' (seed 003), so its callbacks work unchanged.
A node answered from the cache does not run, so it reports no node events (HyperNodes'
`on_node_cached` is not emitted).
Node events are produced by wrapping each node function at plan-compile time (see `instrument`),
which is why registering no callback costs nothing per call. Nodes that run inside worker
processes report node events there, not here; map-item events always fire in the caller.
"""

from __future__ import annotations

import contextvars
import functools
import time
from typing import Any, Callable, Sequence

from ..node import Node


class CallbackContext:
    """State shared by all callbacks of one top-level call; tracks the nesting of pipelines."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}
        self._stack: list[str] = []

    def set(self, key: str, value: Any) -> None:
        self.data[key] = value

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    def push_pipeline(self, pipeline_id: str) -> None:
        self._stack.append(pipeline_id)

    def pop_pipeline(self) -> str:
        return self._stack.pop()

    @property
    def current_pipeline_id(self) -> str | None:
        return self._stack[-1] if self._stack else None

    @property
    def parent_pipeline_id(self) -> str | None:
        return self._stack[-2] if len(self._stack) >= 2 else None

    @property
    def depth(self) -> int:
        return len(self._stack)

    @property
    def hierarchy_path(self) -> list[str]:
        return list(self._stack)


class PipelineCallback:
    """Override what you need; every method is a no-op by default."""

    def on_pipeline_start(self, pipeline_id: str, inputs: dict, ctx: CallbackContext) -> None: ...
    def on_pipeline_end(self, pipeline_id: str, outputs: dict, duration: float,
                        ctx: CallbackContext) -> None: ...
    def on_node_start(self, node_id: str, inputs: dict, ctx: CallbackContext) -> None: ...
    def on_node_end(self, node_id: str, outputs: dict, duration: float, ctx: CallbackContext) -> None: ...
    def on_error(self, node_id: str, error: Exception, ctx: CallbackContext) -> None: ...
    def on_map_start(self, total_items: int, ctx: CallbackContext) -> None: ...
    def on_map_end(self, total_duration: float, ctx: CallbackContext) -> None: ...
    def on_map_item_start(self, item_index: int, ctx: CallbackContext) -> None: ...
    def on_map_item_end(self, item_index: int, duration: float, ctx: CallbackContext) -> None: ...
    def on_map_item_error(self, item_index: int, error: Exception, ctx: CallbackContext) -> None: ...


_context: contextvars.ContextVar[CallbackContext | None] = contextvars.ContextVar("hardy_ctx", default=None)


def current_context() -> CallbackContext:
    ctx = _context.get()
    if ctx is None:
        ctx = CallbackContext()
        _context.set(ctx)
    return ctx


class Events:
    """Fans one event out to a pipeline's callbacks, each call guarded by the same context."""

    def __init__(self, callbacks: Sequence[PipelineCallback]):
        self.callbacks = tuple(callbacks)

    def emit(self, event: str, *args: Any) -> None:
        ctx = current_context()
        for cb in self.callbacks:
            getattr(cb, event)(*args, ctx)

    def pipeline(self, pipeline_id: str, inputs: dict, call: Callable[[], dict]) -> dict:
        token = None
        if _context.get() is None:
            token = _context.set(CallbackContext())
        ctx = current_context()
        ctx.push_pipeline(pipeline_id)
        self.emit("on_pipeline_start", pipeline_id, inputs)
        start = time.perf_counter()
        try:
            out = call()
            self.emit("on_pipeline_end", pipeline_id, out, time.perf_counter() - start)
            return out
        finally:
            ctx.pop_pipeline()
            if token is not None:
                _context.reset(token)

    def instrument(self, node: Node, func: Callable[..., Any]) -> Callable[..., Any]:
        """`func` (the node's function, or its call into a worker), wrapped to report events."""
        name, params = node.name, node.inputs

        def outputs(value: Any) -> dict:
            return {node.outputs[0]: value} if len(node.outputs) == 1 else dict(zip(node.outputs, value))

        def inputs(args: tuple, kwargs: dict) -> dict:
            return {**dict(zip(params, args)), **kwargs}

        if node.is_async:
            @functools.wraps(func)
            async def observed_async(*args: Any, **kwargs: Any) -> Any:
                self.emit("on_node_start", name, inputs(args, kwargs))
                start = time.perf_counter()
                try:
                    value = await func(*args, **kwargs)
                except Exception as exc:
                    self.emit("on_error", name, exc)
                    raise
                self.emit("on_node_end", name, outputs(value), time.perf_counter() - start)
                return value
            return observed_async

        @functools.wraps(func)
        def observed(*args: Any, **kwargs: Any) -> Any:
            self.emit("on_node_start", name, inputs(args, kwargs))
            start = time.perf_counter()
            try:
                value = func(*args, **kwargs)
            except Exception as exc:
                self.emit("on_error", name, exc)
                raise
            self.emit("on_node_end", name, outputs(value), time.perf_counter() - start)
            return value
        return observed
