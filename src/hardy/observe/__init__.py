"""Watching a pipeline run: callbacks (events) and the map progress bar.

Both stay off the hot path when unused: with no callback registered, plans are compiled without
instrumentation, and progress costs one counter increment per item.
"""

from typing import Any

from .callbacks import CallbackContext, PipelineCallback
from .progress import MapProgress
from .report import RunReport

__all__ = ["CallbackContext", "PipelineCallback", "MapProgress", "RunReport", "OpenTelemetryCallback"]


def __getattr__(name: str) -> Any:
    if name == "OpenTelemetryCallback":  # the otel extra is optional
        from .otel import OpenTelemetryCallback
        return OpenTelemetryCallback
    raise AttributeError(f"module 'hardy.observe' has no attribute {name!r}")
