"""Watching a pipeline run: callbacks (events) and the map progress bar.

Both stay off the hot path when unused: with no callback registered, plans are compiled without
instrumentation, and progress costs one counter increment per item.

The names below load on first use (PEP 562): a worker imports this package for its node log
(`nodelog`) alone, and the run report's modules would lengthen every fork server's boot.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .callbacks import CallbackContext, PipelineCallback
    from .otel import OpenTelemetryCallback
    from .progress import MapProgress
    from .report import RunReport

__all__ = ["CallbackContext", "PipelineCallback", "MapProgress", "RunReport", "OpenTelemetryCallback"]


def __getattr__(name: str) -> Any:
    if name in ("CallbackContext", "PipelineCallback"):
        from . import callbacks
        return getattr(callbacks, name)
    if name == "MapProgress":
        from .progress import MapProgress
        return MapProgress
    if name == "RunReport":
        from .report import RunReport
        return RunReport
    if name == "OpenTelemetryCallback":  # the otel extra is optional
        from .otel import OpenTelemetryCallback
        return OpenTelemetryCallback
    raise AttributeError(f"module 'hardy.observe' has no attribute {name!r}")
