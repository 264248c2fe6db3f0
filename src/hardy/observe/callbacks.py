"""Lifecycle events for pipelines, nodes and map items.

The method names and signatures are HyperNodes' 0.4.8, so its callbacks work unchanged. A node
answered from the cache does not run: it reports `on_node_cached` (and, inside a map,
`on_map_item_cached`) instead of start/end. A nested pipeline reports `on_nested_pipeline_start/end`
around its own pipeline events, and its nodes report to the outer pipeline's callbacks.
Node events are produced by wrapping each node function at plan-compile time (see `instrument`),
which is why registering no callback costs nothing per call. Nodes that run inside worker
processes report node events there, not here; map-item events always fire in the caller.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import time
from typing import Any, Callable, Iterator, Sequence

from ..node import Node


class CallbackContext:
    """State shared by all callbacks of one top-level call; tracks the nesting of pipelines."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}
        self._stack: list[str] = []
        self._metadata: dict[str, dict[str, Any]] = {}

    def set(self, key: str, value: Any) -> None:
        self.data[key] = value

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    def get_pipeline_metadata(self, pipeline_id: str) -> dict[str, Any]:
        """{"total_nodes", "pipeline_name", "node_ids"} of a running pipeline (progress bars use it)."""
        return self._metadata.get(pipeline_id, {})

    def set_pipeline_metadata(self, pipeline_id: str, metadata: dict[str, Any]) -> None:
        self._metadata[pipeline_id] = metadata

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
    def on_node_cached(self, node_id: str, signature: str, ctx: CallbackContext) -> None: ...
    def on_error(self, node_id: str, error: Exception, ctx: CallbackContext) -> None: ...
    def on_nested_pipeline_start(self, parent_id: str, child_pipeline_id: str, ctx: CallbackContext) -> None: ...
    def on_nested_pipeline_end(self, parent_id: str, child_pipeline_id: str, duration: float,
                               ctx: CallbackContext) -> None: ...
    def on_map_start(self, total_items: int, ctx: CallbackContext) -> None: ...
    def on_map_end(self, total_duration: float, ctx: CallbackContext) -> None: ...
    def on_map_item_start(self, item_index: int, ctx: CallbackContext) -> None: ...
    def on_map_item_end(self, item_index: int, duration: float, ctx: CallbackContext) -> None: ...
    def on_map_item_cached(self, item_index: int, signature: str, ctx: CallbackContext) -> None: ...
    def on_map_item_error(self, item_index: int, error: Exception, ctx: CallbackContext) -> None: ...

    @property
    def supported_engines(self) -> list[str] | None:
        """HyperNodes' engine filter; every hardy engine reports the same events, so None (all)."""
        return None


_context: contextvars.ContextVar[CallbackContext | None] = contextvars.ContextVar("hardy_ctx", default=None)


def current_context() -> CallbackContext:
    ctx = _context.get()
    if ctx is None:
        ctx = CallbackContext()
        _context.set(ctx)
    return ctx


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

    def emit(self, event: str, *args: Any) -> None:
        ctx = current_context()
        for cb in self.callbacks:
            getattr(cb, event)(*args, ctx)

    def pipeline(self, pipeline_id: str, inputs: dict, call: Callable[[], dict],
                 node_ids: Sequence[str] = (), announce: bool = True) -> dict:
        """Runs `call` as pipeline `pipeline_id` in the callback context; `announce=False` (a map,
        whose items announce themselves) emits no on_pipeline_start/_end of its own."""
        with self.opened(pipeline_id, inputs, node_ids, announce) as finish:
            return finish(call())

    @contextlib.contextmanager
    def opened(self, pipeline_id: str, inputs: dict, node_ids: Sequence[str] = (),
               announce: bool = True) -> Iterator[Callable[[dict], dict]]:
        """Pipeline `pipeline_id` open in the callback context for the `with` block (a streamed map
        stays open while it is consumed); the block reports its outputs through the yielded function."""
        token = None
        if _context.get() is None:
            token = _context.set(CallbackContext())
        ctx = current_context()
        ctx.set_pipeline_metadata(pipeline_id, {"total_nodes": len(node_ids), "pipeline_name": pipeline_id,
                                                "node_ids": list(node_ids)})
        ctx.push_pipeline(pipeline_id)
        if announce:
            self.emit("on_pipeline_start", pipeline_id, inputs)
        start = time.perf_counter()

        def finish(out: dict) -> dict:
            if announce:
                self.emit("on_pipeline_end", pipeline_id, out, time.perf_counter() - start)
            return out
        try:
            yield finish
        finally:
            ctx.pop_pipeline()
            if token is not None:
                _context.reset(token)

    def item_started(self, i: int, index: int) -> None:
        """Item `i` of `items`, which is item `index` of the map (they differ in a streamed map)."""
        self.emit("on_map_item_start", index)
        self.emit("on_pipeline_start", self.pipeline_id, dict(self.items[i]) if self.items else {})

    def item_done(self, i: int, index: int, outputs: dict, duration: float) -> None:
        self.emit("on_pipeline_end", self.pipeline_id, outputs, duration)
        self.emit("on_map_item_end", index, duration)

    def item_failed(self, i: int, error: Exception) -> None:
        self.emit("on_map_item_error", i, error)

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
