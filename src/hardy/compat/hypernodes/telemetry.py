"""`hypernodes.telemetry`: progress bars and Logfire spans, as callbacks.

ProgressCallback draws hardy's own map bar (done/total, rate, ETA, failures); TelemetryCallback
opens a Logfire span per pipeline and node, as HyperNodes' does, and keeps `span_data`.
"""

from __future__ import annotations

import time
from typing import Any

from ...observe import CallbackContext, MapProgress, PipelineCallback


class ProgressCallback(PipelineCallback):
    """A live bar for every map (items done, cached and failed)."""

    def __init__(self, enable: bool = True):
        self.enable = enable
        self._bars: list[MapProgress] = []

    def on_map_start(self, total_items: int, ctx: CallbackContext) -> None:
        bar = MapProgress(total_items, ctx.current_pipeline_id or "map", self.enable)
        self._bars.append(bar.__enter__())

    def on_map_item_end(self, item_index: int, duration: float, ctx: CallbackContext) -> None:
        if self._bars:
            self._bars[-1].done += 1

    def on_map_item_error(self, item_index: int, error: Exception, ctx: CallbackContext) -> None:
        if self._bars:
            self._bars[-1].failed += 1

    def on_map_end(self, total_duration: float, ctx: CallbackContext) -> None:
        if self._bars:
            self._bars.pop().__exit__(None, None, None)


class TelemetryCallback(PipelineCallback):
    """Logfire spans for pipelines and nodes (needs `pip install logfire`)."""

    def __init__(self, trace_map_items: bool = True, logfire_instance: Any = None):
        try:
            import logfire
        except ImportError as exc:
            raise ImportError("TelemetryCallback needs logfire: pip install logfire") from exc
        self.logfire = logfire_instance or logfire
        self.trace_map_items = trace_map_items
        self.span_data: list[dict[str, Any]] = []

    def _open(self, kind: str, name: str, ctx: CallbackContext) -> None:
        span = self.logfire.span(f"{kind}:{name}", depth=ctx.depth).__enter__()
        ctx.set(f"span:{name}", (span, time.time()))

    def _close(self, kind: str, name: str, duration: float, ctx: CallbackContext, cached: bool = False) -> None:
        span, start = ctx.get(f"span:{name}", (None, time.time()))
        if span is not None:
            span.set_attribute("duration", duration)
            span.__exit__(None, None, None)
        self.span_data.append({"name": name, "start_time": start, "duration": duration, "depth": ctx.depth,
                               "parent": ctx.current_pipeline_id, "cached": cached, "type": kind})

    def on_pipeline_start(self, pipeline_id: str, inputs: dict[str, Any], ctx: CallbackContext) -> None:
        self._open("pipeline", pipeline_id, ctx)

    def on_pipeline_end(self, pipeline_id: str, outputs: dict[str, Any], duration: float, ctx: CallbackContext) -> None:
        self._close("pipeline", pipeline_id, duration, ctx)

    def on_node_start(self, node_id: str, inputs: dict[str, Any], ctx: CallbackContext) -> None:
        self._open("node", node_id, ctx)

    def on_node_end(self, node_id: str, outputs: dict[str, Any], duration: float, ctx: CallbackContext) -> None:
        self._close("node", node_id, duration, ctx)

    def on_node_cached(self, node_id: str, signature: str, ctx: CallbackContext) -> None:
        self.span_data.append({"name": node_id, "start_time": time.time(), "duration": 0.0, "depth": ctx.depth,
                               "parent": ctx.current_pipeline_id, "cached": True, "type": "node"})


__all__ = ["ProgressCallback", "TelemetryCallback"]
