"""The callback interface: `PipelineCallback`, the `CallbackContext` its methods receive, and
which events a callback listens to.

The method names and signatures are HyperNodes' 0.4.8, so its callbacks work unchanged. A node
answered from the cache does not run: it reports `on_node_cached` (and, inside a map,
`on_map_item_cached`) instead of start/end. A nested pipeline reports `on_nested_pipeline_start/end`
around its own pipeline events, and its nodes report to the outer pipeline's callbacks. Only the
methods a callback overrides are called (`listening`); `events.py` delivers the events.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

_HYPERNODES_KEYS = ("_in_map", "_map_item_index")  # HyperNodes' callbacks read these from the context


class CallbackContext:
    """State shared by all callbacks of one top-level call; tracks the nesting of pipelines."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}
        self._stack: list[str] = []
        self._metadata: dict[str, dict[str, Any]] = {}

    def set(self, key: str, value: Any) -> None:
        self.data[key] = value

    def get(self, key: str, default: Any = None) -> Any:
        """A value set by a callback, or one of hardy's item-scoped values: `hardy.item` (the map
        item the current event belongs to), `hardy.worker_pid` (the worker process it ran in, None
        for this process), `hardy.event_ns` (wall-clock start and end, in nanoseconds, of a
        node event that happened in a worker and is replayed here) and `hardy.retry` (how many
        times the item ran before, on workers that died). HyperNodes' `_in_map` and
        `_map_item_index` say the same as `hardy.item`."""
        scope = item_scope.get()
        if key in scope:
            return scope[key]
        if key in _HYPERNODES_KEYS and key not in self.data:  # HyperNodes' names for the map item
            item = scope.get("hardy.item")
            return item is not None if key == "_in_map" else item
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

    def on_pipeline_start(self, pipeline_id: str, inputs: dict[str, Any], ctx: CallbackContext) -> None: ...
    def on_pipeline_end(self, pipeline_id: str, outputs: dict[str, Any], duration: float,
                        ctx: CallbackContext) -> None: ...
    def on_node_start(self, node_id: str, inputs: dict[str, Any], ctx: CallbackContext) -> None: ...
    def on_node_end(self, node_id: str, outputs: dict[str, Any], duration: float, ctx: CallbackContext) -> None: ...
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
    def on_batch_end(self, node_id: str, size: int, duration: float, ctx: CallbackContext) -> None:
        """hardy's: one call of a batched node (`@node(batch_size=)`) on `size` items took
        `duration` seconds; each item still has its own node events (docs/batching.md)."""

    @property
    def supported_engines(self) -> list[str] | None:
        """HyperNodes' engine filter; every hardy engine reports the same events, so None (all)."""
        return None


NODE_EVENTS = ("on_node_start", "on_node_end", "on_error")
ITEM_EVENTS = ("on_map_item_start", "on_pipeline_start", "on_pipeline_end", "on_map_item_end", "on_map_item_error")
_NO_OPS = {name: getattr(PipelineCallback, name) for name in vars(PipelineCallback) if name.startswith("on_")}


@functools.cache
def listened(cls: type) -> frozenset[str]:
    """The events a callback class overrides (a method it lacks is not listened to either)."""
    return frozenset(e for e, no_op in _NO_OPS.items() if getattr(cls, e, no_op) is not no_op)


def listening(callbacks: Sequence[Any]) -> list[Any]:
    """The callbacks that override some event: a pipeline compiles without events when none does,
    so that a callback overriding nothing costs nothing, as no callback does."""
    return [cb for cb in callbacks if listened(type(cb))]  # type: ignore[arg-type]  # mypy: a class is Hashable


# The context shared by the callbacks of the top-level call under way (None outside one).
call_context: contextvars.ContextVar[CallbackContext | None] = contextvars.ContextVar("hardy_ctx", default=None)


# Item-scoped values live in a contextvar, not in the shared `data`: the items of an async map
# interleave on one thread, each in its own task (and so its own copy of this variable).
item_scope: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "hardy_scope", default=MappingProxyType({}))


def in_call() -> bool:
    """Whether this runs inside an observed call (a nested pipeline), not at the top level."""
    return call_context.get() is not None


def current_context() -> CallbackContext:
    ctx = call_context.get()
    if ctx is None:
        ctx = CallbackContext()
        call_context.set(ctx)
    return ctx


class CallbackList(list[Any]):
    """A pipeline's callbacks (`Pipeline.callbacks`): node callbacks are compiled into plans, so
    changing the list calls `changed` (the pipeline then compiles its plans anew)."""

    def __init__(self, callbacks: Sequence[PipelineCallback], changed: Callable[[], None]):
        super().__init__(callbacks)
        self._changed = changed


def _notifying(name: str) -> Callable[..., Any]:
    method = getattr(list, name)

    def changed(self: CallbackList, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        self._changed()
        return result
    return changed


for _method in ("append", "extend", "insert", "remove", "pop", "clear", "sort", "reverse", "__setitem__",
              "__delitem__", "__iadd__"):
    setattr(CallbackList, _method, _notifying(_method))
